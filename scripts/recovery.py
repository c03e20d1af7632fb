#!/usr/bin/env python3
"""Recovery from a lost, departing or frozen node: in process against a restart, side by side.

    scripts/recovery.py [--repeats 3] [--only NAME,...] [--update-readme]

Each scenario is a chaos run (scripts/chaos.py) on loopback with one fault at step 40 of 160; the
job runs with ``--recovery in-process`` and with ``--recovery restart`` in turn, alternating, each
REPEATS times. Measured from the fault to the first optimizer step the survivors complete after
it (from the run's audit records), with the steps redone; medians with min and max. Writes
bench/recovery.json and, with --update-readme, the table between the README's
``<!-- recovery:begin -->`` and ``<!-- recovery:end -->`` markers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import chaos

REPO = Path(__file__).resolve().parents[1]
HANG_TIMEOUT = 10.0
"""The watchdog's default deadline, which a frozen worker costs at least."""
SCENARIOS = {
    "kill-torchrun": ("2 nodes × 2 workers, a node SIGKILLed, plain torchrun",
                      ["--launch", "torchrun", "--store", "agent", "--nodes", "2",
                       "--start-nodes", "2", "--nproc-per-node", "2",
                       "--schedule", "40:kill-node:1"], 2.0),
    "kill-node-sh": ("the same under jobs/node.sh",
                     ["--store", "agent", "--nodes", "2", "--start-nodes", "2",
                      "--nproc-per-node", "2", "--schedule", "40:kill-node:1"], 2.0),
    "sigterm": ("2 nodes × 2 workers, a node's agent SIGTERMed, jobs/node.sh",
                ["--store", "agent", "--nodes", "2", "--start-nodes", "2",
                 "--nproc-per-node", "2", "--schedule", "40:leave:1"], 2.0),
    "sigstop": ("3 nodes × 1 worker, a worker SIGSTOPped alone on its node, jobs/node.sh",
                ["--store", "external", "--nodes", "3", "--start-nodes", "3",
                 "--schedule", "40:hang-worker:2"], HANG_TIMEOUT + 3),
}
"""name: (what, chaos flags, target seconds in process)."""
MODES = ("in-process", "restart")


def measure(flags: list[str], mode: str, workdir: Path) -> dict:
    out = workdir / "faults.json"
    status = chaos.main([*flags, "--steps", "160", "--recovery", mode, "--no-reference",
                         "--workdir", str(workdir), "--json", str(out)])
    if status != 0:
        raise SystemExit(f"recovery: the chaos run in {workdir} failed")
    (fault,) = json.loads(out.read_text())["faults"]
    return fault


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}–{max(values):.1f})"


def render(results: dict[str, dict[str, list[dict]]]) -> str:
    rows = [("| fault | in process (s) | steps redone | by a restart (s) | steps redone | "
             "target in process (s) |"),
            "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, by_mode in results.items():
        what, _, target = SCENARIOS[name]
        cells = []
        for mode in MODES:
            runs = by_mode[mode]
            cells += [cell([r["first_step_s"] for r in runs]),
                      "–".join(sorted({str(r["steps_redone"]) for r in runs}))]
        rows.append(f"| {what} | {' | '.join(cells)} | ≤ {target:g} |")
    return "\n".join(rows)


def update_readme(table: str, repeats: int) -> None:
    readme = REPO / "README.md"
    text = readme.read_text()
    begin, end = "<!-- recovery:begin -->", "<!-- recovery:end -->"
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    body = (f"\n{table}\n\nSeconds from the fault to the survivors' first completed step, median "
            f"(min–max) of {repeats} runs of each, the two modes alternating, on "
            f"{platform.machine()} with {len(os.sched_getaffinity(0))} cores, from "
            f"`bench/recovery.json`; reproduce with `scripts/recovery.py --update-readme`.\n")
    readme.write_text(head + begin + body + end + tail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default=",".join(SCENARIOS),
                        help=f"scenarios to run, comma-separated ({','.join(SCENARIOS)})")
    parser.add_argument("--update-readme", action="store_true")
    args = parser.parse_args(argv)
    names = args.only.split(",")
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        parser.error(f"unknown scenarios {unknown}; choose from {', '.join(SCENARIOS)}")
    results = {name: {mode: [] for mode in MODES} for name in names}
    root = Path(tempfile.mkdtemp(prefix="recovery-"))
    for repeat in range(args.repeats):
        for name in names:
            order = MODES if repeat % 2 == 0 else MODES[::-1]
            for mode in order:
                fault = measure(SCENARIOS[name][1], mode, root / f"{name}-{mode}-{repeat}")
                results[name][mode].append(fault)
                print(f"recovery: {name} {mode}: first step {fault['first_step_s']:.1f} s after "
                      f"the fault ({fault['recovery']})", flush=True)
    table = render(results)
    print(table)
    out = REPO / "bench" / "recovery.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"machine": platform.machine(), "cores": len(os.sched_getaffinity(0)),
                               "repeats": args.repeats, "runs": results}, indent=2))
    if args.update_readme:
        update_readme(table, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
