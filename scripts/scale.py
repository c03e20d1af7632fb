#!/usr/bin/env python3
"""Coordination at scale: the job's traffic to its one store, simulated up to 1,000 nodes × 8.

    scripts/scale.py [--sizes 8,64,512,2048,8000] [--ranks-per-node 8] [--steady-s 6]
                     [--hang-timeout 10] [--budget-s 60] [--json bench/scale.json]

Everything that keeps a job together runs through one TCPStore (the rendezvous store), served by one event loop.
This runs that traffic without training: one real TCPStore (torch's, in a process of its own,
as ``elastic-mnist rendezvous`` serves it) and simulated nodes, spread over a few processes,
each node on connections of its own speaking for its ranks with the job's own code:

- every rank's heartbeat is a real :class:`Watchdog`'s ``_publish`` (once a second); through a
  hang, the two probers read every heartbeat twice (``_table``, two beats apart) and declare
  (``_claim``, then ``declare_fault``, which wakes every rank), and every other rank looks for
  their verdict (``_probers_verdict``) until it is woken (its recovery closes its watchdog);
- every rank raises its pulse on its node's real board (board.py, a file per simulated node),
  whose speaker writes the node's record every ``PULSE_S``;
- each node's agent asks ``Roster.waiting`` every ``--monitor-interval`` (0.5 s, as jobs/
  launch it) and, every ``look_interval`` (twice per keep-alive interval, less often beyond 40
  agents), judges the job's agents with ``Liveness.dead`` (the body of
  ``AgentsHandler.num_nodes_waiting``, less its read of the job's record); it keeps alive with
  ``Roster.keep_alive``;
- rank 0 beats for the job (``Roster.beat``, every admissions poll); each node's local rank 0
  asks the fence (``CurrentGeneration.dropped``) every lease beat.

A simulating process makes its nodes' periodic traffic in one thread (:func:`steady`), and
their agreement in a few (``AGREEING``): a thread per node, a thousand of them waking for 2
cores and for their processes' Python locks, was most of what this machine spent.

Phases, for each size: a steady state (``--steady-s``); a hang (from two beats before the
deadline, as when the job stops stepping: the probers declare one rank hung); a lost node (its
pulses stop; the watchers declare the fault with ``declare_fault``). After each fault the
survivors agree as recovery.py's do: the watchers declare too and confirm that every rank was
woken; every node's first rank reads the fault, and its siblings take it from the board
(``Relay.fault``); each node's relay checks its siblings in at once (``Relay.check_in``), the
watchers and backups each by itself; the watchers (who read the identities as the generation
began) read the check-ins and the pulses and close the membership with ``close_membership``,
deciding from the members' positions (the record names the nodes' sizes, from which each
survivor finds its place); each relay and backup waits for the record and reads it, and the
relays' siblings take it from the board (``Relay.record``). After the hang nobody's silence is
waited for (the hung rank is named); after the lost node, its pulses' standing still. Not
simulated: the new group's creation (gloo's own rendezvous on the store, W reads per survivor:
docs/recovery.md). It prints a table (store operations and bytes a second, per rank, the
busiest second, the time to a hang verdict, the time to an agreed membership) and writes it as
JSON, with the store's own load per phase (its process's share of one core, and the round trip
of a client that asks nothing else), where the agreement's time went (its milestones), and
what the busiest second of the fault was made of. The store's capacity is measured first, on
the same machine.

A phase in which the simulated ranks and the store kept ``SATURATED`` of the machine's cores
busy is not held here: its times are the wait for the cores (a job's rank has its own), its
targets judged one way only (scale_report.targets), and the run stops at that size, saying
so; as it does at a phase that does not finish within ``--budget-s``: the machine (its cores
drive every simulated client) or the design (its operations grow faster than its ranks)
cannot hold it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import heapq
import json
import math
import multiprocessing as mp
import os
import resource
import shutil
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
from scale_report import MILESTONES, exponent, not_held, table, targets, verdicts, why_stopped
from store_load import (
    CAPACITY_CLIENTS,
    OPS,
    Counting,
    StoreGauge,
    capacity,
    serve,
    stop_serving,
)
from torch.distributed import PrefixStore, TCPStore

from elastic_mnist.env import DistEnv
from elastic_mnist.errors import first_line
from elastic_mnist.resilience.agreement import (
    PULSE_S,
    Fault,
    Identity,
    Pulses,
    close_membership,
    decide_membership,
    declare_fault,
    pulse_key,
    read_present,
    watchers,
)
from elastic_mnist.resilience.board import NodeBoard
from elastic_mnist.resilience.current import CurrentGeneration
from elastic_mnist.resilience.relay import Relay, by_themselves, relay_of
from elastic_mnist.resilience.roster import Liveness, Roster, look_interval
from elastic_mnist.resilience.watchdog import (
    BEAT_S,
    PROBE_BEATS,
    StoreSilent,
    Watchdog,
    probers,
)

REPO = Path(__file__).resolve().parents[1]
LAUNCH = "elastic_mnist/sim/launch"
"""The workers' prefix in the store (``elastic_mnist/<run id>/<launch>``, job.py)."""
PROCESSES = 32
"""Simulating processes: their threads share the machine's cores with the store. Many, for
Python's lock: a thread waits for it after every store call, behind the other threads of its
process (with 4 processes at 8,000 ranks, a hang's verdict reached the last rank 16 s late,
and a membership closed 10 s late, with the store a fifth busy): ranks of real nodes share no
such lock."""
SIMULATION_NICE = 10
"""The simulating processes' niceness: the store's process (and the gauge's) go first on the
machine's shared cores, as the store's host's own cores serve it in a job, so that the store's
times are its own work's, not a wait for the cores."""
CONNECTING = 32
"""Nodes a simulating process opens its connections for at once, as it starts."""
MONITOR_S = 0.5
"""The agent asks ``num_nodes_waiting`` every ``--monitor-interval``: 0.5 s as jobs/ launch it
(torch's default, 0.1 s, asks five times as often: 10 N operations a second)."""
KEEP_ALIVE_S = 5.0
"""torch's default ``keep_alive_interval``, also what our agent uses."""
LEASE_BEAT_S = 3.0
"""A node's lease keeper asks the fence every ``--lease-timeout`` / 5 (15 s by default)."""
ADMISSIONS_S = 0.5
"""Rank 0's admissions poll: a beat of the job each time."""


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


@functools.cache
def alone_in(world: int) -> set[int]:
    """The ranks of a generation of ``world`` that agree by themselves (relay.py)."""
    return by_themselves(set(range(world)))


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
        self.relays = {r: Relay(self.boards[r - ranks.start]) for r in ranks}
        """Each rank's side of the board in an agreement (relay.py)."""
        self.envs = {r: DistEnv(rank=r, world_size=world, local_rank=r - ranks.start,
                                local_world_size=len(ranks)) for r in ranks}
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
        self.milestones: dict[str, float] = {}
        """When the node's agreement passed each of its milestones (the latest, for its
        watchers'): where an agreement's time goes."""

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

    def periods(self) -> dict[str, float]:
        """The node's periodic duties (:meth:`_periodic`), and how often each is due."""
        agents = math.ceil(self.world / len(self.ranks))
        return {"pulse": PULSE_S, "beat": BEAT_S, "monitor": MONITOR_S,
                "look": look_interval(KEEP_ALIVE_S, agents), "keep_alive": KEEP_ALIVE_S,
                "fence": LEASE_BEAT_S, "admissions": ADMISSIONS_S}

    @property
    def phase(self) -> float:
        """Where in each period the node's duties fall: nodes' clocks are not in step, and
        their duties are spread evenly (a look every minute at 1,000 nodes is still counted in
        a few seconds' window at its rate)."""
        return (self.serial * 0.6180339887) % 1

    def _periodic(self, name: str, job_agents: list[int]) -> None:
        """One periodic duty of the node (:func:`steady`)."""
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

    def arm(self) -> list[int]:
        """Every rank's watchdog two beats before its deadline (no step since), the probe due:
        the node's probers."""
        lead = PROBE_BEATS * BEAT_S
        for dog in self.watchdogs.values():
            dog.last_progress = time.monotonic() - (dog.deadline_s() - lead)
            dog.prober_beats = None
        return [r for r in self.ranks if r in probers(self.world)]

    def probe(self, rank: int, fault: Fault) -> bool:
        """The prober ``rank`` reads every heartbeat twice, two beats apart, and declares:
        the watchdog's verdict (``_claim``), then the fault to the membership (``declare_fault``:
        the first wakes every rank). False if the store did not answer it within its 2 s."""
        dog = self.watchdogs[rank]
        tables = [dog._table()]
        time.sleep(PROBE_BEATS * BEAT_S)
        tables.append(dog._table())
        if None in tables:
            self.errors["a prober's table: the store did not answer within 2 s"] += 1
            return False
        try:
            dog._claim({"rank": fault.suspects[0], "ranks": fault.suspects, "reported_by": rank,
                        "last_step": 0, "reason": "simulated"})
            declare_fault(self.agreeing, "g0/", self.world, json.dumps(
                dataclasses.asdict(dataclasses.replace(fault, reported_by=rank))))
        except (RuntimeError, StoreSilent) as e:  # the store answered too late
            self.errors[first_line(e)[:100] or "a prober's claim: the store went silent"] += 1
            return False
        return True

    def follow(self, waiting: set[int], fault: Fault) -> bool:
        """One beat's look of the node's ``waiting`` ranks, past their deadline, for the
        probers' verdict (``_probers_verdict``), until the declaration wakes them (their
        recovery then closes their watchdog): one that finds it first declares to the membership
        itself, as ``_follow`` does, and no longer waits. False where one would probe itself
        (the probers stood still, or the store did not answer within 2 s)."""
        for r in sorted(waiting):
            found = self.watchdogs[r]._probers_verdict()
            if found == "probe":
                self.errors["a follower would probe: the probers stood still, or the store did "
                            "not answer within 2 s"] += 1
                return False
            if found != "wait":
                declare_fault(self.agreeing, "g0/", self.world, json.dumps(
                    dataclasses.asdict(dataclasses.replace(fault, reported_by=r))))
                waiting.discard(r)
        return True

    def woken(self, fault: Fault, generation: int) -> bool:
        """The node's ranks woken by ``fault``'s declaration in ``generation`` (its prefix
        ``g<generation>/``), as Membership's are: the watchers declare too and confirm that
        every rank was woken (the first to declare wakes them all); every other rank's watcher
        has the fault, read by the node's first rank and taken from the board by the others
        (relay.py). False if a store call failed."""
        prefix = f"g{generation}/"
        try:
            for r in sorted(self.watching & set(self.ranks)):
                declare_fault(self.agreeing, prefix, self.world, json.dumps(
                    dataclasses.asdict(dataclasses.replace(fault, reported_by=r))))
            reading = alone_in(self.world)  # as Membership._reads_the_fault says
            for r in self.ranks:
                if r not in fault.suspects:
                    self.relays[r].fault(generation, r, r == self.ranks.start or r in reading,
                                         lambda: self.agreeing.get(f"{prefix}fault"))
        except RuntimeError as e:
            self.errors[first_line(e)[:100]] += 1
            return False
        return True

    def check_in(self, generation: int, expected: set[int]) -> bool:
        """The node's survivors check in, as recovery.py's do: each posts where it stood on the
        board and the node's relay checks them in at once, or, for the ranks that agree by
        themselves (the watchers, the backups), each by itself. False if a store call failed."""
        position = json.dumps({"step": 1, "mid_step": False, "evaluated_step": 0})
        mine = [r for r in self.ranks if r in expected]
        relays = {r: relay_of(self.envs[r], expected, self.relays[r].alone(generation, expected))
                  for r in mine}
        try:
            for r in mine:  # side by side in a job: here, each posts before its relay looks
                if relays[r] not in (None, r):
                    self.relays[r].post(generation, r, position=position)
            # The relay, then the others (each finds itself named at once).
            for r in sorted(mine, key=lambda r: relays[r] != r):
                self.relays[r].check_in(self.agreeing, f"g{generation}/", self.envs[r],
                                        generation, position, expected)
        except RuntimeError as e:
            self.errors[first_line(e)[:100]] += 1
            return False
        self._milestone("checked in")
        return True

    def waiting(self, generation: int, expected: set[int], chosen: list[int]
                ) -> tuple[list[int], list[int]]:
        """The node's survivors that wait for the watchers' record (the watchers close it, in
        threads of their own: :meth:`watch`): those that read it from the store (the relay,
        the backups), and those that take it from the board. ``chosen``: the watchers."""
        ranks = [r for r in self.ranks if r in expected and r not in chosen]
        reading = [r for r in ranks if relay_of(
            self.envs[r], expected, self.relays[r].alone(generation, expected)) in (None, r)]
        return reading, [r for r in ranks if r not in reading]

    def wait_for_record(self, fault: Fault, generation: int, expected: set[int],
                        limit_s: float, ranks: list[int]) -> float | None:
        """``ranks`` wait for the membership's record, as recovery.py's do (a relay reads it and
        posts it, its siblings take it from the board), in turn: when the first has it (None: a
        store call failed)."""
        woken = None
        try:
            for r in ranks:
                self.relays[r].record(self.envs[r], generation, expected, limit_s, lambda r=r: (
                    close_membership(self.agreeing, f"g{generation}/", expected, fault.suspects,
                                     Pulses(self.agreeing, {}, self.pulse_key(r)), limit_s,
                                     rank=r)))
                woken = woken or time.time()
        except RuntimeError as e:
            self.errors[first_line(e)[:100]] += 1
            return None
        return woken or time.time()

    def watcher(self, port: int, counts: Counter, lock: threading.Lock
                ) -> tuple[Counting, dict[int, Identity]]:
        """A watcher's connection of its own, and every rank's identity (where its pulse is),
        read on it as the generation began (Membership._read_identities), before any fault."""
        store = Counting(PrefixStore(LAUNCH, TCPStore("127.0.0.1", port, is_master=False,
                                                      timeout=timedelta(seconds=300))),
                         counts, lock, LAUNCH)
        found = read_present(store, [f"g0/id/{r}" for r in range(self.world)])
        return store, {r: Identity(**json.loads(found[f"g0/id/{r}"])) for r in range(self.world)}

    def watch(self, rank: int, fault: Fault, generation: int, limit_s: float, store: Counting,
              identities: dict[int, Identity]) -> float | None:
        """A watcher's agreement (on its own connection, with the identities it read ahead:
        :meth:`watcher`): it reads the check-ins and the pulses, closes the membership and
        decides, reading the members' positions once."""
        world = self.world
        keys = {r: pulse_key(identity) for r, identity in identities.items()}
        milestone = self._milestone

        class Timed(Pulses):
            def silent(self) -> set[int]:
                found = super().silent()
                if found:
                    milestone("silence seen")
                return found

        def decide(members: list[int], positions: dict[int, str]) -> dict[str, Any]:
            """recovery.py's decision."""
            return decide_membership(members, positions, identities, fault, world)

        try:
            close_membership(store, f"g{generation}/", set(range(world)) - set(fault.suspects),
                             fault.suspects, Timed(store, keys, self.pulse_key(rank)), limit_s,
                             rank=rank, decide=decide)
        except RuntimeError as e:
            self.errors[first_line(e)[:100]] += 1
            return None
        self._milestone("closed")
        return time.time()

    def _milestone(self, name: str) -> None:
        """Marks ``name`` passed now, where it was not yet."""
        self.milestones.setdefault(name, time.time())


SETTLE_S = 2.0
"""The steady traffic alone between the hang's end and the lost node: the two faults' busiest
seconds are each their own (back to back, the lost node's check-ins fell in the hang's last
second)."""
AGREEING = 4
"""Threads of a simulating process that make its survivors' agreement, each for a share of its
nodes in turn: a thread per node (1,000 at 8,000 ranks) spent this machine's cores on waking
for them and for its process's lock, and the survivors checked in 8 s after the fault."""
BATCH_S = 0.005
"""Duties due within this of the next one are done with it: a process's thread wakes at most
every few milliseconds, not once per duty."""


def steady(nodes: list[Node], until: float, stop: threading.Event) -> None:
    """The periodic traffic of ``nodes`` until ``until`` (or ``stop``; a node lost falls
    silent), in one thread: a thread per node woke 20 times a second each, and 1,000 threads
    waking for the cores and each process's lock took more of this machine than the store's
    traffic (at 8,000 ranks, 60% of 2 cores, steady). Only sets are made without an answer
    (the pulses, the heartbeats): a duty that waits for one is a round trip, a few a second
    per node."""
    start = time.time()  # the plan's clock: every simulating process shares it
    due: list[tuple[float, int, str]] = []
    periods = [node.periods() for node in nodes]
    for i, node in enumerate(nodes):
        for name, period in periods[i].items():
            heapq.heappush(due, (start + node.phase * period, i, name))
    agents = [list(range(1, math.ceil(node.world / len(node.ranks)) + 1)) for node in nodes]
    while due and not stop.is_set():
        wait = due[0][0] - time.time()
        if wait > 0 and stop.wait(min(wait, until - time.time())):
            return
        now = time.time()
        if now >= until:
            return
        while due and due[0][0] <= now + BATCH_S:
            when, i, name = heapq.heappop(due)
            node = nodes[i]
            if node.stopped.is_set():
                continue
            # As the job's loops do (a sleep between two beats), a duty this machine's cores
            # made late is done once, not once per period missed: catching up would write a
            # burst no job writes (62,000 sets in a second at 8,000 ranks, from starved
            # threads).
            period = periods[i][name]
            heapq.heappush(due, (max(when + period, time.time() + period / 2), i, name))
            try:
                node._periodic(name, agents[i])
            except RuntimeError as e:  # DistStoreError: the store answered too late
                node.errors[first_line(e)[:100]] += 1


def hung_rank(world: int) -> int:
    """The rank that hangs: a third of the way in, neither a prober nor a watcher (so that the
    probers judge, and the watchers close, as in a job where any other rank hangs)."""
    return min(world // 3 + 1, world - 2) if world > 2 else world - 1


def hang(nodes: list[Node], fault: Fault, woken: threading.Event, stop: threading.Event
         ) -> list[float | None] | None:
    """Every rank of ``nodes`` through a hang, from two beats before its deadline: each
    prober in a thread of its own (:meth:`Node.probe`: it declares ``fault``), and every other
    rank, from the deadline, looking for the verdict every beat, in this one
    (:meth:`Node.follow`; the heartbeats, made by :func:`steady`, go on), until the declaration
    wakes it (``woken``: its recovery closes its watchdog). When each prober here declared
    (None for one whose store did not answer within its 2 s; None for all: stopped first, past
    the phase's budget, or a follower would have probed itself)."""
    chosen = {node.serial: node.arm() for node in nodes}
    probed: list[float | None] = []

    def probe(node: Node, rank: int) -> None:
        probed.append(time.time() if node.probe(rank, fault) else None)

    probing = [threading.Thread(target=probe, args=(node, r), daemon=True)
               for node in nodes for r in chosen[node.serial]]
    for t in probing:
        t.start()
    waiting = {node.serial: set(node.ranks) - set(chosen[node.serial]) - set(fault.suspects)
               for node in nodes}
    failed = False
    while not woken.is_set() and not stop.is_set() and not failed:
        failed = not all(node.follow(waiting[node.serial], fault) for node in nodes
                         if waiting[node.serial])
        if not failed:
            woken.wait(BEAT_S)
    for t in probing:
        t.join()
    return None if failed or stop.is_set() and not woken.is_set() else probed


def agree(nodes: list[Node], fault: Fault, generation: int, plan: dict,
          ahead: dict[int, tuple[Counting, dict[int, Identity]]], deadline: float
          ) -> float | None:
    """The survivors among ``nodes`` woken by ``fault`` in ``generation`` agree on who is
    left, as recovery.py's do: in a few threads (``AGREEING``) the nodes are woken, check in
    and wait for the record; each watcher (its connection and identities read ahead, in
    ``ahead``) in a thread of its own reads the check-ins and the pulses and closes the
    membership. When the last survivor of these nodes has the record (-inf: none here; None: a
    store call failed, or the budget ran out)."""
    expected = set(range(nodes[0].world)) - set(fault.suspects) if nodes else set()
    chosen = watchers(expected)
    survivors = [n for n in nodes if not n.stopped.is_set()]
    groups = [survivors[i::AGREEING] for i in range(min(AGREEING, len(survivors)))]
    agreed: list[float | None] = []

    def agreeing(group: list[Node]) -> None:
        """``group``'s survivors are woken, check in, then wait for the record: the ranks that
        read it from the store first (in a job a node's ranks wait side by side, woken
        together, so that the first one's time stands for its node's), then the others."""
        ok = [node.woken(fault, generation) and node.check_in(generation, expected)
              for node in group]
        waiting = [node.waiting(generation, expected, chosen) for node in group]
        firsts = [node.wait_for_record(fault, generation, expected, plan["limit_s"], reading)
                  if fine else None for node, fine, (reading, _) in zip(group, ok, waiting)]
        rests = [node.wait_for_record(fault, generation, expected, plan["limit_s"], taking)
                 if fine else None for node, fine, (_, taking) in zip(group, ok, waiting)]
        agreed.extend(None if rest is None else first for first, rest in zip(firsts, rests))

    def watch(node: Node, rank: int) -> None:
        agreed.append(node.watch(rank, fault, generation, plan["limit_s"], *ahead[rank]))

    threads = [threading.Thread(target=agreeing, args=(group,), daemon=True) for group in groups]
    threads += [threading.Thread(target=watch, args=(node, r), daemon=True)
                for node in survivors for r in node.ranks if r in chosen]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.time()))
    expected_results = len(survivors) + sum(r in chosen for n in survivors for r in n.ranks)
    if len(agreed) != expected_results or None in agreed:
        return None
    return max(agreed, default=-math.inf)


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
    # Where this process learns that a fault was declared: one wait for all of its nodes (in
    # a job, each rank's watcher waits on its own key from its generation's start).
    waker = Counting(PrefixStore(LAUNCH, TCPStore("127.0.0.1", port, is_master=False,
                                                  timeout=timedelta(seconds=300))),
                     counts, lock, LAUNCH)
    # The watchers' connections and identities, read as the generation began (once every
    # simulating process has said who its ranks are).
    barrier.wait()
    ahead = {r: node.watcher(port, counts, lock) for node in nodes for r in node.ranks
             if r in set(plan["watchers"])}
    result: dict[str, Any] = {"milestones": {}}
    stop = threading.Event()

    def steady_until(t: float) -> list[threading.Thread]:
        thread = threading.Thread(target=steady, args=(nodes, t, stop), daemon=True)
        thread.start()
        return [thread]

    def woken_by(generation: int, deadline: float) -> threading.Event:
        """Set once the first declarer of ``generation`` has woken every rank."""
        woken = threading.Event()

        def wait() -> None:
            with contextlib.suppress(RuntimeError):  # past the budget: the phase says so
                waker.set_timeout(timedelta(seconds=max(0.1, deadline - time.time())))
                waker.wait([f"g{generation}/woken"])
                woken.set()

        threading.Thread(target=wait, daemon=True).start()
        return woken

    def milestones(phase: str) -> None:
        for node in nodes:
            for name, when in node.milestones.items():
                result["milestones"].setdefault(phase, {}).setdefault(name, []).append(when)
            node.milestones = {}

    # Steady state.
    barrier.wait()
    result["steady_from"] = time.time()
    result["cpu"] = {"steady_from": time.process_time()}
    for t in steady_until(result["steady_from"] + plan["steady_s"]):
        t.join()
    result["steady_to"] = time.time()
    # A hang: the watchdogs probe while the heartbeats and pulses go on; the probers declare
    # it, and the survivors agree on going on without the hung rank.
    barrier.wait()
    result["hang_from"] = time.time()
    result["cpu"]["hang_from"] = time.process_time()
    deadline = result["hang_from"] + plan["budget_s"]
    background = steady_until(deadline)
    fault = Fault("hung", [plan["hung"]], 0, "simulated", 0.0)
    woken = woken_by(0, deadline)
    probed: list[list[float | None] | None] = []
    thread = threading.Thread(target=lambda: probed.append(hang(nodes, fault, woken, stop)),
                              daemon=True)
    thread.start()
    woken.wait(max(0.0, deadline - time.time()))
    result["hang_agreed"] = agree(nodes, fault, 0, plan, ahead, deadline) if woken.is_set() \
        else None
    thread.join(max(0.0, deadline - time.time()))
    if not thread.is_alive() and result["hang_agreed"] is not None:
        time.sleep(SETTLE_S)  # the steady traffic alone for a while: each fault's busiest
    stop.set()                # second its own, not the next one's first
    thread.join()
    result["probed"] = probed[0] if probed else None
    for t in background:
        t.join()
    milestones("hang")
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
    for node in nodes:
        if node.serial == plan["lost_node"]:
            node.stopped.set()
    background = steady_until(deadline)
    # The lost node's neighbours find it themselves (their collectives fail); a watcher
    # declares it here, and wakes every rank.
    fault = Fault("died", [], 0, "simulated", 0.0)
    result["agreed"] = agree(nodes, fault, 1, plan, ahead, deadline)
    stop.set()
    for t in background:
        t.join()
    result["end"] = time.time()
    result["cpu"]["end"] = time.process_time()
    milestones("lost node")
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
        # One node: nobody to go on.
        lost = nodes[-1][0] if len(nodes) > 1 else None
        hung, everyone = hung_rank(ranks), set(range(ranks))
        plan = {"steady_s": steady_s, "budget_s": budget_s, "lost_node": lost,
                "nodes": nodes, "limit_s": hang_timeout, "hang_timeout": hang_timeout,
                "hung": hung,
                # The watchers of the hang's agreement (every rank but the hung one) and of
                # the lost node's (every rank: the lost ones are found by their silence).
                "watchers": sorted(set(watchers(everyone - {hung})) | set(watchers(everyone)))}
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
    first_fault = int(min(r["hang_from"] for r in results))
    busiest = first_fault + max(range(len(fault)), key=fault.__getitem__) if fault else None
    probed = [r["probed"] for r in results]
    agreed = [r.get("agreed") for r in results]
    hang_agreed = [r.get("hang_agreed") for r in results]
    # The verdict is the first prober's declaration: it wakes every rank (a prober whose store
    # did not answer in time leaves it to the other, as in the job).
    declared = None if None in probed else min(
        (t for found in probed for t in found if t is not None), default=None)

    def milestones(phase: str, since: float) -> dict[str, float]:
        """Where an agreement's time went, in seconds since ``since``: the last survivor
        checked in, the first watcher saw the lost node's silence, closed the membership."""
        found = [r["milestones"].get(phase, {}) for r in results]
        return {name: pick(t for f in found for t in f.get(name, [])) - since
                for name, pick in MILESTONES.items() if any(name in f for f in found)}

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
    cores = os.cpu_count() or 1
    return {
        "ranks": ranks, "nodes": len(nodes), "ranks_per_node": per_node,
        "model_ops_s": demanded, "driven": ops_s / demanded,
        "steady_ops_s": ops_s, "steady_ops_s_per_rank": ops_s / ranks,
        "steady_bytes_s": sum(steady_bytes) / max(len(steady_bytes), 1),
        "busiest_second_steady": max(steady, default=0),
        "busiest_second_fault": max(fault, default=0),
        "busiest_fraction_of_capacity": max([*steady, *fault], default=0) / cap,
        # What the busiest second of the fault was made of, and when it was (from the phase of
        # the lost node: where it was in the hang, negative).
        "busiest_second_fault_ops": {} if busiest is None else {
            op: counts[(op, busiest)] for op in OPS if counts[(op, busiest)]},
        "busiest_second_fault_at_s": None if busiest is None else busiest - when("lost_from"),
        "busiest_second_fault_phase": None if busiest is None
        else "hang" if busiest < int(when("lost_from")) else "lost node",
        # The probe starts two beats before the deadline (Watchdog._probe_due): the verdict is
        # at the deadline, or when the slowest probe has read its second table, if later.
        "hang_verdict_s": None if declared is None else max(
            hang_timeout, hang_timeout - PROBE_BEATS * BEAT_S + declared - when("hang_from")),
        # From the verdict's declaration to the last survivor's record of who is left (all
        # but the hung rank: nobody's silence is waited for).
        "hang_agreed_s": None if declared is None or None in hang_agreed
        else max(hang_agreed) - declared,
        "agreed_s": None if lost is None or None in agreed else max(agreed) - when("lost_from"),
        # Where the agreement's time went: the last survivor checked in, the first watcher
        # read the identities, saw the lost node's silence, closed the membership.
        "agreement_milestones_s": milestones("lost node", when("lost_from")),
        "hang_agreement_milestones_s": {} if declared is None else milestones("hang", declared),
        "store_errors": dict(sum((Counter(r["errors"]) for r in results), Counter())),
        "simulation_cpu_share": (simulated := {name: busy(*keys)
                                               for name, keys in phases.items()}),
        "store_cpu_share": (served := {name: gauge.cpu_share(*span(*keys))
                                       for name, keys in phases.items()}),
        # The share of this machine's cores the simulated ranks and the store used together.
        "machine_busy": {name: (simulated[name] * cores + (served[name] or 0)) / cores
                         for name in phases},
        "store_round_trip_ms": {name: gauge.round_trip_ms(*span(*keys))
                                for name, keys in phases.items()},
    }


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
        row["not_held"] = not_held(row)
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
