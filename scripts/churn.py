#!/usr/bin/env python3
"""Churn: a job kept under faults for minutes, one every 20-30 s, and what they cost.

    scripts/churn.py [--minutes 10] [--every 20:30] [--nodes 3] [--nproc-per-node 2]
                     [--hosts loopback|netns] [--json FILE] [--plot FILE] [--readme-section churn]

Starts NODES simulated nodes of NPROC_PER_NODE workers on loopback (chaos.py's Cluster: each its
own torchrun agent through jobs/node.sh, the store served by ``elastic-mnist rendezvous``), and
while MINUTES pass injects a fault every EVERY seconds, cycling through:

    kill-node     SIGKILL of a node's whole process tree
    join          the lost node coming back (a new agent)
    kill-worker   SIGKILL of one worker of a node that lives on (its agent restarts that node)
    preempt-node  SIGTERM to a node's agent (its node leaves), requeued a few seconds later
    hang-worker   SIGSTOP of one worker with a sibling (the sibling's watchdog ends it; its agent
                  restarts that node)

With ``--hosts netns`` each node is a host of its own (chaos.py's ``--hosts netns``) and the cycle
goes on with faults of the network, each healed after NET_SECONDS (scripts/netfaults.py):

    cut-node      every link of a node cut, silently
    cut-control   a node's link to the store cut: it still reaches its peers
    store-outage  the store cut from every node: they still reach each other

It first runs the same job without faults for CALIBRATE_S, for its steady step rate; the churn
job is sized to run about MINUTES at that rate and then goes on to its last step without
faults. It reports, per fault: the seconds lost (the healthy nodes' longest gap between two steps
after it, less the normal step), whether any healthy process restarted (a worker of a node the
fault did not touch that is gone), and the run's effective training time: its wall time, first
step to last, less the seconds lost to its faults, over its wall time; beside it the fault-free
wall time for the same steps over the churn run's (above 100% where the job ran smaller: nodes
simulated on one machine's cores step faster when fewer). It fails (exit 1) when a sample was
lost or doubled (scripts/check_audit.py), a healthy process restarted, or the job finished other
than once.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import chaos
import hosts
import markers
from cluster import network_hosts
from processes import LAUNCHER_VARS

REPO = Path(__file__).resolve().parents[1]
CYCLE = ("kill-node", "join", "kill-worker", "preempt-node", "hang-worker")
NETWORK_CYCLE = ("cut-node", "cut-control", "store-outage")
NET_SECONDS = 10.0
"""How long each network fault of the cycle lasts before it heals."""
CALIBRATE_S = 60.0
CHECK_AFTER_S = 15.0
"""When the healthy nodes' workers are looked for, after a fault (before the next one)."""
QUIET_S = 8.0
"""After the last fault, the job runs this long at least before it may finish."""


@dataclass
class Blow:
    """One fault of the churn, and what it cost."""

    kind: str
    at: float
    node: int | None = None
    healthy: dict[int, list[int]] = field(default_factory=dict)
    """Worker PIDs, by node, of the nodes the fault did not touch, when it struck."""
    lost_s: float | None = None
    healthy_restarted: list[int] | None = None
    """Of :attr:`healthy`, those gone CHECK_AFTER_S after the fault, or after its heal (None: not
    checked yet)."""
    seconds: float = 0.0
    """How long the fault lasts (a network fault's; the others are instants)."""


def step_times(observer: chaos.Observer) -> dict[int, float]:
    """Each completed step's time: its last rank's record, in the newest generation."""
    done: dict[int, float] = {}
    for record in observer.audit():
        done[record["step"]] = max(done.get(record["step"], 0.0), record["time"])
    return done


def normal_step(times: dict[int, float]) -> float:
    steps = sorted(times)
    gaps = [times[b] - times[a] for a, b in itertools.pairwise(steps) if b == a + 1]
    return statistics.median(gaps) if gaps else 0.0


def open_network(where: str, nodes: int) -> hosts.Network | None:
    """The hosts of their own of a cluster of ``nodes`` (``--hosts netns``), or None."""
    if where != "netns":
        return None
    return hosts.Network(network_hosts(nodes, "external")).open()


def calibrate(workdir: Path, train_args: list[str], env: dict[str, str], nodes: int,
              nproc: int, network: hosts.Network | None = None) -> float:
    """Steps per second of the job without faults, in its steady state."""
    args = [a.replace(str(workdir / "shared"), str(workdir / "calibration"))
            for a in train_args]
    cluster = chaos.Cluster(workdir / "calibration", args, nodes, "external", env, nproc,
                            network=network)
    (workdir / "calibration").mkdir(parents=True, exist_ok=True)
    observer = chaos.Observer(workdir / "calibration" / "runs" / "chaos")
    try:
        cluster.start_store()
        for _ in range(nodes):
            cluster.start_node()
        chaos.watch_start(observer, time.time() + 300)
        time.sleep(5)  # past the first steps' warm-up
        first, start = observer.step(), time.time()
        time.sleep(CALIBRATE_S)
        return (observer.step() - first) / (time.time() - start)
    finally:
        cluster.stop()


def strike(kind: str, cluster: chaos.Cluster, rng: random.Random, lost: list[int]) -> Blow | None:
    """Carries out one fault of the cycle; None when there is no node it may take."""
    blow = Blow(kind, time.time())
    if kind == "join":
        if not lost:
            return None
        lost.pop()
        blow.node = cluster.start_node()
    else:
        victims = [n for n in cluster.victims() if not cluster.stopped(n)]
        if not victims:
            return None
        blow.node = rng.choice(victims) if kind != "store-outage" else None
        network = kind in NETWORK_CYCLE
        blow.seconds = NET_SECONDS if network else 0.0
        fault = chaos.Fault(step=0, kind=kind, node=blow.node,
                            seconds=NET_SECONDS if network else None)
        if not chaos.inject(fault, cluster, rng):
            return None
        blow.at = fault.at
        if kind in ("kill-node", "preempt-node"):
            lost.append(blow.node)
    blow.healthy = {node: chaos.worker_pids(proc.pid) for node, proc in cluster.nodes.items()
                    if node != blow.node}
    return blow


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="time under faults (10)")
    parser.add_argument("--every", default="20:30", help="seconds between faults, MIN:MAX (20:30)")
    parser.add_argument("--nodes", type=int, default=3, help="simulated nodes (3)")
    parser.add_argument("--nproc-per-node", type=int, default=2, help="workers per node (2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hosts", choices=("loopback", "netns"), default="loopback",
                        help="the nodes on loopback, or each a host of its own, with the "
                             "network's faults in the cycle (root only; loopback)")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--plot", type=Path, default=None,
                        help="a plot of world size and step rate over time (PNG)")
    parser.add_argument("--readme-section", default=None, metavar="NAME",
                        help="on a PASS, write the table between the NAME markers of the docs")
    args = parser.parse_args(argv)
    low, _, high = args.every.partition(":")
    every = (float(low), float(high or low))
    rng = random.Random(args.seed)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="churn-"))
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**{k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS},
           "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    batch = 64
    data = workdir / "data"
    subprocess.run([sys.executable, "-m", "elastic_mnist", "synth", "--out", str(data),
                    "--train", str(20 * batch), "--test", "256", "--seed", str(args.seed)],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    shared = workdir / "shared"

    def train_args(steps: int) -> list[str]:
        return ["--dataset", "synthetic", "--data-dir", str(data), "--global-batch-size",
                str(batch), "--micro-batch-size", "16", "--epochs", "100000", "--max-steps",
                str(steps), "--checkpoint-dir", str(shared / "ckpt"), "--logdir",
                str(shared / "runs"), "--run-id", "chaos", "--checkpoint-every", "50",
                "--log-every", "20", "--audit-samples", "--device", "cpu"]

    print(f"churn: calibrating {args.nodes} x {args.nproc_per_node} without faults "
          f"({CALIBRATE_S:.0f} s); work folder {workdir}")
    if args.hosts == "netns" and hosts.unavailable():
        parser.error(f"--hosts netns: {hosts.unavailable()}")
    cycle = CYCLE + (NETWORK_CYCLE if args.hosts == "netns" else ())
    network = open_network(args.hosts, args.nodes)
    try:
        rate = calibrate(workdir, train_args(10**6), env, args.nodes, args.nproc_per_node,
                         network)
    finally:
        if network is not None:
            network.close()
    steps = int(rate * args.minutes * 60)
    print(f"churn: {rate:.2f} steps/s without faults; the churn job runs {steps} steps")
    network = open_network(args.hosts, args.nodes)
    cluster = chaos.Cluster(workdir, train_args(steps), args.nodes, "external", env,
                            args.nproc_per_node, network=network)
    observer = chaos.Observer(shared / "runs" / "chaos")
    blows: list[Blow] = []
    failures: list[str] = []
    lost: list[int] = []
    deadline = time.time() + args.minutes * 60 * 3 + 300
    try:
        cluster.start_store()
        for _ in range(args.nodes):
            cluster.start_node()
        chaos.watch_start(observer, time.time() + 300)
        churn_end = time.time() + args.minutes * 60
        kinds = iter(cycle * 1000)
        next_at = time.time() + rng.uniform(*every)
        while not observer.finished() and time.time() < deadline:
            cluster.alive()
            now = time.time()
            for blow in blows:
                if (blow.healthy_restarted is None
                        and now - blow.at >= blow.seconds + CHECK_AFTER_S):
                    blow.healthy_restarted = [pid for pids in blow.healthy.values()
                                              for pid in pids if not chaos.is_running(pid)]
            if now >= next_at and now < churn_end and observer.step() < steps - rate * QUIET_S:
                kind = next(kinds)
                blow = strike(kind, cluster, rng, lost)
                if blow is not None:
                    blows.append(blow)
                    where = "" if blow.node is None else f" n{blow.node}"
                    print(f"churn: {kind}{where} at step {observer.step()}")
                    if kind == "preempt-node":  # requeued, as a scheduler would
                        time.sleep(chaos.REQUEUE_DELAY_S)
                        lost.remove(blow.node)
                        cluster.start_node()
                next_at = time.time() + rng.uniform(*every)
            time.sleep(0.2)
        chaos.watch_exits(cluster, observer, timeout=30)
    finally:
        cluster.stop()
        if network is not None:
            network.close()

    times = step_times(observer)
    normal = normal_step(times)
    for i, blow in enumerate(blows):
        until = blows[i + 1].at if i + 1 < len(blows) else max(times.values(), default=blow.at)
        # From the last step completed before it: the first wait it causes may start there.
        start = max((t for t in times.values() if t <= blow.at), default=blow.at)
        inside = sorted(t for t in times.values() if start <= t <= until)
        gaps = [b - a for a, b in itertools.pairwise(inside)]
        blow.lost_s = max(max(gaps, default=0.0) - normal, 0.0)
    events = observer.events()
    finishes = sum(e["event"] == "finish" for e in events)
    if finishes != 1:
        failures.append(f"the job finished {finishes} times")
    audit = subprocess.run([sys.executable, str(REPO / "scripts" / "check_audit.py"),
                            str(observer.run_dir), "--num-samples", str(20 * batch)],
                           capture_output=True, text=True, env=env, check=False)
    if audit.returncode != 0:
        failures.append(f"sample audit: {audit.stdout.strip() or audit.stderr.strip()}")
    restarted = [f"{b.kind} n{b.node}" for b in blows if b.healthy_restarted]
    if restarted:
        failures.append(f"healthy processes restarted after: {restarted}")
    wall = max(times.values()) - min(times.values()) if times else float("inf")
    by_rate = (len(times) / rate) / wall if wall else 0.0
    effective = 1.0 - sum(b.lost_s or 0.0 for b in blows) / wall if wall else 0.0

    rows = ["| fault | count | seconds lost (median, max) | healthy restarted |",
            "| --- | ---: | ---: | --- |"]
    for kind in cycle:
        mine = [b for b in blows if b.kind == kind]
        if mine:
            lost_s = [b.lost_s or 0.0 for b in mine]
            rows.append(f"| {kind} | {len(mine)} | {statistics.median(lost_s):.1f}, "
                        f"{max(lost_s):.1f} | "
                        f"{'yes' if any(b.healthy_restarted for b in mine) else 'no'} |")
    summary = "\n".join(rows) + (
        f"\n\n{len(blows)} faults in {wall / 60:.1f} minutes of training on {args.nodes} "
        f"nodes x {args.nproc_per_node} workers; effective training time {effective:.0%} (the "
        f"run's wall time less the seconds its faults cost, over its wall time). The fault-free "
        f"wall time for the same steps over the run's is {by_rate:.0%} (fault-free "
        f"{rate:.2f} steps/s at {args.nodes * args.nproc_per_node} ranks): above 100% where the "
        f"job ran smaller, its steps faster with fewer simulated nodes on this machine's cores. "
        f"`make churn`.")
    print(summary)
    if args.plot:
        plot(observer, args.plot, blows)
    if args.readme_section and not failures:
        markers.rewrite(args.readme_section, summary)
    if args.json:
        args.json.write_text(json.dumps({
            "failures": failures, "effective": effective, "by_rate": by_rate, "rate": rate,
            "normal_step_s": normal, "wall_s": wall,
            "faults": [{"kind": b.kind, "node": b.node, "at": b.at, "lost_s": b.lost_s,
                        "healthy_restarted": b.healthy_restarted} for b in blows]}, indent=2))
    for failure in failures:
        print(f"FAIL {failure}")
    print("churn: PASS" if not failures else "churn: FAIL")
    return 1 if failures else 0


def plot(observer: chaos.Observer, path: Path, blows: list[Blow]) -> None:
    """World size and steps per second over time, the faults marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = sorted(observer.audit(), key=lambda r: r["time"])
    if not records:
        return
    t0 = records[0]["time"]
    world = {}
    for r in records:
        world[r["step"]] = (r["time"] - t0, r["world_size"])
    points = sorted(world.values())
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 5))
    top.step([t for t, _ in points], [w for _, w in points], where="post")
    top.set_ylabel("world size")
    window = 5.0
    times = [t for t, _ in points]
    rates = [sum(1 for u in times if t - window < u <= t) / window for t in times]
    bottom.plot(times, rates)
    bottom.set_ylabel("steps/s (5 s window)")
    bottom.set_xlabel("seconds since the first step")
    for b in blows:
        for axis in (top, bottom):
            axis.axvline(b.at - t0, color="grey", alpha=0.3)
        top.annotate(b.kind, (b.at - t0, top.get_ylim()[1]), fontsize=6, rotation=90,
                     va="top")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
