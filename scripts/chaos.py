#!/usr/bin/env python3
"""Chaos harness: simulated nodes on loopback, real faults, and a verdict.

    scripts/chaos.py [--nodes 3] [--faults 7] [--seed 0] [--schedule 120:kill-node:0,...]
                     [--nproc-per-node 1] [--launch node.sh|torchrun] [--store external|agent]
                     [--hosts loopback|netns]

Starts NODES simulated nodes, each its own torchrun agent through ``jobs/node.sh`` (or, with
``--launch torchrun``, the README's plain torchrun line, with the rendezvous timing node.sh
uses, in the environment chaos itself was given) with NPROC_PER_NODE workers each, meeting at a
rendezvous store served by ``elastic-mnist rendezvous`` (or, with ``--store agent``, by the first
node's agent), training on small synthetic digits with ``--audit-samples``. At chosen optimizer
steps it injects faults, each once the job is back at its size after the one before (and
SETTLE_STEPS steps later):

    kill-node     SIGKILL of a node's whole process tree (agent and workers): the others go on
                  in process
    kill-worker   SIGKILL of one worker; its agent restarts its node, which the others take
                  back in process (under c10d: torchrun restarts everyone)
    preempt-node  SIGTERM to a node's agent: the node leaves and the others go on in process;
                  it comes back (is requeued) a few seconds later, a join
    leave         SIGTERM to a node's agent, not requeued: the node leaves for good (until a
                  later join); the others go on in process
    join          a new node joins the running job, in process (under c10d: every worker
                  restarts)
    hang-worker   SIGSTOP of one worker: it neither steps nor exits; the workers' watchdog names
                  it, and the others go on without it in process where it is alone on its node
                  (elsewhere a sibling kills it, and its agent restarts the node)
    nan-grad      rank 0's gradients of that step poisoned (ELASTIC_MNIST_FAULT, set when the
                  nodes start): every rank skips the step

With ``--hosts netns`` each node is a host of its own (scripts/hosts.py: a network namespace
with its own host name, a control link to the store and a data link to its peers,
``GLOO_SOCKET_IFNAME=data``), the store is ``elastic-mnist rendezvous`` on a host of its own on
the control bridge (``RDZV_ENDPOINT=store:29400``), and the network's faults join the kinds above:
cut-node, cut-data, cut-control, cut-in, cut-out, flap-node, slow-link, store-outage and store-kill
(scripts/netfaults.py), each lasting its SECONDS (``STEP:KIND:NODE:SECONDS``; NODE may be left
empty) and then healed. For them chaos reports how the job answered (rode it out, in process, or
by a restart), whether the healthy nodes' workers are the same processes after it, and whether
the node was back at the job's size after the heal; it does not fail on any of it (the targets
are scripts/partitions.py's), only on what it checks for every run. Its ``--json`` record says
each fault's first answer beside how it was answered in the end, and the exit code of every
agent that ended before chaos stopped the nodes (``agent_exits``: a node's agent that died
during a cut is there, not 0).

Then it checks, and exits 1 on any failure: the job finished; every completed epoch used every
sample exactly once (scripts/check_audit.py); the final test accuracy is within --tolerance of an
uninterrupted run's; every checkpoint left is valid; every fault of a kind the survivors recover
from in process (kill-node, preempt-node, leave, hang-worker alone on its node) was recovered in
process, the surviving workers still the same processes. It prints, per fault, how it was
recovered (in process, or by a restart), the time until the job noticed (in process: the fault's
detection; by a restart: the old workers gone), until the next worker group was formed, and
until its first completed step, and how many steps were redone; the seconds from the start of
the nodes to the job's first completed step; and, per node that lived to the end, the seconds
from the last step to its torchrun's exit. Times come from the run's events.jsonl and audit
records, and from watching the processes.

The card's shape, 4 nodes of 8 workers on one machine, is ``make chaos32`` (see the Makefile).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import hosts
import markers
import netfaults
import psutil
from cluster import Cluster, network_hosts, worker_pids
from processes import LAUNCHER_VARS, kill_tree

from elastic_mnist.config import TrainConfig
from elastic_mnist.events import event_time
from elastic_mnist.resilience.faults import FAULT_VAR

REPO = Path(__file__).resolve().parents[1]
KINDS = ("kill-node", "kill-worker", "preempt-node", "leave", "join", "hang-worker", "nan-grad")
ALL_KINDS = (*KINDS, *netfaults.NET_KINDS)
IN_PROCESS_KINDS = ("kill-node", "preempt-node", "leave", "hang-worker")
"""Faults the survivors go on from in process under either rendezvous (hang-worker, under c10d,
only where the worker is alone on its node: with siblings, one of them kills it, and its agent
restarts the node, which makes torchrun restart everyone)."""
OURS_IN_PROCESS_KINDS = (*IN_PROCESS_KINDS, "kill-worker", "join")
"""Under our rendezvous (``--rdzv_backend=elastic-mnist``) a node whose worker died, and a node
that joins, enter the running job in process too: nobody healthy restarts."""
REQUEUE_DELAY_S = 3.0
SETTLE_STEPS = 10
"""Steps the job takes at its full size, after one fault's recovery, before the next fault: a
fault whose step came while the job was still recovering from the one before is that much late
(its row says the step it came at)."""
ROUND_GUARD_LINE = "the rendezvous moved on to round"  # what a rank logs when it leaves for it
# torch 2.14's own rendezvous timing, for comparison with jobs/node.sh's (its variables).
TORCHRUN_DEFAULTS = {"LAST_CALL_TIMEOUT": "30", "KEEP_ALIVE_INTERVAL": "5",
                     "KEEP_ALIVE_MAX_ATTEMPT": "3", "MONITOR_INTERVAL": "0.1"}
STEPS_PER_NETWORK_FAULT = 600
"""More steps for the job for each network fault of its schedule (it lasts seconds)."""
COMEBACK_S = 90.0
"""How long after a network fault's heal the job may take to be back at its size."""


@dataclass
class Fault:
    step: int
    kind: str
    node: int | None = None
    # Filled in when it happens:
    at: float = 0.0
    noticed: float | None = None
    restarted: float | None = None
    first_step: float | None = None
    steps_redone: int | None = None
    job_done_first: bool = False
    """The job had run its last step before the group that the fault restarted could run one
    (a node joining near the end): nothing was left to recover."""
    old_workers: list[int] = field(default_factory=list)
    survivors: list[int] = field(default_factory=list)
    """Workers of the nodes the fault did not touch: in process, they go on as they are."""
    expected: str = "restart"
    """How the fault should be recovered: "in-process" or "restart"."""
    recovery: str | None = None
    """How it was: "in-process" (a ``shrink`` record) or "restart" (a ``start`` record)."""
    survivors_kept: bool | None = None
    gap_s: float | None = None
    """The others' longest wait between two completed steps, from the fault until the job is
    back at its size before it (or until its first step after the fault, if it never is)."""
    full_s: float | None = None
    """Seconds from the fault to the first step at the job's size before it, or above it (a
    join): None when the job did not get back there."""
    size_before: int | None = None
    """The job's world size at its last step before the fault."""
    seconds: float | None = None
    """A network fault's length, until it heals."""
    healed: float | None = None
    came_back: bool | None = None
    """A network fault: the job stepped at its size before the fault again after the heal
    (None: the job ended first)."""
    grows: int | None = None
    """A network fault: nodes admitted in process while it lasted and until the job was back."""
    first_answer: str | None = None
    """A network fault: the job's first answer to it, "in-process" (a shrink), "restart" or
    "none"; :attr:`recovery` says "restart" wherever one followed (under c10d a node's return
    restarts every worker)."""

    def back_since(self) -> float | None:
        """From when a step at full size counts as the job back: after a departure, from the
        job's first step without the node (a step in flight as it was told to leave completes at
        the old size first); after a join, from the join; after a network fault, from its heal."""
        if self.kind in netfaults.NET_KINDS:
            return self.healed
        return self.at if self.kind == "join" else self.first_step

    def describe(self) -> str:
        return (f"{self.kind}" + ("" if self.node is None else f" n{self.node}")
                + ("" if self.seconds is None else f" {self.seconds:g} s"))


class Observer:
    """Reads the run's progress: audit records (a line per rank per step) and events.jsonl, each
    file from where the last read stopped: polling costs the job's CPU nothing that grows."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self._read: dict[Path, tuple[int, list[dict]]] = {}

    def _records(self, path: Path, extra: dict) -> list[dict]:
        """The whole lines of ``path`` as records (a line cut short by a kill is skipped)."""
        offset, records = self._read.get(path, (0, []))
        with open(path, "rb") as file:
            file.seek(offset)
            chunk = file.read()
        whole = chunk[:chunk.rfind(b"\n") + 1]
        for line in whole.decode().splitlines():
            try:
                records.append({**json.loads(line), **extra})
            except ValueError:
                pass
        self._read[path] = (offset + len(whole), records)
        return records

    def audit(self) -> list[dict]:
        return [record for path in sorted((self.run_dir / "audit").glob("g*-r*.jsonl"))
                for record in self._records(path, {"generation": int(
                    path.name[1:].split("-")[0])})]

    def events(self) -> list[dict]:
        path = self.run_dir / "events.jsonl"
        return list(self._records(path, {})) if path.exists() else []

    def step(self) -> int:
        return max((r["step"] for r in self.audit()), default=0)

    def world_size(self, since: float = 0.0) -> int | None:
        """The world size of the newest step recorded after ``since`` (None: none yet)."""
        newest = max((r for r in self.audit() if r["time"] > since), key=lambda r: r["time"],
                     default=None)
        return None if newest is None else newest["world_size"]

    def finished(self) -> bool:
        return any(e["event"] == "finish" for e in self.events())


def random_schedule(rng: random.Random, faults: int, first: int, last: int,
                    kinds: tuple[str, ...] = KINDS) -> list[Fault]:
    """Fault steps spread over [first, last], kinds mixed: every kind appears when there are at
    least as many faults as kinds. A network fault lasts netfaults.DEFAULT_SECONDS."""
    pool = list(kinds) * (faults // len(kinds) + 1)
    chosen = pool[:faults] if faults >= len(kinds) else rng.sample(kinds, faults)
    rng.shuffle(chosen)
    gap = (last - first) // max(faults, 1)
    return [Fault(step=first + i * gap + rng.randrange(max(gap // 3, 1)), kind=kind,
                  seconds=netfaults.DEFAULT_SECONDS if kind in netfaults.NET_KINDS else None)
            for i, kind in enumerate(chosen)]


def parse_schedule(text: str) -> list[Fault]:
    """``STEP:KIND[:NODE[:SECONDS]],...``: e.g. ``40:kill-node:0,90:join,150:cut-node::30``
    (SECONDS for a network fault: netfaults.DEFAULT_SECONDS when not said; NODE empty: any)."""
    faults = []
    for item in text.split(","):
        step, kind, *rest = item.split(":")
        if kind not in ALL_KINDS:
            raise SystemExit(f"chaos: unknown fault kind {kind!r} "
                             f"(one of {', '.join(ALL_KINDS)})")
        node, seconds = (rest + ["", ""])[:2]
        network = kind in netfaults.NET_KINDS
        if seconds and not network:
            raise SystemExit(f"chaos: {item}: only a network fault lasts some seconds")
        faults.append(Fault(step=int(step), kind=kind, node=int(node) if node else None,
                            seconds=(float(seconds) if seconds else netfaults.DEFAULT_SECONDS)
                            if network else None))
    return sorted(faults, key=lambda f: f.step)


def inject(fault: Fault, cluster: Cluster, rng: random.Random) -> netfaults.Strike | bool:
    """Carries the fault out; False when it cannot be (e.g. no node may be taken). A network
    fault: its :class:`netfaults.Strike`, which heals by itself."""
    fault.old_workers = cluster.workers()
    if fault.kind in netfaults.NET_KINDS:
        return strike(fault, cluster, rng) or False
    if fault.kind == "join":
        if len(cluster.alive()) >= cluster.max_nodes:
            return False
        fault.survivors = fault.old_workers  # the job's workers: they go on as they are
        fault.at = time.time()
        fault.node = cluster.start_node()
        return True
    if not take_victim(fault, cluster, rng):
        return False
    agent = cluster.nodes[fault.node]
    fault.survivors = cluster.workers(but=fault.node)
    fault.at = time.time()
    if fault.kind == "kill-node":
        kill_tree(agent.pid)
    elif fault.kind in ("kill-worker", "hang-worker"):
        pids = worker_pids(agent.pid)
        if not pids:
            return False
        os.kill(pids[0], signal.SIGKILL if fault.kind == "kill-worker" else signal.SIGSTOP)
    elif fault.kind in ("preempt-node", "leave"):  # a scheduler taking the node (preempt-node
        agent.send_signal(signal.SIGTERM)          # gives it back a few seconds later)
    return True


def take_victim(fault: Fault, cluster: Cluster, rng: random.Random) -> bool:
    """The fault's node: the one it names, or one drawn; False when it may not be taken."""
    victims = cluster.victims()
    if fault.node is None and victims:
        fault.node = rng.choice(victims)
    return fault.node in victims


def strike(fault: Fault, cluster: Cluster, rng: random.Random) -> netfaults.Strike | None:
    """A network fault on its node's host (the store's outage: on the store's), or None when
    no node may be taken. The healthy are every node's workers but its node's."""
    if netfaults.strikes_store(fault.kind) and cluster.store != "external":
        return None
    if netfaults.needs_node(fault.kind) and not take_victim(fault, cluster, rng):
        return None
    victim = None if fault.node is None else cluster.host_of[fault.node]
    host = netfaults.STORE_HOST if netfaults.strikes_store(fault.kind) else victim
    fault.survivors = cluster.workers(but=fault.node)
    hit = netfaults.Strike(cluster.network, fault.kind, host, fault.seconds,
                           victim=victim if fault.kind == "store-kill" else None)
    hit.start()
    fault.at = hit.at
    return hit


def watch_network(fault: Fault, hit: netfaults.Strike, observer: Observer,
                  deadline: float) -> None:
    """Times the job's answer to a network fault: from its start until the job steps at its
    size again after the heal (or COMEBACK_S has passed since the heal, or the job ended);
    then how it answered (:func:`netfaults.answer`), its first step after the fault, and
    whether the healthy nodes' workers are still the processes they were."""
    while True:
        if hit.healed is not None:
            back = observer.world_size(since=hit.healed)
            if hit.killed is not None and back is not None:  # store-kill: its node is gone
                break
            if back is not None and back >= (fault.size_before or 0):
                fault.came_back = True
                break
            if time.time() > hit.healed + COMEBACK_S:
                fault.came_back = False
                break
        if observer.finished():
            break
        if time.time() > deadline:
            raise TimeoutError(f"the job did not get back to its size after {fault.describe()}")
        time.sleep(0.1)
    hit.heal()
    fault.healed = hit.healed
    fault.at = hit.killed or fault.at  # store-kill: the kill is the fault judged
    fault.survivors_kept = all(map(is_running, fault.survivors))
    done = sorted(step_times(observer.audit()).values())
    fault.first_step = next((t for t, _ in done if t > fault.at), None)
    answer = netfaults.answer(observer.events(), fault.at, time.time(), event_time)
    fault.recovery, fault.noticed, fault.restarted = (answer.recovery, answer.noticed,
                                                      answer.regrouped)
    fault.grows = answer.grows
    first = min((e for e in observer.events() if e["event"] in ("shrink", "start")
                 and event_time(e) > fault.at), key=event_time, default=None)
    fault.first_answer = ("none" if first is None
                          else "in-process" if first["event"] == "shrink" else "restart")


def watch_skip(fault: Fault, observer: Observer, timeout: float) -> None:
    """A nan-grad fault: when the step was skipped (its ``nonfinite`` record), and the next step."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        skipped = [e for e in observer.events()
                   if e["event"] == "nonfinite" and e["step"] == fault.step]
        if skipped:
            fault.at = fault.noticed = event_time(skipped[0])
            after = [r["time"] for r in observer.audit()
                     if r["step"] > fault.step and r["time"] > fault.at]
            if after:
                fault.first_step, fault.steps_redone = min(after), 0
                return
        time.sleep(0.05)


def step_times(records: list[dict]) -> dict[int, tuple[float, int]]:
    """Each completed step's time (its last rank's record, in its newest generation) and the
    world size that took it."""
    newest: dict[int, int] = {}
    for r in records:
        newest[r["step"]] = max(newest.get(r["step"], -1), r["generation"])
    done: dict[int, tuple[float, int]] = {}
    for r in records:
        if r["generation"] == newest[r["step"]]:
            t = max(done.get(r["step"], (0.0, 0))[0], r["time"])
            done[r["step"]] = (t, r["world_size"])
    return done


def measure_gaps(fault: Fault, records: list[dict]) -> None:
    """Fills in :attr:`Fault.full_s` and :attr:`Fault.gap_s` from the run's audit records."""
    steps = sorted(step_times(records).values())
    before = [w for t, w in steps if t <= fault.at]
    if not before or fault.first_step is None:
        return
    size = before[-1] + (1 if fault.kind == "join" else 0)
    since = fault.back_since()
    full = next((t for t, w in steps if t > fault.at and t >= since and w >= size), None)
    fault.full_s = None if full is None else full - fault.at
    # Without a return to full size: until the first step completed (by its last rank) after
    # the fault's first step began to be recorded.
    until = full if full is not None else next(
        (t for t, _ in steps if t >= fault.first_step), fault.first_step)
    inside = [t for t, _ in steps if t > fault.at and t <= until]
    times = [max(t for t, _ in steps if t <= fault.at), *inside]
    fault.gap_s = max((b - a for a, b in itertools.pairwise(times)), default=None)


def is_running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def watch_recovery(fault: Fault, observer: Observer, timeout: float) -> None:
    """Times the job's answer to a fault: noticed, new group formed, its first step; and how.

    In process, a ``shrink`` record says it all; by a restart, the old workers are gone, a
    ``start`` record follows. A fault expected in process that a restart answered first counts
    as a restart (and fails the run); a fault expected to restart the job is timed to the
    restart, past any shrink on the way (the survivors of a dead worker go on in process until
    its agent's restart makes every agent restart theirs)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        now = time.time()
        events = [e for e in observer.events() if event_time(e) > fault.at]
        in_process = ("grow",) if fault.kind == "join" else ("shrink",)
        answer = next((e for e in events if e["event"] == "start"
                       or (e["event"] in in_process and fault.expected == "in-process")), None)
        if answer is not None and answer["event"] in in_process:
            fault.recovery = "in-process"
            fault.noticed = event_time(answer, "admitted_time" if answer["event"] == "grow"
                                       else "detected_time")
            fault.restarted = event_time(answer, "regrouped_time")
            fault.steps_redone = answer.get("steps_redone", 0)
            fault.survivors_kept = all(map(is_running, fault.survivors))
            first = [r["time"] for r in observer.audit()
                     if r["generation"] >= answer["restart_generation"]]
            fault.first_step = min(first, default=event_time(answer))
            return
        if fault.kind == "join" and answer is None and any(e["event"] == "finish"
                                                           for e in events):
            fault.job_done_first = True  # the job ended before it admitted the node
            return
        if fault.noticed is None and not any(map(is_running, fault.old_workers)):
            fault.noticed = now
        if answer is not None:
            fault.recovery = "restart"
            if fault.restarted is None:
                fault.restarted = event_time(answer)
                generation = answer["restart_generation"]
                done_before = [r["step"] for r in observer.audit()
                               if r["generation"] < generation]
                fault.steps_redone = max(done_before, default=0) - (
                    answer["resumed_from_step"] or 0)
            new = [r["time"] for r in observer.audit()
                   if r["generation"] >= answer["restart_generation"]]
            if new:
                fault.first_step = min(new)
                return
            if any(e["event"] == "finish" and e["step"] == answer["step"]
                   for e in events if event_time(e) >= fault.restarted):
                fault.job_done_first = True
                return
        time.sleep(0.05)


def comes_back(fault: Fault, nproc_per_node: int) -> bool:
    """The fault's node comes back (a join, a preempted node requeued, a node whose worker died
    or froze beside a sibling, which its agent restarts): the job returns to its size."""
    return fault.kind in ("join", "preempt-node", "kill-worker") or (
        fault.kind == "hang-worker" and nproc_per_node > 1)


def wait_back(fault: Fault, observer: Observer, nproc_per_node: int, deadline: float) -> None:
    """Until the job steps at its size before the fault again (after a join: with the new node
    in), or has finished: the next fault then meets whole nodes, none of them still entering."""
    if fault.size_before is None or fault.first_step is None:
        return
    size = fault.size_before + (nproc_per_node if fault.kind == "join" else 0)
    while not observer.finished():
        back = observer.world_size(since=fault.back_since())
        if back is not None and back >= size:
            return
        if time.time() > deadline:
            raise TimeoutError(f"the job did not get back to {size} ranks after "
                               f"{fault.describe()} at step {fault.step}")
        time.sleep(0.1)


def watch_exits(cluster: Cluster, observer: Observer, timeout: float) -> dict[int, float | None]:
    """Seconds from the job's last step to each remaining node's torchrun exit (None for a node
    that did not exit within ``timeout``: one whose worker is frozen waits for it forever)."""
    last_step = max((r["time"] for r in observer.audit()), default=time.time())
    exits: dict[int, float | None] = dict.fromkeys(n for n in cluster.alive()
                                                   if n not in cluster.frozen
                                                   and not cluster.stopped(n))
    deadline = time.time() + timeout
    while time.time() < deadline and any(v is None for v in exits.values()):
        for node, seconds in exits.items():
            if seconds is None and cluster.nodes[node].poll() is not None:
                exits[node] = time.time() - last_step
        time.sleep(0.05)
    cluster.alive()
    return exits


def watch_start(observer: Observer, deadline: float) -> dict:
    """The job's first completed step: its time and the world size that took it."""
    while time.time() < deadline:
        records = observer.audit()
        if records:
            first = min(records, key=lambda r: r["time"])
            return {"time": first["time"], "world_size": first["world_size"]}
        time.sleep(0.1)
    raise TimeoutError("the job took no step in time")


def run_reference(workdir: Path, train_args: list[str], env: dict[str, str]) -> float:
    """Test accuracy of the same training, uninterrupted, in one process."""
    args = [a.replace(str(workdir / "shared"), str(workdir / "reference")) for a in train_args]
    args = [a for a in args if a != "--audit-samples"]
    subprocess.run([sys.executable, "-m", "elastic_mnist", *args], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return evaluate(workdir / "reference" / "ckpt", env)["accuracy"]


def evaluate(checkpoint_dir: Path, env: dict[str, str]) -> dict:
    done = subprocess.run([sys.executable, "-m", "elastic_mnist", "evaluate", "--checkpoint-dir",
                           str(checkpoint_dir), "--json"], env=env, capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def one_job_failures(events: list[dict], faults: list[Fault]) -> list[str]:
    """What says that two groups trained side by side: more than one finish, or a join after
    which the job went on no larger (the new node started a round alone)."""
    failures = []
    finishes = [e for e in events if e["event"] == "finish"]
    if len(finishes) > 1:
        failures.append(f"the job finished {len(finishes)} times: groups trained side by side")
    worlds = [(event_time(e), e["event"], e.get("world_size", e.get("new_world_size")))
              for e in events if e["event"] in ("start", "shrink", "grow")]
    for f in faults:
        before = [w for t, _, w in worlds if t < f.at]
        after = [w for t, kind, w in worlds  # the restart's, or the grow's
                 if t > f.at and kind in ("start", "grow")]
        if f.kind == "join" and f.at and before and after and after[0] <= before[-1]:
            failures.append(f"after the join at step {f.step} the job went on at world size "
                            f"{after[0]}, not above its {before[-1]}")
    return failures


def table(faults: list[Fault]) -> str:
    def seconds(t: float | None, since: float) -> str:
        return "—" if t is None else f"{t - since:.1f}"

    header = ("| fault | at step | recovered | noticed (s) | new group (s) | "
              "first step after (s) | steps redone | others' longest gap (s) | "
              "back at full size (s) |")
    rows = [header, "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for f in faults:
        rows.append(f"| {f.describe()} | {f.step} | {f.recovery or '—'} | "
                    f"{seconds(f.noticed, f.at)} | {seconds(f.restarted, f.at)} | "
                    f"{'none left' if f.job_done_first else seconds(f.first_step, f.at)} | "
                    f"{'—' if f.steps_redone is None else f.steps_redone} | "
                    f"{'—' if f.gap_s is None else f'{f.gap_s:.1f}'} | "
                    f"{'—' if f.full_s is None else f'{f.full_s:.1f}'} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=3, help="simulated nodes at most (3)")
    parser.add_argument("--start-nodes", type=int, default=2, help="nodes at the start (2)")
    parser.add_argument("--faults", type=int, default=None,
                        help=f"random faults to inject (one of each kind: {len(KINDS)}, with "
                             f"--hosts netns {len(ALL_KINDS)})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random schedule (0)")
    parser.add_argument("--schedule", default="",
                        help="STEP:KIND[:NODE[:SECONDS]],... instead of random faults")
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps of the job (2000: about a minute without faults; "
                             f"{STEPS_PER_NETWORK_FAULT} more for each network fault)")
    parser.add_argument("--store", choices=("external", "agent"), default="external",
                        help="who serves the rendezvous store (external)")
    parser.add_argument("--tolerance", type=float, default=0.02,
                        help="allowed accuracy difference to the uninterrupted run (0.02)")
    parser.add_argument("--no-reference", dest="reference", action="store_false",
                        help="skip the uninterrupted run and the accuracy check (smoke runs)")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="workers per node (1)")
    parser.add_argument("--hosts", choices=("loopback", "netns"), default="loopback",
                        help="the nodes on loopback, or each a host of its own, a network "
                             "namespace (root only; scripts/hosts.py), where the network's "
                             "faults can be had too (loopback)")
    parser.add_argument("--launch", choices=("node.sh", "torchrun"), default="node.sh",
                        help="each node's agent: jobs/node.sh, or the README's multi-node "
                             "torchrun line with jobs/node.sh's rendezvous timing "
                             "(--rdzv_conf, --monitor_interval), in this environment (node.sh)")
    parser.add_argument("--rdzv-backend", choices=("elastic-mnist", "c10d"),
                        default="elastic-mnist",
                        help="the agents' rendezvous: ours, which takes joining nodes and a "
                             "node whose worker died back in process, or torch's (elastic-mnist)")
    parser.add_argument("--global-batch-size", type=int, default=64,
                        help="samples per step, in micro-batches of 16; the data has 20 steps per "
                             "epoch. 0: the job's own defaults, no batch flags, and every rank "
                             "must have samples in every step (64)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where data, checkpoints and logs go (default: a temp folder)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds for the whole job (600, and 150 more for each network "
                             "fault)")
    parser.add_argument("--rdzv-defaults", action="store_true",
                        help="torchrun's default rendezvous timing instead of jobs/node.sh's")
    parser.add_argument("--recovery", choices=("auto", "in-process", "restart"), default="auto",
                        help="the job's --recovery (auto)")
    parser.add_argument("--hang-timeout", type=float, default=None,
                        help="the job's --hang-timeout (its default)")
    parser.add_argument("--checkpoint-every", type=int, default=10,
                        help="the job's --checkpoint-every (10)")
    parser.add_argument("--keep-last", type=int, default=3, help="the job's --keep-last (3)")
    parser.add_argument("--json", type=Path, default=None,
                        help="also write the faults and their timings to this file")
    parser.add_argument("--readme-section", default=None, metavar="NAME",
                        help="on a PASS, write the timings between the <!-- NAME:begin --> and "
                             "<!-- NAME:end --> markers of the README or the docs/ page that "
                             "has them")
    args = parser.parse_args(argv)
    if not 1 <= args.start_nodes <= args.nodes:
        parser.error("--start-nodes must be between 1 and --nodes")
    if args.hosts == "netns" and hosts.unavailable():
        parser.error(f"--hosts netns: {hosts.unavailable()}")
    if args.readme_section and markers.holder(args.readme_section) is None:
        parser.error(f"neither README.md nor docs/ has a {markers.markers(args.readme_section)[0]} "
                     "marker")

    rng = random.Random(args.seed)
    kinds = (tuple(k for k in ALL_KINDS if args.store == "external"
                   or not netfaults.strikes_store(k))
             if args.hosts == "netns" else KINDS)
    count = len(kinds) if args.faults is None else args.faults
    scheduled = parse_schedule(args.schedule) if args.schedule else []
    network_faults = ([f.kind for f in scheduled if f.kind in netfaults.NET_KINDS]
                      if args.schedule else
                      [""] * round(count * (len(kinds) - len(KINDS)) / len(kinds)))
    if args.steps is None:
        args.steps = 2000 + STEPS_PER_NETWORK_FAULT * len(network_faults)
    if args.timeout is None:
        args.timeout = 600 + 150 * len(network_faults)
    faults = scheduled or random_schedule(rng, count, args.steps // 10, args.steps * 3 // 4,
                                          kinds)
    if network_faults and args.hosts != "netns":
        parser.error(f"{network_faults[0]} is a network fault: it needs --hosts netns")
    if any(netfaults.strikes_store(f.kind) for f in faults) and args.store != "external":
        parser.error("store-outage and store-kill need --store external (the store on a host of "
                     "its own)")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**{k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS},
           "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           **(TORCHRUN_DEFAULTS if args.rdzv_defaults else {})}
    data = workdir / "data"
    batch_flags = (["--global-batch-size", str(args.global_batch_size), "--micro-batch-size", "16"]
                   if args.global_batch_size else [])
    num_train = 20 * (args.global_batch_size or TrainConfig().optim.global_batch_size)
    subprocess.run([sys.executable, "-m", "elastic_mnist", "synth", "--out", str(data),
                    "--train", str(num_train), "--test", "512", "--seed", str(args.seed)],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    shared = workdir / "shared"
    train_args = ["--dataset", "synthetic", "--data-dir", str(data), *batch_flags,
                  "--epochs", "1000",
                  "--max-steps", str(args.steps),
                  "--checkpoint-dir", str(shared / "ckpt"), "--logdir", str(shared / "runs"),
                  "--run-id", "chaos", "--checkpoint-every", str(args.checkpoint_every),
                  "--keep-last", str(args.keep_last), "--log-every", "10",
                  "--audit-samples", "--device", "cpu", "--recovery", args.recovery,
                  *(["--hang-timeout", str(args.hang_timeout)] if args.hang_timeout else [])]
    (workdir / "train_args.json").write_text(json.dumps(train_args))
    poisoned = [f"nan-grad@{f.step}:0" for f in faults if f.kind == "nan-grad"]
    if poisoned:  # decided before the job starts: the workers read it from their environment
        env[FAULT_VAR] = ",".join(poisoned)
    print(f"chaos: {args.start_nodes} of up to {args.nodes} nodes on {args.hosts}, "
          f"store {args.store}, "
          f"{len(faults)} faults: {', '.join(f'{f.kind}@{f.step}' for f in faults)}")
    print(f"chaos: work folder {workdir}")

    reference_accuracy = (run_reference(workdir, ["train", *train_args], env)
                          if args.reference else None)
    network = (hosts.Network(network_hosts(args.nodes, args.store)).open()
               if args.hosts == "netns" else None)
    cluster = Cluster(workdir, train_args, args.nodes, args.store, env, args.nproc_per_node,
                      args.launch, args.rdzv_backend, network)
    observer = Observer(shared / "runs" / "chaos")
    failures: list[str] = []
    strikes: list[netfaults.Strike] = []
    deadline = time.time() + args.timeout
    started, first_step, exits = time.time(), None, {}
    try:
        cluster.start_store()
        for _ in range(args.start_nodes):
            cluster.start_node()
        first_step = watch_start(observer, deadline)
        print(f"chaos: first step at world size {first_step['world_size']} "
              f"{first_step['time'] - started:.1f} s after the nodes started")
        in_process = next(e for e in observer.events()
                          if e["event"] == "start")["recovery"] == "in-process"
        settled = 0  # the step by which the last fault's recovery was over
        for fault in faults:
            ready = (fault.step if fault.kind == "nan-grad"  # poisoned at that step
                     else max(fault.step, settled + SETTLE_STEPS))
            while observer.step() < ready and not observer.finished():
                if time.time() > deadline:
                    raise TimeoutError(f"the job did not reach step {fault.step} in time")
                time.sleep(0.05)
            if fault.kind == "nan-grad":
                watch_skip(fault, observer, timeout=60)
                if fault.at:
                    print(f"chaos: nan-grad at step {fault.step} skipped")
                else:
                    failures.append(f"step {fault.step}, poisoned, was not seen skipped")
                continue
            if observer.finished():
                failures.append(f"the job finished before the fault at step {fault.step}")
                break
            ours = args.rdzv_backend == "elastic-mnist"
            fault.expected = ("any" if fault.kind in netfaults.NET_KINDS  # not judged here
                              else "in-process" if in_process and (
                fault.kind in OURS_IN_PROCESS_KINDS if ours else
                fault.kind in IN_PROCESS_KINDS and (fault.kind != "hang-worker"
                                                    or args.nproc_per_node == 1))
                else "restart")
            fault.step = max(fault.step, observer.step())
            fault.size_before = observer.world_size()
            hit = inject(fault, cluster, rng)
            if not hit:
                print(f"chaos: {fault.kind} at step {fault.step} skipped (no node to take)")
                continue
            print(f"chaos: {fault.describe()} at step {fault.step}")
            if isinstance(hit, netfaults.Strike):
                strikes.append(hit)
                watch_network(fault, hit, observer, deadline)
                settled = observer.step()
                continue
            # Bounded by the job's deadline alone: a restart at 32 ranks on 2 cores takes up to
            # two minutes (32 processes importing torch and meeting), and one more fault-sized
            # cap would cut it short.
            watch_recovery(fault, observer, timeout=deadline - time.time())
            if fault.kind == "hang-worker" and fault.recovery == "in-process":
                cluster.frozen.add(fault.node)
            if fault.kind == "preempt-node":
                time.sleep(REQUEUE_DELAY_S)
                cluster.start_node()  # requeued
            if comes_back(fault, args.nproc_per_node) and not fault.job_done_first:
                wait_back(fault, observer, args.nproc_per_node, deadline)
            settled = observer.step()
        while not observer.finished() and time.time() < deadline:
            cluster.alive()
            time.sleep(0.2)
        exits = watch_exits(cluster, observer, timeout=30)
    except TimeoutError as e:
        failures.append(str(e))
    finally:
        for hit in strikes:
            hit.heal()
        cluster.stop()
        if network is not None:
            network.close()

    if not observer.finished():
        failures.append("the job did not finish")
    audit = subprocess.run([sys.executable, str(REPO / "scripts" / "check_audit.py"),
                            str(observer.run_dir), "--num-samples", str(num_train),
                            *([] if args.global_batch_size else ["--every-rank-busy"])],
                           capture_output=True, text=True, env=env, check=False)
    if audit.returncode != 0:
        failures.append(f"sample audit: {audit.stdout.strip() or audit.stderr.strip()}")
    report = json.loads(subprocess.run(
        [sys.executable, "-m", "elastic_mnist", "inspect", "--checkpoint-dir",
         str(shared / "ckpt"), "--json"], env=env, capture_output=True, text=True,
        check=True).stdout)
    corrupt = [c["file"] for c in report["checkpoints"] if not c["valid"]]
    if corrupt:
        failures.append(f"invalid checkpoints: {corrupt}")
    if observer.finished() and reference_accuracy is not None:
        accuracy = evaluate(shared / "ckpt", env)["accuracy"]
        print(f"chaos: final test accuracy {accuracy:.4f}, uninterrupted {reference_accuracy:.4f}")
        if abs(accuracy - reference_accuracy) > args.tolerance:
            failures.append(f"accuracy {accuracy:.4f} is not within {args.tolerance} of the "
                            f"uninterrupted run's {reference_accuracy:.4f}")
    missing = [f.describe() for f in faults
               if f.at and f.first_step is None and not f.job_done_first]
    if missing:
        failures.append(f"no completed step seen after: {missing}")
    hangs = [event_time(e) for e in observer.events() if e["event"] == "hang"]
    unseen = [f.step for f in faults
              if f.kind == "hang-worker" and f.at and not any(t > f.at for t in hangs)]
    if unseen:
        failures.append(f"no hang recorded in events.jsonl after the SIGSTOPs at steps {unseen}")
    failures += one_job_failures(observer.events(), faults)
    records = observer.audit()
    for f in faults:
        if f.at:
            measure_gaps(f, records)
    restarted = [f.describe() for f in faults if f.at and f.expected == "in-process"
                 and not (f.job_done_first and f.recovery is None)
                 and (f.recovery != "in-process" or not f.survivors_kept)]
    if restarted:
        failures.append(f"recovered by a restart, not in process: {restarted}")

    summary = [table([f for f in faults if f.at])]
    if first_step:
        summary.append(f"First step, at world size {first_step['world_size']}: "
                       f"{first_step['time'] - started:.1f} s after the nodes started.")
    if exits:
        summary.append("Last step → torchrun's exit: " + ", ".join(
            f"node {node} {'did not exit' if s is None else f'{s:.1f} s'}"
            for node, s in exits.items()) + ".")
    guarded = sum(log.read_text(errors="replace").count(ROUND_GUARD_LINE)
                  for log in cluster.workdir.glob("node*.log"))
    if guarded:
        summary.append(f"The rendezvous dropped agents whose keep-alives lapsed and moved on "
                       f"without them: {guarded} ranks saw it and left, to be restarted into the "
                       "new round (`TorchrunAgents.guard`).")
    print("\n".join(summary))
    if args.readme_section and not failures:
        markers.rewrite(args.readme_section, "\n\n".join(summary))
    if args.json:
        args.json.write_text(json.dumps({
            "failures": failures, "rdzv_defaults": args.rdzv_defaults, "store": args.store,
            "hosts": args.hosts,
            "rdzv_backend": args.rdzv_backend,
            "launch": args.launch, "nproc_per_node": args.nproc_per_node,
            "first_step_s": first_step["time"] - started if first_step else None,
            "first_step_world_size": first_step["world_size"] if first_step else None,
            "recovery": args.recovery,
            "exit_after_last_step_s": {str(node): s for node, s in exits.items()},
            "agent_exits": {str(node): code for node, code in cluster.exited.items()},
            "faults": [{"kind": f.kind, "node": f.node, "step": f.step,
                        "expected": f.expected, "recovery": f.recovery,
                        "survivors_kept": f.survivors_kept,
                        **{name: None if t is None else t - f.at
                           for name, t in (("noticed_s", f.noticed), ("restarted_s", f.restarted),
                                           ("first_step_s", f.first_step),
                                           ("healed_s", f.healed))},
                        "gap_s": f.gap_s, "full_s": f.full_s,
                        "steps_redone": f.steps_redone, "job_done_first": f.job_done_first,
                        "size_before": f.size_before, "seconds": f.seconds,
                        "came_back": f.came_back, "grows": f.grows,
                        "first_answer": f.first_answer}
                       for f in faults if f.at]}, indent=2))
    for failure in failures:
        print(f"FAIL {failure}")
    print("chaos: PASS" if not failures else "chaos: FAIL")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
