"""What the processes the job went on without wrote into the shared folder after it did: nothing,
if the writers' fence holds (issue 42: "nothing written by the cut-off").

Each ``shrink`` in events.jsonl that dropped ranks (hung or died, not those that left of their
own accord, whose last records are their own) names them, their hosts, the generation they were
dropped from and when the survivors' new group was up (``regrouped_time``). After that moment,
none of these may have been written by the processes dropped:

- a checkpoint of that generation or an earlier one (its manifest's ``restart_generation`` and
  ``saved_at``), whoever wrote it;
- an events.jsonl record whose ``writer`` is a process of a dropped host that wrote there before;
- a TensorBoard record in a file of such a process (the file's name holds its host and pid);
- an audit record of a dropped rank in that generation (``audit/g<G>-r<rank>.jsonl``).

    scripts/cutoff.py SHARED RUN_ID     prints each late write; exit 1 if there is any
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path


def epoch(iso: str) -> float:
    return datetime.datetime.fromisoformat(iso).timestamp()


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    found = []
    for line in path.read_text().splitlines():
        try:
            found.append(json.loads(line))
        except ValueError:  # a last line cut short by a kill
            continue
    return found


def drops(records: list[dict]) -> list[dict]:
    """The shrinks that dropped ranks: who, from which generation, and when."""
    found = []
    for r in records:
        if r.get("event") != "shrink" or r.get("why") == "left" or "regrouped_time" not in r:
            continue
        found.append({"ranks": r["lost_ranks"], "hosts": set(r["lost_hosts"]),
                      "generation": r["restart_generation"] - 1,
                      "at": epoch(r["regrouped_time"]), "step": r["step"]})
    return found


def tensorboard_times(path: Path) -> list[float]:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    return [event.wall_time for event in EventFileLoader(str(path)).Load()]


def late_writes(shared: Path, run_id: str) -> list[str]:
    """Each write by a process the job had gone on without, after it had (see above)."""
    run_dir, ckpt = shared / "runs" / run_id, shared / "ckpt"
    records = events(run_dir)
    late: list[str] = []
    for drop in drops(records):
        at, hosts, generation = drop["at"], drop["hosts"], drop["generation"]
        said = f"after generation {generation} went on without rank(s) {drop['ranks']}"
        for manifest in sorted(ckpt.glob("step-*.json")):
            try:
                m = json.loads(manifest.read_text())
            except (OSError, ValueError):
                continue
            if m.get("restart_generation", 0) <= generation and epoch(m["saved_at"]) > at:
                late.append(f"{manifest.name}: saved in generation {m['restart_generation']} "
                            f"{epoch(m['saved_at']) - at:.1f} s {said}")
        writers = {r["writer"] for r in records if "writer" in r and epoch(r["time"]) < at
                   and r["writer"].split("/")[0] in hosts}
        for r in records:
            if r.get("writer") in writers and epoch(r["time"]) > at:
                late.append(f"events.jsonl: {r['event']} at step {r['step']} by {r['writer']} "
                            f"{epoch(r['time']) - at:.1f} s {said}")
        for path in sorted(run_dir.glob("events.out.tfevents.*")):
            if not any(f".{host}." in path.name for host in hosts):  # .<time>.<host>.<pid>.
                continue
            times = tensorboard_times(path)
            if times and min(times) < at and max(times) > at:
                late.append(f"{path.name}: {sum(t > at for t in times)} record(s) up to "
                            f"{max(times) - at:.1f} s {said}")
        for rank in drop["ranks"]:
            audit = run_dir / "audit" / f"g{generation}-r{rank}.jsonl"
            if not audit.exists():
                continue
            for line in audit.read_text().splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if record["time"] > at:
                    late.append(f"{audit.name}: step {record['step']} "
                                f"{record['time'] - at:.1f} s {said}")
    return late


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("shared", type=Path, help="the job's shared folder (ckpt/, runs/)")
    parser.add_argument("run_id")
    args = parser.parse_args(argv)
    late = late_writes(args.shared, args.run_id)
    for line in late:
        print(line)
    print(f"cutoff: {len(late)} late write(s)" if late else "cutoff: nothing written late")
    return 1 if late else 0


if __name__ == "__main__":
    sys.exit(main())
