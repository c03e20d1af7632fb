#!/usr/bin/env python3
"""Recovery time after losing a node: jobs/node.sh's rendezvous timing against torchrun's defaults.

    scripts/recovery.py [--repeats 2] [--update-readme]

Two simulated nodes on loopback (scripts/chaos.py), the whole process tree of the second one
SIGKILLed at step 60; measured from the kill to the first optimizer step the surviving node
completes after it. The two settings alternate, each run REPEATS times; the median is reported.
Writes bench/recovery.json and, with --update-readme, the table between the README's
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
SETTINGS = {"jobs/node.sh": [], "torchrun defaults": ["--rdzv-defaults"]}
FIELDS = (("noticed_s", "old workers gone (s)"), ("restarted_s", "new workers started (s)"),
          ("first_step_s", "first step after the kill (s)"))


def measure(extra: list[str], workdir: Path) -> dict:
    out = workdir / "faults.json"
    status = chaos.main(["--nodes", "2", "--start-nodes", "2", "--store", "agent", "--steps",
                         "160", "--schedule", "60:kill-node:1", "--workdir", str(workdir),
                         "--json", str(out), *extra])
    if status != 0:
        raise SystemExit(f"recovery: the chaos run in {workdir} failed")
    return json.loads(out.read_text())["faults"][0]


def render(results: dict[str, list[dict]]) -> str:
    rows = ["| rendezvous timing | " + " | ".join(title for _, title in FIELDS) + " |",
            "| --- |" + " ---: |" * len(FIELDS)]
    for setting, runs in results.items():
        cells = []
        for field, _ in FIELDS:
            values = [r[field] for r in runs]
            cells.append(f"{statistics.median(values):.1f} ({min(values):.1f}–{max(values):.1f})")
        rows.append(f"| {setting} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def update_readme(table: str, repeats: int) -> None:
    readme = REPO / "README.md"
    text = readme.read_text()
    begin, end = "<!-- recovery:begin -->", "<!-- recovery:end -->"
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    body = (f"\n{table}\n\nMedian (min–max) of {repeats} runs on {platform.node()} "
            f"({platform.machine()}, {len(os.sched_getaffinity(0))} cores), from "
            f"`bench/recovery.json`; reproduce with `scripts/recovery.py --update-readme`.\n")
    readme.write_text(head + begin + body + end + tail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--update-readme", action="store_true")
    args = parser.parse_args(argv)
    results: dict[str, list[dict]] = {setting: [] for setting in SETTINGS}
    root = Path(tempfile.mkdtemp(prefix="recovery-"))
    for repeat in range(args.repeats):
        for n, (setting, extra) in enumerate(SETTINGS.items()):
            results[setting].append(measure(extra, root / f"{repeat}-{n}"))
    table = render(results)
    print(table)
    out = REPO / "bench" / "recovery.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"machine": platform.node(), "runs": results}, indent=2))
    if args.update_readme:
        update_readme(table, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
