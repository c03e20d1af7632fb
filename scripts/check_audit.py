#!/usr/bin/env python3
"""Checks a run's sample audit: every completed epoch used every sample exactly once.

    scripts/check_audit.py RUN_DIR [--num-samples N] [--every-rank-busy]

Reads RUN_DIR/audit/g<G>-r<R>.jsonl (written with --audit-samples). For every step it takes the
records of the newest restart generation that completed it (a record from each of that generation's
ranks), then checks each epoch whose steps are all present: its indices must be a permutation of
0..N-1, N taken from --num-samples or from the largest index seen. With --every-rank-busy, also
that every rank had samples of its own in every completed step (no rank ran a pass that counts
for nothing). Exit 0 when all hold, 1 if not, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

FILE = re.compile(r"g(\d+)-r(\d+)\.jsonl$")


def load_records(run_dir: Path) -> dict[int, dict[int, list[dict]]]:
    """records[generation][step] -> that generation's records of that step (one per rank)."""
    records: dict[int, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    files = sorted((run_dir / "audit").glob("g*-r*.jsonl"))
    if not files:
        raise ValueError(f"no audit files in {run_dir / 'audit'}; was --audit-samples set?")
    for path in files:
        generation = int(FILE.search(path.name).group(1))
        for number, line in enumerate(path.read_text().splitlines(), 1):
            try:
                record = json.loads(line)
            except ValueError:
                if number == len(path.read_text().splitlines()):
                    continue  # a line cut short by a kill
                raise ValueError(f"{path}:{number} is not JSON") from None
            records[generation][record["step"]].append(record)
    return records


def completed_steps(records: dict[int, dict[int, list[dict]]]) -> dict[int, list[dict]]:
    """For each step, the records of the newest generation in which every rank recorded it
    (ranks left without a micro-batch record an empty list)."""
    chosen: dict[int, list[dict]] = {}
    for generation in sorted(records):
        for step, recs in records[generation].items():
            ranks = {r["rank"] for r in recs}
            if len(ranks) == len(recs) == recs[0]["world_size"]:
                chosen[step] = recs
    return chosen


def idle_ranks(steps: dict[int, list[dict]]) -> list[str]:
    """The completed steps in which some rank had no sample, as sentences."""
    problems = []
    for step, recs in sorted(steps.items()):
        idle = sorted(r["rank"] for r in recs if not r["indices"])
        if idle:
            problems.append(f"step {step}: ranks {idle[:8]} of {recs[0]['world_size']} had no "
                            f"sample")
    return problems


def check(run_dir: Path, num_samples: int | None = None,
          every_rank_busy: bool = False) -> list[str]:
    """Problems found, as sentences; empty when every completed epoch is exact (and, if asked,
    every rank of every completed step had samples)."""
    steps = completed_steps(load_records(run_dir))
    by_epoch: dict[int, list[int]] = defaultdict(list)
    for step in sorted(steps):
        by_epoch[steps[step][0]["epoch"]].append(step)
    n = num_samples or 1 + max(i for recs in steps.values() for r in recs for i in r["indices"])
    problems = []
    checked = 0
    for epoch, epoch_steps in sorted(by_epoch.items()):
        indices = [i for s in epoch_steps for r in steps[s] for i in r["indices"]]
        if len(indices) < n and epoch == max(by_epoch):
            continue  # the last epoch may be unfinished
        checked += 1
        counts = Counter(indices)
        repeated = sorted(i for i, c in counts.items() if c > 1)
        missing = sorted(set(range(n)) - set(counts))
        if repeated or missing:
            problems.append(f"epoch {epoch}: {len(repeated)} samples repeated "
                            f"(e.g. {repeated[:5]}), {len(missing)} missing (e.g. {missing[:5]})")
        gaps = sorted(set(range(epoch_steps[0], epoch_steps[-1] + 1)) - set(epoch_steps))
        if gaps:
            problems.append(f"epoch {epoch}: steps {gaps[:5]} were never completed")
    if checked == 0:
        problems.append("no completed epoch to check")
    if every_rank_busy:
        problems += idle_ranks(steps)[:5]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--num-samples", type=int, default=None)
    parser.add_argument("--every-rank-busy", action="store_true",
                        help="also fail where a rank had no sample in a completed step")
    args = parser.parse_args(argv)
    try:
        problems = check(args.run_dir, args.num_samples, args.every_rank_busy)
    except (OSError, ValueError, KeyError) as e:
        print(f"check_audit: error: {e}", file=sys.stderr)
        return 2
    for problem in problems:
        print(f"FAIL {problem}")
    if not problems:
        print("OK: every completed epoch used every sample exactly once"
              + (", and every rank had samples in every step" if args.every_rank_busy else ""))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
