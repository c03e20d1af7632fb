#!/usr/bin/env python3
"""Recovery from a lost, departing, frozen or joining node: in process against a restart, side by
side.

    scripts/recovery.py [--repeats 3] [--only NAME,...] [--update-readme]
    scripts/recovery.py --soak NAME [--repeats 10]

Each scenario is a chaos run (scripts/chaos.py) on loopback with a fault at step 40 of 160 (of
more where the answer takes longer; the last of a scenario's faults is the one measured); the job runs with ``--recovery in-process``
and with ``--recovery restart`` in turn, alternating, each REPEATS times. Measured: the seconds
from the fault (for a join, the new node's launch) to the first optimizer step the job completes
after it (at its new size), the others' longest wait between two steps until the job is back at
its size, and when it is (audit records), the steps redone, and, in process, the seconds from
the job's last step to the exit of the last surviving node's torchrun; medians with min and max.
Writes bench/recovery.json and, with --update-readme, its medians in six columns between the
README's ``<!-- recovery:begin -->`` and ``<!-- recovery:end -->`` markers, and every figure
between docs/recovery.md's ``recovery-detail`` markers. ``--only`` measures some
scenarios again and keeps the others' runs from bench/recovery.json (when they were measured as
many times, on a machine of the same kind and cores). ``kill-32`` and ``join-32`` take about 20
minutes each on 2 cores, the others 3 to 5 minutes each.

``--soak NAME`` runs one scenario in process only, REPEATS times (``make recovery-soak``: the
card's shape, ``kill-32``), and says for each run whether the survivors went on in process or
fell back to a restart, and then in which phase of the recovery and why (the ``fallback``
records of the run's events.jsonl); it exits 1 unless every run went on in process.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import chaos
import markers

from elastic_mnist.events import read_events

REPO = Path(__file__).resolve().parents[1]
HANG_TIMEOUT = 10.0
"""The watchdog's default deadline, which a frozen worker costs at least."""
@dataclass(frozen=True)
class Scenario:
    """One fault, how the job is launched, the chaos flags that make it, and the targets."""

    fault: str
    launch: str
    flags: list[str]
    targets: dict[str, float]
    """In process: seconds from the fault to the first step after it, ``first_step_s``; the
    others' longest wait between two steps, ``gap_s``; back at the job's size, ``full_s``."""


BY_HAND = "torchrun by hand¹"
"""The README's multi-node torchrun line with jobs/node.sh's rendezvous timing (the detailed
table shows it as chaos runs it)."""
SCENARIOS = {
    "kill-torchrun": Scenario("2 nodes × 2 workers, a node SIGKILLed", BY_HAND,
                              ["--launch", "torchrun", "--store", "agent", "--nodes", "2",
                               "--start-nodes", "2", "--nproc-per-node", "2",
                               "--schedule", "40:kill-node:1"], {"first_step_s": 2.0}),
    "kill-node-sh": Scenario("2 nodes × 2 workers, a node SIGKILLed", "jobs/node.sh",
                             ["--store", "agent", "--nodes", "2", "--start-nodes", "2",
                              "--nproc-per-node", "2", "--schedule", "40:kill-node:1"],
                             {"first_step_s": 2.0}),
    "sigterm": Scenario("2 nodes × 2 workers, a node's agent SIGTERMed (preempted)",
                        "jobs/node.sh",
                        ["--store", "agent", "--nodes", "2", "--start-nodes", "2",
                         "--nproc-per-node", "2", "--schedule", "40:leave:1"],
                        {"first_step_s": 2.0}),
    "sigstop": Scenario("3 nodes × 1 worker, a worker SIGSTOPped alone on its node",
                        "jobs/node.sh",
                        ["--store", "external", "--nodes", "3", "--start-nodes", "3",
                         "--schedule", "40:hang-worker:2"], {"first_step_s": HANG_TIMEOUT + 3}),
    "kill-32": Scenario("4 nodes × 8 workers (the card's shape), a node SIGKILLed: 32 → 24",
                        "jobs/node.sh",
                        ["--store", "agent", "--nodes", "4", "--start-nodes", "4",
                         "--nproc-per-node", "8", "--global-batch-size", "512",
                         "--schedule", "40:kill-node:3", "--timeout", "900"],
                        {"first_step_s": 5.0}),
    "join": Scenario("2 nodes × 2 workers, a third node joins (timed from its launch)",
                     "jobs/node.sh",
                     ["--store", "agent", "--nodes", "3", "--start-nodes", "2",
                      "--nproc-per-node", "2", "--schedule", "40:join", "--steps", "480"],
                     {"first_step_s": 8.0, "gap_s": 2.0}),
    "kill-worker": Scenario("2 nodes × 2 workers, a worker SIGKILLed on a node that lives on",
                            "jobs/node.sh",
                            ["--store", "agent", "--nodes", "2", "--start-nodes", "2",
                             "--nproc-per-node", "2", "--schedule", "40:kill-worker:1",
                             "--steps", "480"], {"gap_s": 2.0, "full_s": 15.0}),
    "join-32": Scenario("4 nodes × 8 workers, the node lost at step 40 back at step 80 (its join "
                        "measured)", "jobs/node.sh",
                        ["--store", "agent", "--nodes", "4", "--start-nodes", "4",
                         "--nproc-per-node", "8", "--global-batch-size", "512",
                         "--schedule", "40:kill-node:3,80:join", "--steps", "320",
                         "--timeout", "900"], {"gap_s": 5.0}),
}
"""The last fault of a scenario is the one measured."""
LOST_NODE = ("kill-torchrun", "kill-node-sh", "sigterm", "kill-32")
"""The scenarios of a node lost (killed or preempted): the README's opening quotes their span."""
TARGET_NAMES = {"first_step_s": "first step", "gap_s": "gap", "full_s": "full size"}
MODES = ("in-process", "restart")


def measure(flags: list[str], mode: str, workdir: Path) -> dict:
    out = workdir / "faults.json"
    status = chaos.main(["--steps", "160", *flags, "--recovery", mode, "--no-reference",
                         "--workdir", str(workdir), "--json", str(out)])
    if status != 0:
        raise SystemExit(f"recovery: the chaos run in {workdir} failed")
    report = json.loads(out.read_text())
    fault = report["faults"][-1]
    if fault["first_step_s"] is None:
        raise SystemExit(f"recovery: the job in {workdir} ended before it answered its "
                         f"{fault['kind']}: give the scenario more --steps")
    exits = report["exit_after_last_step_s"].values()
    return {**fault, "exit_after_last_step_s": None if None in exits else max(exits, default=None)}


def soak(name: str, repeats: int, root: Path) -> int:
    """``name`` in process, ``repeats`` times: how each run recovered, and why not in process."""
    in_process = 0
    for repeat in range(repeats):
        workdir = root / f"{name}-{repeat}"
        out = workdir / "faults.json"
        chaos.main(["--steps", "160", *SCENARIOS[name].flags, "--recovery", "in-process",
                    "--no-reference", "--workdir", str(workdir), "--json", str(out)])
        faults = json.loads(out.read_text())["faults"] if out.exists() else []
        events = workdir / "shared" / "runs" / "chaos" / "events.jsonl"
        fallbacks = [e for e in read_events(events) if e["event"] == "fallback"] \
            if events.exists() else []
        fault = faults[0] if faults else {}
        went_on = fault.get("recovery") == "in-process" and not fallbacks
        in_process += went_on
        why = "; ".join(sorted({f"rank {e['rank']} while {e['phase']}: {e['reason']}"
                                for e in fallbacks})) or "no fallback record"
        seconds = fault.get("first_step_s")
        print(f"recovery soak: {name} run {repeat + 1}/{repeats}: "
              + (f"in process, first step {seconds:.1f} s after the fault" if went_on else
                 f"fell back ({fault.get('recovery') or 'no recovery seen'}): {why}"),
              flush=True)
    print(f"recovery soak: {name}: {in_process} of {repeats} in process")
    return 0 if in_process == repeats else 1


def earlier_runs(path: Path, repeats: int) -> dict[str, dict[str, list[dict]]]:
    """The scenarios an earlier run of this script measured as often, on this kind of machine:
    ``--only`` remeasures some rows and keeps the others."""
    try:
        earlier = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    same = (earlier.get("repeats"), earlier.get("machine"), earlier.get("cores")) == (
        repeats, platform.machine(), len(os.sched_getaffinity(0)))
    return {name: runs for name, runs in earlier.get("runs", {}).items()
            if same and name in SCENARIOS}


def cell(values: list[float | None]) -> str:
    if not values or None in values:  # not measured then (an older run), or never reached
        return "—"
    return f"{statistics.median(values):.1f} ({min(values):.1f}–{max(values):.1f})"


def median(values: list[float | None]) -> str:
    return "—" if not values or None in values else f"{statistics.median(values):.1f}"


def redone(runs: list[dict]) -> str:
    return "–".join(sorted({str(r["steps_redone"]) for r in runs}))


def render(results: dict[str, dict[str, list[dict]]]) -> str:
    """Every figure, median (min–max): docs/recovery.md's table."""
    rows = [("| fault | launched by | in process: first step (s) | others' longest gap (s) | "
             "back at full size (s) | steps redone | by a restart: first step (s) | others' "
             "longest gap (s) | steps redone | targets in process (s) | in process, last step → "
             "every torchrun's exit (s) |"),
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for name, by_mode in results.items():
        scenario = SCENARIOS[name]
        cells = []
        for mode in MODES:
            runs = by_mode[mode]
            measures = ("first_step_s", "gap_s", "full_s") if mode == "in-process" else (
                "first_step_s", "gap_s")
            cells += [cell([r.get(m) for r in runs]) for m in measures]
            cells.append(redone(runs))
        exits = [r["exit_after_last_step_s"] for r in by_mode["in-process"]]
        wanted = ", ".join(f"{TARGET_NAMES[k]} ≤ {v:g}" for k, v in scenario.targets.items())
        rows.append(f"| {scenario.fault} | {scenario.launch} | {' | '.join(cells)} | {wanted} | "
                    f"{'a node did not exit' if None in exits else cell(exits)} |")
    return "\n".join(rows)


def summary(results: dict[str, dict[str, list[dict]]]) -> str:
    """Medians only, in six columns: the README's table."""
    rows = [("| fault | launched by | in process: first step (s) | others' longest gap (s) | "
             "by a restart: first step (s) | steps redone: in process; by a restart |"),
            "| --- | --- | ---: | ---: | ---: | --- |"]
    for name, by_mode in results.items():
        scenario, ours, restart = SCENARIOS[name], by_mode["in-process"], by_mode["restart"]
        rows.append(f"| {scenario.fault} | {scenario.launch} | "
                    f"{median([r.get('first_step_s') for r in ours])} | "
                    f"{median([r.get('gap_s') for r in ours])} | "
                    f"{median([r.get('first_step_s') for r in restart])} | "
                    f"{redone(ours)}; {redone(restart)} |")
    return "\n".join(rows)


def by_hand() -> str:
    """The torchrun line of BY_HAND as chaos starts the first node, as a code block."""
    flags = SCENARIOS["kill-torchrun"].flags
    given = dict(zip(flags[::2], flags[1::2]))
    node = SimpleNamespace(env={}, max_nodes=int(given["--nodes"]), rdzv_backend="elastic-mnist",
                           nproc_per_node=int(given["--nproc-per-node"]), port="PORT",
                           train_args=["..."], network=None, endpoint_host="127.0.0.1")
    argv = ["torchrun", *chaos.Cluster.torchrun_line(node, is_host=True)[3:]]
    lines, line = [], "   "
    for word in argv:
        if len(line) + len(word) > 96:
            lines.append(f"{line} \\")
            line = "       "
        line += f" {word}"
    return "\n".join([*lines, line])


def blocks(results: dict) -> tuple[str, str]:
    """The README's block and docs/recovery.md's, from bench/recovery.json's content."""
    runs = {name: results["runs"][name] for name in SCENARIOS if name in results["runs"]}
    how = (f"{results['repeats']} runs of each, the two modes alternating, on "
           f"{results['machine']} with {results['cores']} CPU cores, from `bench/recovery.json`")
    measured = ("seconds from the fault (a join: the node's launch) to the job's first completed "
                "step after it, and the other nodes' longest wait between two steps until the job "
                "is back at its size")
    short = textwrap.fill(
        f"Medians of {how}: {measured}. [Recovery](docs/recovery.md#the-recovery-table-in-full) "
        f"has their ranges, the time back at full size, the targets and the nodes' exits. "
        f"¹ The multi-node line above with jobs/node.sh's rendezvous timing (`--rdzv_conf`, "
        f"`--monitor_interval`), shown there. Reproduce with "
        f"`scripts/recovery.py --update-readme`.", width=99)
    full = textwrap.fill(
        f"Median (min–max) of {how}: {measured}, and the time until it is. Reproduce with "
        f"`scripts/recovery.py --update-readme`. ¹ {BY_HAND.rstrip('¹')}: the README's "
        f"multi-node line with jobs/node.sh's rendezvous timing, as `scripts/chaos.py --launch "
        f"torchrun` starts the first node (`is_host=false` on the other, both being on one "
        f"machine here; `...` stands for chaos's train flags):", width=99)
    return f"{summary(runs)}\n\n{short}", f"{render(runs)}\n\n{full}\n\n{by_hand()}"


def node_loss_span(results: dict) -> tuple[str, str, str, str]:
    """The fewest and most seconds to the first step after a lost node (LOST_NODE), medians,
    in process and by a restart: what the README's opening quotes."""
    def span(mode: str) -> list[str]:
        medians = [statistics.median(r["first_step_s"] for r in results["runs"][name][mode])
                   for name in LOST_NODE]
        return [f"{min(medians):.1f}", f"{max(medians):.1f}"]
    return (*span("in-process"), *span("restart"))


def update_readme(results: dict) -> None:
    short, full = blocks(results)
    markers.rewrite("recovery", short, REPO)
    markers.rewrite("recovery-detail", full, REPO)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default=",".join(SCENARIOS),
                        help=f"scenarios to run, comma-separated ({','.join(SCENARIOS)})")
    parser.add_argument("--update-readme", action="store_true")
    parser.add_argument("--soak", metavar="NAME", choices=SCENARIOS, default=None,
                        help="run scenario NAME in process REPEATS times; say how each went")
    args = parser.parse_args(argv)
    if args.soak:
        return soak(args.soak, args.repeats, Path(tempfile.mkdtemp(prefix="recovery-soak-")))
    names = args.only.split(",")
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        parser.error(f"unknown scenarios {unknown}; choose from {', '.join(SCENARIOS)}")
    out = REPO / "bench" / "recovery.json"
    results = {name: {mode: [] for mode in MODES} for name in names}
    root = Path(tempfile.mkdtemp(prefix="recovery-"))
    for repeat in range(args.repeats):
        for name in names:
            order = MODES if repeat % 2 == 0 else MODES[::-1]
            for mode in order:
                fault = measure(SCENARIOS[name].flags, mode, root / f"{name}-{mode}-{repeat}")
                results[name][mode].append(fault)
                print(f"recovery: {name} {mode}: first step {fault['first_step_s']:.1f} s after "
                      f"the fault ({fault['recovery']})", flush=True)
    runs = {**earlier_runs(out, args.repeats), **results}
    runs = {name: runs[name] for name in SCENARIOS if name in runs}
    print(render(runs))
    written = {"machine": platform.machine(), "cores": len(os.sched_getaffinity(0)),
               "repeats": args.repeats, "runs": runs}
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(written, indent=2) + "\n")
    if args.update_readme:
        update_readme(written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
