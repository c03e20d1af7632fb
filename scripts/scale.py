#!/usr/bin/env python3
"""Coordination at scale: the job's traffic to its one store, simulated up to 1,000 nodes × 8.

    scripts/scale.py [--sizes 8,64,512,2048,8000] [--ranks-per-node 8] [--steady-s 6]
                     [--hang-timeout 10] [--budget-s 60] [--json bench/scale.json]

Everything that keeps a job together runs through one c10d TCPStore, served by one event loop.
This runs that traffic without training: one real TCPStore (torch's, in a process of its own,
as ``elastic-mnist rendezvous`` serves it) and simulated nodes, spread over a few processes,
each node on connections of its own speaking for its ranks with the job's own code:

- every rank's heartbeat is a real :class:`Watchdog`'s ``_publish`` (once a second); through a
  hang, the two probers read every heartbeat twice (``_table``, two beats apart) and declare
  (``_claim``), and every other rank looks for their verdict (``_probers_verdict``);
- every rank raises its pulse on its node's real board (board.py, a file per simulated node),
  whose speaker writes the node's record every ``PULSE_S``;
- each node's agent asks ``Roster.waiting`` every ``--monitor-interval`` (0.5 s, as jobs/
  launch it) and, every ``look_interval`` (twice per keep-alive interval, less often beyond 40
  agents), judges the job's agents with ``Liveness.dead`` (the body of
  ``AgentsHandler.num_nodes_waiting``, less its read of the job's record); it keeps alive with
  ``Roster.keep_alive``;
- rank 0 beats for the job (``Roster.beat``, every admissions poll); each node's local rank 0
  asks the fence (``CurrentGeneration.dropped``) every lease beat.

Phases, for each size: a steady state (``--steady-s``); a hang (from two beats before the
deadline, as when the job stops stepping); a lost node (its pulses stop; every survivor declares
the fault with ``declare_fault`` and checks in, the watchers read the identities, the check-ins
and the pulses and close the membership with ``close_membership``, deciding from the members'
positions (the record names the nodes' sizes, from which each survivor finds its place), and
every other survivor waits for it, as recovery.py does). Not simulated: the new group's
creation (gloo's own rendezvous on the store, W reads per survivor: docs/recovery.md). It
prints a table (store operations and bytes a second, per rank, the busiest second, the time to
a hang verdict, the time to an agreed membership) and writes it as JSON, with the store's own
load per phase (its process's share of one core, and the round trip of a client that asks
nothing else) beside the simulating processes' share of the cores: where the latter nears
them all, the times are this machine's, not the store's. The store's capacity is measured
first, on the same machine. A phase that does not finish within ``--budget-s`` stops the run at
that size, saying so: the machine (its cores drive every simulated client) or the design (its
operations grow faster than its ranks) cannot hold it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import multiprocessing as mp
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import markers
from processes import free_port
from torch.distributed import PrefixStore, TCPStore

from elastic_mnist.env import DistEnv
from elastic_mnist.errors import first_line
from elastic_mnist.resilience.agreement import (
    PULSE_S,
    Identity,
    Pulses,
    check_in,
    close_membership,
    declare_fault,
    node_sizes,
    pulse_key,
    read_present,
    watchers,
)
from elastic_mnist.resilience.board import NodeBoard
from elastic_mnist.resilience.current import CurrentGeneration
from elastic_mnist.resilience.roster import Liveness, Roster, look_interval
from elastic_mnist.resilience.watchdog import (
    BEAT_S,
    PROBE_BEATS,
    StoreSilent,
    Watchdog,
    probers,
)
from elastic_mnist.stores import listening

REPO = Path(__file__).resolve().parents[1]
LAUNCH = "elastic_mnist/sim/launch"
"""The workers' prefix in the store (``elastic_mnist/<run id>/<launch>``, job.py)."""
PROCESSES = 32
"""Simulating processes: their threads share the machine's cores with the store. Many, for
Python's lock: a node's thread waits for it after every store call, behind the other threads
of its process (with 4 processes at 8,000 ranks, a hang's verdict reached the last rank 16 s
late, and a membership closed 10 s late, with the store a fifth busy): ranks of real nodes
share no such lock."""
SIMULATION_NICE = 10
"""The simulating processes' niceness: the store's process (and the gauge's) go first on the
machine's shared cores, as the store's host's own cores serve it in a job, so that the store's
times are its own work's, not a wait for the cores."""
CAPACITY_CLIENTS = 4
"""Processes that measure the store's capacity, each as fast as it can."""
CONNECTING = 32
"""Nodes a simulating process opens its connections for at once, as it starts."""
GAUGE_S = 0.05
"""How often :class:`StoreGauge` reads the store's load."""
MONITOR_S = 0.5
"""The agent asks ``num_nodes_waiting`` every ``--monitor-interval``: 0.5 s as jobs/ launch it
(torch's default, 0.1 s, asks five times as often: 10 N operations a second)."""
KEEP_ALIVE_S = 5.0
"""torch's default ``keep_alive_interval``, also what our agent uses."""
LEASE_BEAT_S = 3.0
"""A node's lease keeper asks the fence every ``--lease-timeout`` / 5 (15 s by default)."""
ADMISSIONS_S = 0.5
"""Rank 0's admissions poll: a beat of the job each time."""
MAX_AGREEING = 1024
"""Surviving nodes whose agreement this machine runs at once, a thread each (speaking for the
node's ranks in turn): beyond, its threads fight over 2 cores for minutes and time nothing but
the fight (the lost node is not simulated, and the run stops there, saying so)."""
OPS = ("set", "get", "add", "check", "multi_get", "multi_set", "compare_set", "wait")


class Counting:
    """A store that counts what passes through it: operations, and bytes of keys and values
    each way, per second of the wall clock."""

    def __init__(self, store: Any, counts: Counter, lock: threading.Lock, prefix: str = ""):
        """``prefix``: the prefix ``store`` puts before every key, counted in its bytes."""
        self._store, self._counts, self._lock = store, counts, lock
        self._prefix = len(prefix) + 1 if prefix else 0

    def _count(self, ops: int, nbytes: int, keys: int = 1) -> None:
        second = int(time.time())
        with self._lock:
            self._counts[("ops", second)] += ops
            self._counts[("bytes", second)] += nbytes + keys * self._prefix

    def set_timeout(self, timeout: timedelta) -> None:
        self._store.set_timeout(timeout)

    def set(self, key: str, value: str | bytes) -> None:
        self._store.set(key, value)
        self._count(1, len(key) + len(value))

    def get(self, key: str) -> bytes:
        value = self._store.get(key)
        self._count(1, len(key) + len(value))
        return value

    def add(self, key: str, amount: int) -> int:
        value = self._store.add(key, amount)
        self._count(1, len(key) + 16)
        return value

    def check(self, keys: list[str]) -> bool:
        found = self._store.check(keys)
        self._count(1, sum(map(len, keys)) + 1, len(keys))
        return found

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = self._store.multi_get(keys)
        self._count(1, sum(map(len, keys)) + sum(map(len, values)), len(keys))
        return values

    def multi_set(self, keys: list[str], values: list[str]) -> None:
        self._store.multi_set(keys, values)
        self._count(1, sum(map(len, keys)) + sum(map(len, values)), len(keys))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        value = self._store.compare_set(key, expected, desired)
        self._count(1, len(key) + len(expected) + len(desired) + len(value))
        return value

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._store.wait(keys) if timeout is None else self._store.wait(keys, timeout)
        self._count(1, sum(map(len, keys)), len(keys))


class SimWatchdog(Watchdog):
    """The job's watchdog, its store calls made in the calling thread (a simulated node's),
    not in a thread of its own per rank; a call that fails (the store answered after the 2 s the
    watchdog gives it) is the store silent, as for the job's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # No training thread to find: the heartbeat's ``where`` is empty (its frame walk,
        # ``sys._current_frames()`` over this process's hundreds of threads, 8,000 times a
        # second, would be the simulation's own cost, not the store's).
        self.training_thread = None

    def _call(self, method, *args):
        try:
            return method(*args)
        except RuntimeError as e:  # DistStoreError: a timeout
            raise StoreSilent from e


class Node:
    """A simulated node: its agent and its ranks, on one connection to the store."""

    def __init__(self, serial: int, ranks: range, world: int, port: int, counts: Counter,
                 lock: threading.Lock, host: str, folder: Path, hang_timeout: float):
        self.serial, self.ranks, self.world = serial, ranks, world
        raw = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
        self.store = Counting(raw, counts, lock)  # the rendezvous records' (Roster's own keys)
        self.job = Counting(PrefixStore(LAUNCH, raw), counts, lock, LAUNCH)  # the workers'
        # The watchdogs' connection of their own (their calls time out after 2 s), on a
        # generation's own prefix.
        watch = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
        generation = f"{LAUNCH}/g0"
        self.generation = Counting(PrefixStore(generation, watch), counts, lock, generation)
        # What a rank waits on in the agreement, a connection of its own, as each rank's main
        # one is (a wait holds its connection).
        self.agreeing = Counting(PrefixStore(LAUNCH, TCPStore(
            "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))),
            counts, lock, LAUNCH)
        self.errors: Counter = Counter()
        """Store calls that failed (a timeout, most often), by their first line."""
        self.roster = Roster(self.store, "sim")
        self.liveness = Liveness(self.roster, serial, max_attempt=3)
        self.fence = CurrentGeneration(self.job, None, "launch")
        # The node's board: a slot per rank, in a file of the node's own, as its workers share it.
        self.boards = [NodeBoard(folder, host, len(ranks), slot) for slot in range(len(ranks))]
        self.identities = {r: Identity(host, 1000 + r, 100 + serial, r - ranks.start,
                                       nonce=f"n{r}", serial=serial, board=self.boards[0].node)
                           for r in ranks}
        self.watchdogs = {r: SimWatchdog(DistEnv(rank=r, world_size=world), self.generation,
                                         floor_s=hang_timeout, report=lambda record: None)
                          for r in ranks}
        self.stopped = threading.Event()
        """Set when the node is lost: its agent and ranks fall silent."""
        self.watching = set(watchers(range(world)))
        """The ranks that confirm a declaration (Membership.declare)."""

    def pulse_key(self, rank: int) -> tuple[str, int]:
        return pulse_key(self.identities[rank])

    def start(self) -> None:
        """What a node writes as it starts: its agent's keep-alive, its board's record, its
        ranks' identities, and their first heartbeats."""
        self.roster.keep_alive(self.serial)
        self._pulse()
        for r in self.ranks:
            self.job.set(f"g0/id/{r}", json.dumps(dataclasses.asdict(self.identities[r])))
            self.watchdogs[r]._publish()

    def _pulse(self) -> None:
        """Every rank raises its pulse on the board; the speaker (slot 0: every slot moves
        here) judges the board and writes the node's record. The others' judgement of it is
        theirs alone, no store traffic, and costs this machine's cores 8 times over."""
        for board in self.boards[1:]:
            board.raise_pulse()
        record = self.boards[0].beat()
        if record is not None:
            self.job.set(self.boards[0].key, record)

    def steady(self, until: float, stop: threading.Event) -> None:
        """The node's periodic traffic until ``until`` (or ``stop``, or the node is lost)."""
        agents = math.ceil(self.world / len(self.ranks))
        periods = {"pulse": PULSE_S, "beat": BEAT_S, "monitor": MONITOR_S,
                   "look": look_interval(KEEP_ALIVE_S, agents), "keep_alive": KEEP_ALIVE_S,
                   "fence": LEASE_BEAT_S, "admissions": ADMISSIONS_S}
        start = time.time()  # the plan's clock: every simulating process shares it
        # Nodes' clocks are not in step: each node's duties begin at its own point of their
        # periods, spread evenly (a look every minute at 1,000 nodes is still counted in a few
        # seconds' window at its rate).
        phase = (self.serial * 0.6180339887) % 1
        due = {name: start + phase * period for name, period in periods.items()}
        job_agents = list(range(1, agents + 1))
        while not stop.is_set() and not self.stopped.is_set():
            name = min(due, key=due.get)
            wait = due[name] - time.time()
            if wait > 0 and stop.wait(min(wait, until - time.time())):
                return
            if time.time() >= until or self.stopped.is_set():
                return
            due[name] += periods[name]
            try:
                self._periodic(name, job_agents)
            except RuntimeError as e:  # DistStoreError: the store answered too late
                self.errors[first_line(e)[:100]] += 1

    def _periodic(self, name: str, job_agents: list[int]) -> None:
        """One periodic duty of the node (:meth:`steady`)."""
        if name == "pulse":
            self._pulse()
        elif name == "beat":
            for r in self.ranks:
                self.watchdogs[r]._publish()
        elif name == "monitor":
            self.roster.waiting(0)
        elif name == "look":
            self.liveness.dead(job_agents)
        elif name == "keep_alive":
            self.roster.keep_alive(self.serial)
        elif name == "fence":
            self.fence.dropped(0, self.ranks.start)
        elif name == "admissions" and self.ranks.start == 0:
            self.roster.beat()

    def probe(self, stop: threading.Event) -> float | None:
        """Every rank's watchdog through a hang, from two beats before its deadline: a prober
        reads every heartbeat twice, two beats apart, and declares; every other rank, from the
        deadline, looks for the verdict every beat (``_probers_verdict``) and, finding it,
        declares the fault to the membership (``declare_fault``: the first wakes every rank).
        When the node's last rank has the verdict (None: stopped first, past the phase's budget,
        or the store did not answer a watchdog within its 2 s)."""
        dogs = self.watchdogs
        lead = PROBE_BEATS * BEAT_S
        for dog in dogs.values():  # no step for the deadline less two beats: the probe is due
            dog.last_progress = time.monotonic() - (dog.deadline_s() - lead)
            dog.prober_beats = None
        chosen = [r for r in self.ranks if r in probers(self.world)]
        tables = {r: [dogs[r]._table()] for r in chosen}
        if chosen:
            time.sleep(lead)
        for r in chosen:
            tables[r].append(dogs[r]._table())
            if None in tables[r]:
                self.errors["a prober's table: the store did not answer within 2 s"] += 1
                return None
            dogs[r]._claim({"rank": None, "ranks": [], "reported_by": r, "last_step": 0,
                            "reason": "simulated"})
            declare_fault(self.agreeing, "hang/", self.world, json.dumps({"rank": r}))
        waiting = set(self.ranks) - set(chosen)
        while waiting and not stop.is_set():
            for r in sorted(waiting):
                found = dogs[r]._probers_verdict()
                if found == "probe":  # the probers stood still, or the store went silent
                    self.errors["a follower would probe: the probers stood still, or the "
                                "store did not answer within 2 s"] += 1
                    return None
                if found != "wait":  # it declares to the membership, as _follow does
                    declare_fault(self.agreeing, "hang/", self.world, json.dumps({"rank": r}),
                                  confirm=r in self.watching)
                    waiting.discard(r)
            if waiting:
                stop.wait(BEAT_S)  # the node's heartbeats (steady) raise each rank's beats
        return None if waiting else time.time()

    def agree(self, world: int, limit_s: float) -> float:
        """The node's survivors' agreement, as recovery.py makes it: each declares the fault
        (the first wakes everyone), checks in, and closes the membership, if it is one of the
        watchers, or waits for it. When the node's ranks have it: in a job they wait for the
        record side by side and are woken together, here one thread serves them in turn (each
        one's wait and read still made and counted), so the first one's time stands for all."""
        try:
            for r in self.ranks:
                declare_fault(self.agreeing, "g0/", world, json.dumps({"rank": r}),
                              confirm=r in self.watching)
                check_in(self.agreeing, "g0/", r, json.dumps(
                    {"step": 1, "mid_step": False, "evaluated_step": 0}))
            survivors, woken = set(range(world)), None
            for r in self.ranks:
                if r in watchers(survivors):
                    continue  # in a thread of its own (watch)
                close_membership(self.agreeing, "g0/", survivors, [], Pulses(
                    self.agreeing, {}, self.pulse_key(r)), limit_s, rank=r)
                woken = woken or time.time()
        except RuntimeError as e:
            self.errors[first_line(e)[:100]] += 1
            return None
        return woken or time.time()

    def watch(self, rank: int, world: int, limit_s: float, port: int, counts: Counter,
              lock: threading.Lock) -> float:
        """A watcher's agreement (on a connection of its own): it reads every rank's identity
        (where its pulse is), the check-ins and the pulses, closes the membership and decides,
        reading the members' positions once."""
        store = Counting(PrefixStore(LAUNCH, TCPStore("127.0.0.1", port, is_master=False,
                                                      timeout=timedelta(seconds=300))),
                         counts, lock, LAUNCH)
        found = read_present(store, [f"g0/id/{r}" for r in range(world)])
        identities = {r: Identity(**json.loads(found[f"g0/id/{r}"])) for r in range(world)}
        keys = {r: pulse_key(identity) for r, identity in identities.items()}

        def decide(members: list[int], positions: dict[int, str]) -> dict[str, Any]:
            """As recovery.py's: the agreed step, and what each survivor needs to find its
            place (the nodes' sizes) and to name the lost."""
            left = set(members)
            return {"step": max(json.loads(positions[r])["step"] for r in members),
                    "nodes": node_sizes(members, identities),
                    "lost": [[r, identities[r].host] for r in range(world) if r not in left]}

        try:
            close_membership(store, "g0/", set(range(world)), [],
                             Pulses(store, keys, self.pulse_key(rank)), limit_s, rank=rank,
                             decide=decide)
        except RuntimeError as e:
            self.errors[first_line(e)[:100]] += 1
            return None
        return time.time()


def simulate(share: list[tuple[int, range]], world: int, port: int, plan: dict,
             barrier: Any, out: Any) -> None:
    """One simulating process: its share of the nodes through every phase, in step with the
    others (``barrier``); what it counted and measured goes back on ``out``."""
    # The store's host has cores of its own in a job: here, it goes first on the shared ones.
    os.nice(SIMULATION_NICE)
    counts: Counter = Counter()
    lock = threading.Lock()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # a connection per node
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    folder = Path(tempfile.mkdtemp(prefix="scale-boards-"))  # the nodes' boards
    # Opened side by side: a connection takes a tenth of a second to open here, most of it
    # waiting, and a process opens 750 of them at 8,000 ranks.
    with ThreadPoolExecutor(max_workers=CONNECTING) as pool:
        nodes = list(pool.map(lambda node: Node(
            node[0], node[1], world, port, counts, lock, f"node{node[0]}", folder,
            plan["hang_timeout"]), share))
        list(pool.map(Node.start, nodes))
    result: dict[str, Any] = {}
    stop = threading.Event()

    def run_all(target, args_of) -> tuple[list[threading.Thread], list[Any]]:
        found: list[Any] = []

        def call(node: Node, args: tuple) -> None:
            try:
                found.append(target(node, *args))
            except RuntimeError as e:  # a store call that timed out: no result
                node.errors[first_line(e)[:100]] += 1
                found.append(None)

        threads = [threading.Thread(target=call, args=(n, a), daemon=True)
                   for n in nodes for a in args_of(n)]
        for t in threads:
            t.start()
        return threads, found

    def steady_until(t: float) -> list[threading.Thread]:
        threads, _ = run_all(Node.steady, lambda n: [(t, stop)])
        return threads

    # Steady state.
    barrier.wait()
    result["steady_from"] = time.time()
    result["cpu"] = {"steady_from": time.process_time()}
    for t in steady_until(result["steady_from"] + plan["steady_s"]):
        t.join()
    result["steady_to"] = time.time()
    # A hang: the watchdogs probe while the heartbeats and pulses go on.
    barrier.wait()
    result["hang_from"] = time.time()
    result["cpu"]["hang_from"] = time.process_time()
    deadline = result["hang_from"] + plan["budget_s"]
    background = steady_until(deadline)
    threads, probed = run_all(lambda n: n.probe(stop), lambda n: [()])
    for t in threads:
        t.join(max(0.0, deadline - time.time()))
    stop.set()
    for t in threads:
        t.join()
    result["probed"] = (None if None in probed or len(probed) < len(threads)
                        else max(probed, default=-math.inf))
    for t in background:
        t.join()
    # A lost node: the last one's pulses stop; every other rank agrees on who is left (where
    # there is another node).
    stop.clear()
    barrier.wait()
    if plan["lost_node"] is None:
        result["lost_from"] = result["end"] = time.time()
        result["cpu"]["lost_from"] = result["cpu"]["end"] = time.process_time()
        result["errors"] = dict(sum((node.errors for node in nodes), Counter()))
        result["counts"] = [[kind, second, n] for (kind, second), n in counts.items()]
        out.send(result)
        return
    result["lost_from"] = time.time()
    result["cpu"]["lost_from"] = time.process_time()
    deadline = result["lost_from"] + plan["budget_s"]
    lost = plan["lost_node"]
    for node in nodes:
        if node.serial == lost:
            node.stopped.set()
    background = steady_until(deadline)
    # Each node's survivors in a thread, each watcher in one of its own.
    chosen = watchers(set(range(world)))
    threads, agreed = run_all(
        lambda n, r: n.agree(world, plan["limit_s"]) if r is None else
        n.watch(r, world, plan["limit_s"], port, counts, lock),
        lambda n: [] if n.serial == lost else
        [(None,)] + [(r,) for r in n.ranks if r in chosen])
    for t in threads:
        t.join(max(0.0, deadline - time.time()))
    # -inf: this process simulates no survivor (the lost node alone).
    result["agreed"] = (max(agreed, default=-math.inf)
                        if len(agreed) == len(threads) and None not in agreed else None)
    stop.set()
    for t in background:
        t.join()
    result["end"] = time.time()
    result["cpu"]["end"] = time.process_time()
    result["errors"] = dict(sum((node.errors for node in nodes), Counter()))
    result["counts"] = [[kind, second, n] for (kind, second), n in counts.items()]
    shutil.rmtree(folder, ignore_errors=True)
    out.send(result)


def receive(pipe: Any, proc: mp.Process) -> Any:
    """What ``proc`` sends on ``pipe``; SystemExit if it dies first."""
    while not pipe.poll(1.0):
        if not proc.is_alive():
            raise SystemExit(f"scale: a simulating process failed (exit {proc.exitcode})")
    return pipe.recv()


def serve(port: int) -> subprocess.Popen:
    """The store, in a process of its own, as ``elastic-mnist rendezvous`` serves it."""
    proc = subprocess.Popen([sys.executable, "-m", "elastic_mnist", "rendezvous", "--host",
                             "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not listening("127.0.0.1", port, timeout_s=1):
        if time.time() > deadline or proc.poll() is not None:
            proc.kill()
            raise SystemExit(f"scale: the store did not start on port {port}")
        time.sleep(0.1)
    return proc


def stop_serving(server: subprocess.Popen) -> None:
    """Ends the store's process: SIGTERM, SIGKILL if it has not ended within 10 s (thousands of
    connections to close)."""
    server.terminate()
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


class StoreGauge:
    """The store's own load, read beside the simulation every GAUGE_S: its process's CPU time,
    and the round trip of a ``check`` by a client that asks nothing else (on this machine's busy
    cores: an upper bound of the store's own answer)."""

    def __init__(self, port: int, pid: int):
        self.port, self.pid = port, pid
        self.trips: list[tuple[float, float]] = []
        """(when, seconds) of each round trip."""
        self.cpu: list[tuple[float, float]] = []
        """(when, the store's CPU seconds so far)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="store-gauge")
        self._thread.start()

    def _run(self) -> None:
        store = TCPStore("127.0.0.1", self.port, is_master=False, timeout=timedelta(seconds=60))
        store.set("gauge", "1")
        tick = os.sysconf("SC_CLK_TCK")
        stat = Path(f"/proc/{self.pid}/stat")
        while not self._stop.wait(GAUGE_S):
            start = time.perf_counter()
            store.check(["gauge"])
            self.trips.append((time.time(), time.perf_counter() - start))
            with contextlib.suppress(OSError, ValueError, IndexError):  # no /proc: no CPU figure
                # utime and stime, after the command's closing parenthesis (fields 14 and 15)
                fields = stat.read_text().rpartition(")")[2].split()
                self.cpu.append((time.time(), (int(fields[11]) + int(fields[12])) / tick))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def cpu_share(self, start: float, end: float) -> float | None:
        """The store's share of one core from ``start`` to ``end``."""
        inside = [(t, c) for t, c in self.cpu if start <= t <= end]
        if len(inside) < 2:
            return None
        return (inside[-1][1] - inside[0][1]) / max(inside[-1][0] - inside[0][0], 1e-9)

    def round_trip_ms(self, start: float, end: float) -> list[float] | None:
        """The median and the 99th percentile of the round trips from ``start`` to ``end``."""
        trips = sorted(s for t, s in self.trips if start <= t <= end)
        if not trips:
            return None
        return [1e3 * trips[len(trips) // 2], 1e3 * trips[min(len(trips) - 1,
                                                                 int(0.99 * len(trips)))]]


def hammer(port: int, seconds: float, out: Any) -> None:
    """One client's fastest stream of ``add``s on its own key (a pulse)."""
    store = TCPStore("127.0.0.1", port, is_master=False)
    done, end = 0, time.time() + seconds
    while time.time() < end:
        for _ in range(100):
            store.add(f"capacity/{os.getpid()}", 1)
        done += 100
    out.send(done)


def capacity(port: int, clients: int, seconds: float = 3.0) -> float:
    """The store's operations a second, as ``clients`` processes on this machine drive it."""
    pipes = [mp.Pipe(duplex=False) for _ in range(clients)]
    procs = [mp.Process(target=hammer, args=(port, seconds, w)) for _, w in pipes]
    for p in procs:
        p.start()
    total = sum(r.recv() for r, _ in pipes)
    for p in procs:
        p.join()
    return total / seconds


def model(ranks: int, per_node: int) -> dict[str, float]:
    """The steady operations a second that each component asks of the store, as the periods
    above make them: what the simulation should count where the machine drives it all."""
    nodes = math.ceil(ranks / per_node)
    return {"pulses": nodes / PULSE_S, "heartbeats": ranks / BEAT_S,
            "agents' polls": nodes / MONITOR_S,
            # Liveness.dead: an add, a multi_get of every agent's keep-alive
            "agents' looks": 2 * nodes / look_interval(KEEP_ALIVE_S, nodes),
            "keep-alives": nodes / KEEP_ALIVE_S, "fence": nodes / LEASE_BEAT_S,
            "job's beat": 1 / ADMISSIONS_S}


def measure(ranks: int, per_node: int, steady_s: float, hang_timeout: float, budget_s: float,
            cap: float) -> dict[str, Any]:
    """One size through its three phases, on a store of its own."""
    port = free_port()
    server = serve(port)
    gauge = None
    try:
        nodes = [(serial, range(start, min(start + per_node, ranks)))
                 for serial, start in enumerate(range(0, ranks, per_node), start=1)]
        shares = [nodes[i::PROCESSES] for i in range(min(PROCESSES, len(nodes)))]
        # One node: nobody to go on; too many survivors for this machine: not simulated.
        lost = nodes[-1][0] if 1 < len(nodes) and len(nodes) - 1 <= MAX_AGREEING else None
        plan = {"steady_s": steady_s, "budget_s": budget_s, "lost_node": lost,
                "nodes": nodes, "limit_s": hang_timeout, "hang_timeout": hang_timeout}
        pipes = [mp.Pipe(duplex=False) for _ in shares]
        barrier = mp.Barrier(len(shares))
        procs = [mp.Process(target=simulate, args=(share, ranks, port, plan, barrier, w))
                 for share, (_, w) in zip(shares, pipes, strict=True)]
        for p in procs:
            p.start()
        # Its thread started only now: a process forked while a thread of this one holds a
        # lock (a connection's, as it opens) would find it held forever.
        gauge = StoreGauge(port, server.pid)
        results = [receive(r, p) for (r, _), p in zip(pipes, procs, strict=True)]
        for p in procs:
            p.join()
    finally:
        if gauge is not None:
            gauge.stop()
        stop_serving(server)
    counts: Counter = Counter()
    for result in results:
        for kind, second, n in result["counts"]:
            counts[(kind, second)] += n

    def window(kind: str, start: float, end: float) -> list[int]:
        return [counts[(kind, s)] for s in range(int(start), int(end))]

    def when(name: str) -> float:
        return max(r[name] for r in results)  # the phase began in every process by then

    steady = window("ops", when("steady_from") + 1, min(r["steady_to"] for r in results))
    steady_bytes = window("bytes", when("steady_from") + 1, min(r["steady_to"] for r in results))
    fault = window("ops", min(r["hang_from"] for r in results), when("end"))
    probed = [r["probed"] for r in results]
    agreed = [r.get("agreed") for r in results]
    ops_s = sum(steady) / max(len(steady), 1)

    def busy(start: str, end: str) -> float:
        """The share of this machine's cores the simulating processes used in a phase: near
        1, its times are the machine's (its cores drive every simulated rank), not the
        store's."""
        cpu = sum(r["cpu"][end] - r["cpu"][start] for r in results)
        wall = max(r[end] for r in results) - min(r[start] for r in results)
        return cpu / max(wall, 1e-9) / (os.cpu_count() or 1)

    phases = {"steady": ("steady_from", "hang_from"), "hang": ("hang_from", "lost_from"),
              "lost node": ("lost_from", "end")}

    def span(start: str, end: str) -> tuple[float, float]:
        return min(r[start] for r in results), max(r[end] for r in results)

    demanded = sum(model(ranks, per_node).values())
    return {
        "ranks": ranks, "nodes": len(nodes), "ranks_per_node": per_node,
        "model_ops_s": demanded, "driven": ops_s / demanded,
        "steady_ops_s": ops_s, "steady_ops_s_per_rank": ops_s / ranks,
        "steady_bytes_s": sum(steady_bytes) / max(len(steady_bytes), 1),
        "busiest_second_steady": max(steady, default=0),
        "busiest_second_fault": max(fault, default=0),
        "busiest_fraction_of_capacity": max([*steady, *fault], default=0) / cap,
        # The probe starts two beats before the deadline (Watchdog._probe_due): the verdict is
        # at the deadline, or when the slowest probe has read its second table, if later.
        "hang_verdict_s": None if None in probed else max(
            hang_timeout, hang_timeout - PROBE_BEATS * BEAT_S + max(probed) - when("hang_from")),
        "agreed_s": None if lost is None or None in agreed else max(agreed) - when("lost_from"),
        "store_errors": dict(sum((Counter(r["errors"]) for r in results), Counter())),
        "simulation_cpu_share": {name: busy(*keys) for name, keys in phases.items()},
        "store_cpu_share": {name: gauge.cpu_share(*span(*keys)) for name, keys in phases.items()},
        "store_round_trip_ms": {name: gauge.round_trip_ms(*span(*keys))
                                for name, keys in phases.items()},
    }


def table(rows: list[dict[str, Any]], cap: float) -> str:
    def num(v: float | None, fmt: str = ".1f") -> str:
        return "—" if v is None else format(v, fmt)

    lines = [("| ranks (nodes) | store ops/s (model) | per rank | bytes/s | busiest second: "
              "steady, fault (share of capacity) | hang verdict (s) | agreed membership (s) |"),
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(
            f"| {r['ranks']} ({r['nodes']}) | {r['steady_ops_s']:,.0f} "
            f"({r['model_ops_s']:,.0f}) | "
            f"{r['steady_ops_s_per_rank']:.1f} | {r['steady_bytes_s'] / 1e6:.2f} MB | "
            f"{r['busiest_second_steady']:,}, {r['busiest_second_fault']:,} "
            f"({r['busiest_fraction_of_capacity']:.0%}) | {num(r['hang_verdict_s'])} | "
            f"{num(r['agreed_s'])} |")
    lines.append(f"\nThe store's capacity here: {cap:,.0f} operations a second "
                 f"({CAPACITY_CLIENTS} client processes). The model's figure is what the job's "
                 "periods ask for; where the count falls short of it, this machine's cores could "
                 "not drive every simulated rank.")
    lines.append("The simulating processes' share of the machine's cores (steady, hang, lost "
                 "node): " + "; ".join(
                     f"{r['ranks']} ranks " + ", ".join(
                         f"{share:.0%}" for share in r["simulation_cpu_share"].values())
                     for r in rows) + ".")
    def load(r: dict[str, Any], phase: str) -> str:
        trip = r["store_round_trip_ms"][phase]
        return (f"{num(r['store_cpu_share'][phase], '.0%')} "
                + ("—" if trip is None else f"{trip[0]:.1f}/{trip[1]:.1f} ms"))

    lines.append("The store's own process (one event loop), its share of one core and the round "
                 "trip of a client that asks nothing else, median/99th percentile (steady, "
                 "hang, lost node): " + "; ".join(
                     f"{r['ranks']} ranks " + ", ".join(load(r, phase)
                                                        for phase in r["store_cpu_share"])
                     for r in rows) + ".")
    for r in rows:
        if r["store_errors"]:
            lines.append(f"At {r['ranks']} ranks, {sum(r['store_errors'].values()):,} store "
                         f"calls failed, e.g. \"{next(iter(r['store_errors']))}\".")
    return "\n".join(lines)


def why_stopped(row: dict[str, Any], budget_s: float) -> list[str]:
    """Why a size's row ends the run (nothing: it does not)."""
    reasons = []
    if row["hang_verdict_s"] is None:
        reasons.append(f"the hang's probes did not finish within {budget_s:g} s on this machine, "
                       "or a store call in them timed out")
    survivors = row["nodes"] - 1
    if row["nodes"] > 1 and survivors > MAX_AGREEING:
        reasons.append(f"the lost node was not simulated: {survivors:,} surviving nodes "
                       f"agreeing, a thread each, are more than this machine runs at once "
                       f"({MAX_AGREEING:,})")
    elif row["nodes"] > 1 and row["agreed_s"] is None:
        reasons.append(f"the agreement did not finish within {budget_s:g} s, or a store call in "
                       "it timed out")
    return reasons


AGREED_TARGET_S = 2.0
"""The issue's target for an agreed membership after a lost node."""
VERDICT_MARGIN_S = 2.0
"""A hang's verdict is due within ``--hang-timeout`` and this."""
BUSIEST_TARGET = 0.25
"""The store's busiest second, steady or in a fault, under this share of its capacity."""


def targets(row: dict[str, Any], hang_timeout: float, cap: float) -> dict[str, bool | None]:
    """Which of the targets a size's row meets (None: not measured there)."""
    return {
        "busiest second steady": row["busiest_second_steady"] < BUSIEST_TARGET * cap,
        "busiest second in a fault": row["busiest_second_fault"] < BUSIEST_TARGET * cap,
        "hang verdict": None if row["hang_verdict_s"] is None
        else row["hang_verdict_s"] <= hang_timeout + VERDICT_MARGIN_S,
        "agreed membership": None if row["agreed_s"] is None
        else row["agreed_s"] <= AGREED_TARGET_S,
    }


def verdicts(rows: list[dict[str, Any]], hang_timeout: float) -> str:
    """The targets each size met, in a line, and the largest size that met them all."""
    parts, largest = [], None
    for r in rows:
        met = r["targets"]
        missed = [name for name, ok in met.items() if ok is False]
        parts.append(f"{r['ranks']} ranks " + (f"missed: {', '.join(missed)}" if missed
                                              else "met every one measured"))
        largest = r["ranks"] if not missed else largest
    return (f"Targets (the busiest second under {BUSIEST_TARGET:.0%} of the capacity, steady and "
            f"in a fault; a hang's verdict within {hang_timeout + VERDICT_MARGIN_S:g} s; an "
            f"agreed membership within {AGREED_TARGET_S:g} s): " + "; ".join(parts)
            + (f". The largest size that met them all here: {largest} ranks." if largest
               else "."))


def exponent(rows: list[dict[str, Any]], lo: int, hi: int,
             field: str = "steady_ops_s") -> float | None:
    """The growth exponent of the steady operations a second (``field``: as counted, or as the
    model says) from ``lo`` to ``hi`` ranks."""
    by = {r["ranks"]: r[field] for r in rows}
    if lo not in by or hi not in by or by[lo] <= 0:
        return None
    return math.log(by[hi] / by[lo]) / math.log(hi / lo)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="8,64,512,2048,8000",
                        help="simulated ranks, comma-separated (8,64,512,2048,8000)")
    parser.add_argument("--ranks-per-node", type=int, default=8, help="ranks per node (8)")
    parser.add_argument("--steady-s", type=float, default=6.0,
                        help="seconds of steady state measured (6)")
    parser.add_argument("--hang-timeout", type=float, default=10.0,
                        help="the job's --hang-timeout (10): the hang's deadline, and the "
                             "agreement's bound")
    parser.add_argument("--budget-s", type=float, default=60.0,
                        help="seconds a phase may take before the run stops at its size (60)")
    parser.add_argument("--capacity-s", type=float, default=3.0,
                        help="seconds the store's capacity is measured for (3)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("--readme-section", default=None, metavar="NAME",
                        help="write the table between the <!-- NAME:begin --> and "
                             "<!-- NAME:end --> markers of the README or the docs/ page that "
                             "has them")
    args = parser.parse_args(argv)
    if args.readme_section and markers.holder(args.readme_section) is None:
        parser.error(f"neither README.md nor docs/ has a {markers.markers(args.readme_section)[0]} "
                     "marker")
    try:
        sizes = sorted({int(s) for s in args.sizes.split(",")})
    except ValueError:
        parser.error(f"--sizes must be whole numbers, comma-separated: {args.sizes!r}")
    if not sizes or sizes[0] < 1 or args.ranks_per_node < 1:
        parser.error("--sizes and --ranks-per-node must be positive")

    port = free_port()
    server = serve(port)
    try:
        cap = capacity(port, CAPACITY_CLIENTS, args.capacity_s)
    finally:
        stop_serving(server)
    print(f"scale: the store answers {cap:,.0f} operations a second here "
          f"({CAPACITY_CLIENTS} clients)")
    rows, stopped = [], None
    for ranks in sizes:
        print(f"scale: {ranks} ranks ...", flush=True)
        row = measure(ranks, args.ranks_per_node, args.steady_s, args.hang_timeout,
                      args.budget_s, cap)
        row["targets"] = targets(row, args.hang_timeout, cap)
        rows.append(row)
        reasons = why_stopped(row, args.budget_s)
        if reasons:
            stopped = f"stopped at {ranks} ranks: " + "; ".join(reasons)
            break
    growth, modelled = exponent(rows, 64, 8000), exponent(rows, 64, 8000, "model_ops_s")
    summary = [table(rows, cap)]
    if growth is not None:
        summary.append(f"Growth exponent of the store's operations a second, 64 → 8000 ranks: "
                       f"{growth:.2f} as counted, {modelled:.2f} as the model says (where the "
                       "count fell short of the model, the machine drove less than the job asks).")
    summary.append(verdicts(rows, args.hang_timeout))
    if stopped:
        summary.append(f"The run {stopped}.")
    summary.append(f"On {os.cpu_count()} cores; `make scale`.")
    print("\n".join(summary))
    if args.readme_section:
        markers.rewrite(args.readme_section, "\n\n".join(summary))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"capacity_ops_s": cap, "rows": rows,
                                         "exponent_64_8000": growth,
                                         "model_exponent_64_8000": modelled, "stopped": stopped,
                                         "hang_timeout_s": args.hang_timeout,
                                         "cpu_count": os.cpu_count()}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
