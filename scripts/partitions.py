#!/usr/bin/env python3
"""Machines that fail by the network: what each partition costs the healthy nodes, against the
targets of issue 42.

    scripts/partitions.py [--cases kill,cut-60,...] [--launch node.sh|torchrun] [--strict]
                          [--json FILE] [--readme-section partitions]

Each case is one chaos run (scripts/chaos.py ``--hosts netns``): 3 nodes × 2 workers, each node a
host of its own (a network namespace with its own host name, a control link to the store and a
data link to its peers, ``GLOO_SOCKET_IFNAME=data``; scripts/hosts.py), the store
``elastic-mnist rendezvous`` on a host of its own on the control bridge, our rendezvous (torch's
``c10d`` in c10d-60), checkpoints in one shared folder, every node launched by ``jobs/node.sh``
(or, with ``--launch torchrun``, by the README's multi-node torchrun line). At step LEAD_STEP one
fault strikes node 2 (or the store) and heals after its seconds; the cases run one after another:

    kill          the node SIGKILLed, for comparison (the kernel answers for it: connections reset)
    cut-60        all its links cut for 60 s: silent, as a machine whose power failed
    c10d-60       cut-60 under torch's c10d rendezvous: every agent must live through it (its
                  return restarts every worker there, as any join does)
    rank0-30      all the links of rank 0's node cut for 30 s: it writes the checkpoints, events
                  and dashboards, and must write none after its drop
    cut-5         all its links cut for 5 s: longer than the detection (1.5 s), dropped too
    blip          all its links cut for 1 s: shorter than the detection, ridden out
    data-30       its data link cut for 30 s: it reaches the store, not its peers
    control-30    its control link cut for 30 s: it reaches its peers, not the store
    out-30        its data link dropped one way for 30 s: it hears its peers, they do not hear it
    store-30      the store cut from every node for 30 s: the peers still reach each other
    flap          every link of the node down 3 s and up 3 s, for 30 s
    slow          its data link slowed to 4 Mbit/s for 30 s (tc tbf)

Per case: the healthy nodes' longest wait between two steps (from the fault until the job steps
at its size again after the heal), the seconds to the job's first step after the fault, how the
job answered (rode it out, in process, a restart, or in process and then a restart), whether any
healthy process restarted (a worker of the untouched nodes that is no longer running), whether the
job was back at its size after the heal, whether every sample was used exactly once (scripts/check_audit.py), what a
process the job went on without wrote into the shared folder after that (scripts/cutoff.py:
nothing, in every case), and the target, met or NOT MET. Exit 1 where the harness failed, a
sample was lost or doubled, or a process wrote after its drop; with --strict also where a target
is not met. Needs root and network namespaces (``scripts/hosts.py check``). About 20 minutes on
2 cores; ``make partitions``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import chaos
import cutoff
import hosts
import markers

from elastic_mnist.config import TrainConfig
from elastic_mnist.resilience.store_wait import STORE_WAIT_S

LEAD_STEP = 100
"""The step at which the fault strikes: the job past its start-up, every rank warm."""
VICTIM = 2
"""The node each fault strikes (of 0, 1, 2; the store's outage strikes the store), but where a
case names another (:attr:`Case.node`)."""
RUN_ID = "chaos"
"""chaos's run id: the run folder under the shared folder's ``runs/``."""
STEPS_PER_S = 25.0
"""Steps a second of the job at 4 ranks on this 2-core machine (19 at 6): a case's job is long
enough to be back after the heal before it ends (see ``--steps-per-second``)."""
HANG_TIMEOUT = TrainConfig().run.hang_timeout
"""The job's --hang-timeout: its default, which the cases run with."""
COMEBACK_S = 20.0
"""Steps given to the job after the heal, in seconds of steps, before its tail."""
TAIL_STEPS = 200


@dataclass(frozen=True)
class Case:
    """One fault, in the words of the table, and its target."""

    what: str
    kind: str
    seconds: float | None
    target: str
    met: Callable[[dict], bool]
    """Whether a fault's record (chaos's ``--json``) meets the target."""
    needs: str | None = None
    """What of :data:`hosts.CAPABILITIES` the fault needs beyond namespaces: without it, the
    case is skipped, and its row says why."""
    node: int = VICTIM
    """The node the fault strikes (node 0 holds rank 0: the checkpoints, events, dashboards)."""
    rdzv_backend: str = "elastic-mnist"
    """The agents' rendezvous (chaos's ``--rdzv-backend``): ours, or torch's ``c10d``."""


def healthy(f: dict) -> bool:
    return bool(f["survivors_kept"])


def within(f: dict, seconds: float) -> bool:
    return f["gap_s"] is not None and f["gap_s"] <= seconds


ONE_SIDED = f"≤ hang timeout + 2 s ({HANG_TIMEOUT + 2:g}), nobody healthy restarts, back after"


def one_sided(f: dict) -> bool:
    return within(f, HANG_TIMEOUT + 2) and healthy(f) and bool(f["came_back"])


def agents_lived(f: dict) -> bool:
    """Every torchrun agent that ended before chaos stopped the nodes ended with 0: none died
    or failed (one that left early with 0 leaves the job short of its size: not back after)."""
    return all(code == 0 for code in f["agent_exits"].values())


def c10d_cut(f: dict) -> bool:
    """Under c10d the others go on in process as under ours, and every agent lives through the
    cut; the node's return restarts every worker (a join does there), so the longest wait and
    the healthy processes are not judged."""
    return (f["first_answer"] == "in-process" and f["first_step_s"] is not None
            and f["first_step_s"] <= 2 and bool(f["came_back"]) and agents_lived(f))


STORE_KILL = (f"in process once the store is back (≤ {STORE_WAIT_S:g} s from the fault, said), "
              "nobody healthy restarts")


def store_kill(f: dict) -> bool:
    return f["recovery"] == "in-process" and within(f, STORE_WAIT_S) and healthy(f)


CASES = {
    "kill": Case("a node SIGKILLed (for comparison)", "kill-node", None,
                 "≤ 2 s, in process", lambda f: within(f, 2) and f["recovery"] == "in-process"
                 and healthy(f)),
    "cut-60": Case("a node's links cut for 60 s", "cut-node", 60,
                   "≤ 2 s like a crash, in process, back after",
                   lambda f: within(f, 2) and healthy(f) and bool(f["came_back"])),
    "c10d-60": Case("a node's links cut for 60 s, under torch's c10d rendezvous", "cut-node", 60,
                    "every agent lives, the others' first step ≤ 2 s in process, back after "
                    "(by a restart of every worker)", c10d_cut, rdzv_backend="c10d"),
    "cut-5": Case("a node's links cut for 5 s", "cut-node", 5,
                  "≤ 2 s like a crash, in process, back after",
                  lambda f: within(f, 2) and healthy(f) and bool(f["came_back"])),
    "blip": Case("a node's links cut for 1 s (shorter than the detection, 1.5 s)", "cut-node", 1,
                 "≤ blip + 1 s (2), nobody dropped",
                 lambda f: within(f, 2) and f["recovery"] == "none" and healthy(f)),
    "rank0-30": Case("rank 0's node's links cut for 30 s (it writes the checkpoints, events "
                     "and dashboards)", "cut-node", 30,
                     "≤ 2 s like a crash, in process, back after",
                     lambda f: within(f, 2) and healthy(f) and bool(f["came_back"]), node=0),
    "data-30": Case("a node's data link cut for 30 s (it reaches the store, not its peers)",
                    "cut-data", 30, ONE_SIDED, one_sided),
    "control-30": Case("a node's control link cut for 30 s (it reaches its peers, not the "
                       "store)", "cut-control", 30, ONE_SIDED, one_sided),
    "out-30": Case("a node's data link dropped one way for 30 s (its peers do not hear it)",
                   "cut-out", 30, ONE_SIDED, one_sided, needs="one-way"),
    "store-30": Case("the store unreachable from every node for 30 s (the peers still reach "
                     "each other)", "store-outage", 30,
                     "goes on (≤ 2 s), nobody dropped, no restart",
                     lambda f: within(f, 2) and f["recovery"] == "none" and healthy(f)),
    "store-kill": Case("a node SIGKILLed 3 s into a 30 s store outage (its recovery needs the "
                       "store)", "store-kill", 30, STORE_KILL, store_kill),
    "flap": Case("a node flapping for 30 s (every link down 3 s, up 3 s)", "flap-node", 30,
                 f"each drop ≤ {HANG_TIMEOUT + 2:g} s, nobody healthy restarts, back after",
                 one_sided),
    "slow": Case("a node's data link slowed to 4 Mbit/s for 30 s", "slow-link", 30,
                 "nobody dropped, no restart (no target in the issue)",
                 lambda f: f["recovery"] == "none" and healthy(f), needs="slow"),
}


def steps_for(case: Case, rate: float) -> int:
    """The job's steps: the lead, the fault and the way back at ``rate``, and a tail."""
    return LEAD_STEP + int(rate * ((case.seconds or 0) + COMEBACK_S)) + TAIL_STEPS


def chaos_argv(case: Case, workdir: Path, launch: str, rate: float) -> list[str]:
    """scripts/chaos.py's flags for one run of ``case`` in ``workdir``, its record in
    ``workdir/faults.json``."""
    schedule = f"{LEAD_STEP}:{case.kind}:" + (
        "" if case.kind == "store-outage" else str(case.node)) + (
        f":{case.seconds:g}" if case.seconds else "")
    return ["--hosts", "netns", "--nodes", "3", "--start-nodes", "3", "--nproc-per-node", "2",
            "--store", "external", "--launch", launch, "--rdzv-backend", case.rdzv_backend,
            "--schedule", schedule, "--steps", str(steps_for(case, rate)), "--no-reference",
            "--timeout", str(600 + 2 * (case.seconds or 0)),
            "--workdir", str(workdir), "--json", str(workdir / "faults.json")]


def run_case(name: str, case: Case, root: Path, launch: str, rate: float) -> dict:
    """One chaos run of ``case``; its fault's record, with the run's failures and the agents'
    exit codes beside it."""
    workdir = root / name
    out = workdir / "faults.json"
    argv = chaos_argv(case, workdir, launch, rate)
    print(f"partitions: {name}: scripts/chaos.py {' '.join(argv)}", flush=True)
    try:
        chaos.main(argv)
    except SystemExit as e:  # chaos refused its flags, or a signal ends the harness
        if isinstance(e.code, int) and e.code >= 128:
            raise
        raise RuntimeError(f"{name}: chaos exited {e.code}") from None
    report = json.loads(out.read_text())
    if not report["faults"]:
        raise RuntimeError(f"{name}: the fault never struck ({report['failures']})")
    return {**report["faults"][-1], "failures": report["failures"],
            "agent_exits": report["agent_exits"],
            "late_writes": cutoff.late_writes(workdir / "shared", RUN_ID)}


def met(case: Case, f: dict) -> bool:
    """The case's target, and in every case nothing written by a process after the job went on
    without it (scripts/cutoff.py)."""
    return case.met(f) and not f.get("late_writes")


def exactly_once(record: dict) -> bool:
    return not any(f.startswith("sample audit") for f in record["failures"])


def answered(f: dict) -> str:
    words = {"none": "rode it out", "in-process": "in process", "restart": "restart"}
    said = words.get(f["recovery"], "—")
    if f.get("first_answer") == "in-process" and f["recovery"] == "restart":
        said = "in process, then a restart"
    if f.get("grows"):
        said += f", {f['grows']} admitted back" if f["grows"] > 1 else ", admitted back"
    return said


def came_back(f: dict) -> str:
    if f["kind"] in ("kill-node", "store-kill"):
        return "—"
    return {True: "yes", False: "no", None: "job ended first"}[f["came_back"]]


def seconds(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def table(results: dict[str, dict]) -> str:
    rows = [("| what failed | others' longest wait (s) | first step after (s) | answered | "
             "healthy restarted | back after | exactly once | written after its drop | target | "
             "met |"),
            "| --- | ---: | ---: | --- | --- | --- | --- | --- | --- | --- |"]
    for name, f in results.items():
        case = CASES[name]
        if "error" in f or "skipped" in f:
            said = (f"harness failed: {f['error']}" if "error" in f
                    else f"skipped: this machine cannot ({f['skipped']})")
            rows.append(f"| {case.what} | — | — | {said} | — | — | — | — | {case.target} | — |")
            continue
        rows.append(f"| {case.what} | {seconds(f['gap_s'])} | {seconds(f['first_step_s'])} | "
                    f"{answered(f)} | {'no' if healthy(f) else 'yes'} | {came_back(f)} | "
                    f"{'yes' if exactly_once(f) else 'NO'} | "
                    f"{len(f.get('late_writes', [])) or 'nothing'} | {case.target} | "
                    f"{'met' if met(case, f) else 'NOT MET'} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"cases to run, comma-separated ({','.join(CASES)})")
    parser.add_argument("--launch", choices=("node.sh", "torchrun"), default="node.sh",
                        help="each node's agent: jobs/node.sh, or the README's multi-node "
                             "torchrun line (node.sh)")
    parser.add_argument("--steps-per-second", type=float, default=STEPS_PER_S,
                        help=f"the job's steps a second at 4 ranks here, which sizes each case's "
                             f"job ({STEPS_PER_S:g})")
    parser.add_argument("--strict", action="store_true",
                        help="also exit 1 where a target is not met")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--readme-section", default=None, metavar="NAME",
                        help="write the table between the NAME markers of the docs")
    args = parser.parse_args(argv)
    names = args.cases.split(",")
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {', '.join(CASES)}")
    reason = hosts.unavailable()
    if reason:
        print(f"partitions: hosts of their own: {reason}", file=sys.stderr)
        return 2
    if args.readme_section and markers.holder(args.readme_section) is None:
        parser.error(f"no page has a {markers.markers(args.readme_section)[0]} marker")
    root = Path(tempfile.mkdtemp(prefix="partitions-"))
    print(f"partitions: {len(names)} cases at 3 nodes × 2 workers; work folder {root}",
          flush=True)
    started = time.time()
    needed = {CASES[n].needs for n in names} - {None}
    lacking = ({k: v for k, v in hosts.capabilities().items() if v and k in needed}
               if needed else {})
    results: dict[str, dict] = {}
    for name in names:
        if CASES[name].needs in lacking:
            results[name] = {"skipped": lacking[CASES[name].needs]}
            print(f"partitions: {name} skipped: {hosts.CAPABILITIES[CASES[name].needs]}: "
                  f"{lacking[CASES[name].needs]}", flush=True)
            continue
        try:
            results[name] = run_case(name, CASES[name], root, args.launch,
                                     args.steps_per_second)
        except Exception as e:  # noqa: BLE001 - any of it is the harness's failure, said in a row
            results[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    minutes = (time.time() - started) / 60
    launched = "the README's torchrun line" if args.launch == "torchrun" else "jobs/node.sh"
    summary = (f"{table(results)}\n\n3 nodes × 2 workers, each a host of its own, launched by "
               f"{launched}, our rendezvous (torch's c10d for c10d-60), the fault at step "
               f"{LEAD_STEP} on node {VICTIM} (node 0 for rank0-30, or the store); one run a "
               f"case, {minutes:.0f} minutes in all. `make partitions`.")
    print(summary)
    harness = [n for n, f in results.items() if "error" in f]
    measured = {n: f for n, f in results.items() if "error" not in f and "skipped" not in f}
    doubled = [n for n, f in measured.items() if not exactly_once(f)]
    unmet = [n for n, f in measured.items() if not met(CASES[n], f)]
    if args.json:
        args.json.write_text(json.dumps({"cases": results, "minutes": minutes}, indent=2))
    if args.readme_section and not harness:
        markers.rewrite(args.readme_section, summary)
    late = [n for n, f in measured.items() if f.get("late_writes")]
    for name in late:
        for line in measured[name]["late_writes"]:
            print(f"partitions: {name}: written after its drop: {line}")
    for what, which in (("the harness failed", harness), ("a sample lost or doubled", doubled),
                        ("written by a process after the job went on without it", late),
                        ("targets not met", unmet)):
        if which:
            print(f"partitions: {what}: {', '.join(which)}")
    return 1 if harness or doubled or late or (args.strict and unmet) else 0


if __name__ == "__main__":
    sys.exit(main())
