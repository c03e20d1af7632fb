"""Nodes that join a job as it trains: rank 0 publishes the job in the rendezvous records, notices
the joins whose workers are all ready, and decides which of them the next generation admits; a
joining worker says it is ready and waits for its admission (notes/rdzv-spec.md).

Rank 0's side is a thread that every member runs (rank 0 moves with the changes) and that works
on rank 0 only: every ``POLL_S`` it beats ``job/beat``, publishes ``job`` when the generation
changed, and looks for joins whose workers all wrote ``ready``. For those it writes the decision,
``g<G>/grow`` in the launch's store (the new members: the old ranks in their order, which keep
their ranks, then the joiners, node by node, named; and the nodes' sizes), *before* the
training thread raises the admission flag in a step's one collective: the flag costs the loop
no store call, and every rank reads one decision once the step is done. The job's ranks then move to generation G+1 with the joiners (membership.py,
recovery.py), rank 0 having written each join's ``admitted`` record, which its workers wait for.

The keys that the workers alone read live in the launch's prefix (the membership's store), under
``join/<round>/<j>/``: ``id/<local rank>`` (a joining worker's identity, written before it says it
is ready), ``admitted`` (``{"launch", "generation", "decided_in", "step", "evaluated_step"}``),
``data`` (the node's prepared data, joiner.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from elastic_mnist.distributed import backend_for
from elastic_mnist.env import OUR_BACKEND
from elastic_mnist.errors import first_line
from elastic_mnist.resilience.agreement import PULSE_S, UNKNOWN, Change, Identity, node_sizes
from elastic_mnist.resilience.faces import Member
from elastic_mnist.resilience.flapping import Flapping
from elastic_mnist.resilience.reach import Listener, data_address, unreachable
from elastic_mnist.resilience.roster import JobRecord, Roster

log = logging.getLogger(__name__)

POLL_S = 0.5
"""How often rank 0 beats, and looks for joins whose workers are all ready."""
POLL_PENDING_S = 0.1
"""How often rank 0 looks while a join waits for its workers: its admission follows sooner."""
ADMITTED_S = 0.05
"""How often a joining worker that waits for its admission looks for it (the job's ranks wait
for it meanwhile)."""
CHECK_S = 0.5
"""How often it looks at the job and its beat."""


def join_key(round_: int, join: int, name: str) -> str:
    """Where, in the launch's store, the workers keep ``name`` of join ``join`` of ``round_``."""
    return f"join/{round_}/{join}/{name}"


class Admissions:
    """The rendezvous records as one member of the job reads and writes them (rank 0 publishes,
    beats and decides; a joining worker says it is ready and waits to be admitted)."""

    def __init__(self, member: Member, records: Roster, run_id: str, round_: int):
        """``records``: on a connection of this process's own; ``run_id``: the training run's,
        published for joiners; ``round_``: the rendezvous round whose joins are this job's."""
        self.member, self.records, self.run_id, self.round = member, records, run_id, round_
        self._decided: tuple[int, dict[str, Any]] | None = None
        """The generation a decision was made in, and the decision."""
        self._admitted: set[int] = set()
        """Joins of the round known to be admitted (their ``admitted`` records say so)."""
        self._members: tuple[int, dict[int, Identity]] | None = None
        """The identities of a generation's ranks, once all of them are known."""
        self._published: int | None = None
        self._pending = False
        """A join of the round waited for its workers at the last look."""
        self._failing = ""
        self._unreached: set[int] = set()
        """Joins ready but not reached on the data network, said once."""
        self._listener: Listener | None = None
        """A joining node's first worker's, while it waits to be admitted."""
        self.flapping = Flapping()
        """Nodes admitted again and again, and lost each time, are kept out a while."""
        self._stop = threading.Event()
        self._lock = threading.Lock()
        """Held while the job is published or decided on, and as it is closed."""
        self._thread = threading.Thread(target=self._run, daemon=True, name="membership-joins")
        self._thread.start()

    # --- rank 0 ---------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(POLL_PENDING_S if self._pending else POLL_S):
            m = self.member
            if m.joining or m.env.rank != 0:
                continue
            try:
                with self._lock:
                    if self._stop.is_set():
                        return
                    if self._moved_on():
                        continue
                    self.records.beat()
                    generation, identities = self._identities()
                    if identities is None:
                        continue
                    if self._published != generation:
                        self.records.publish_job(self._job(generation, identities))
                        self._published = generation
                    self._maybe_decide(generation, identities)
                self._failing = ""
            except RuntimeError as e:  # DistStoreError: the store stalls or went
                if not self._failing:
                    log.warning("the rendezvous records do not answer (%s): no node joins until "
                                "they do", first_line(e))
                self._failing = str(e)

    def _moved_on(self) -> bool:
        """Our rendezvous went on to a later round than this job's: its agents restart it, and
        this rank 0 no longer speaks for the job there (a beat or a record of it would pass for
        the next round's job)."""
        rdzv = self.member.env.rendezvous
        return (rdzv is not None and rdzv.backend == OUR_BACKEND
                and self.records.round() > self.round)

    def _identities(self) -> tuple[int, dict[int, Identity] | None]:
        """The current generation, and its ranks' identities once every rank has said who it
        is (read once per generation)."""
        m = self.member
        generation = m.generation
        if self._members is None or self._members[0] != generation:
            found = m.identities(m.connections.declare)
            if UNKNOWN in found.values() or generation != m.generation:
                return generation, None
            self._members = (generation, found)
        return generation, self._members[1]

    def _job(self, generation: int, identities: dict[int, Identity],
             finished: bool = False) -> JobRecord:
        """The ``job`` record: the round, the launch, the generation, its nodes, its world
        size."""
        return JobRecord(round=self.round, launch=self.member.launch, generation=generation,
                         nodes=nodes(identities), world_size=len(identities), in_process=True,
                         run_id=self.run_id, finished=finished,
                         quiet_s=2 * POLL_S + self.member.bound_s)

    def _maybe_decide(self, generation: int, identities: dict[int, Identity]) -> None:
        """Decides, once per generation, to admit the joins whose workers are all ready."""
        if self._decided is not None and self._decided[0] == generation:
            return
        found = self._ready(nodes(identities))
        self.flapping.ready({(serial, join) for join, serial, _ in found})
        ready = [(join, serial, workers) for join, serial, workers in found
                 if self.flapping.admissible(serial, join)]
        if not ready:
            return
        m, old = self.member, len(identities)
        joiners: list[dict[str, Any]] = []
        joins = []
        for join, serial, workers in ready:
            start = old + len(joiners)
            joins.append({"join": join, "agent": serial,
                          "ranks": list(range(start, start + len(workers)))})
            joiners.extend(workers)
        # Every rank reads the decision: it names the joiners, and the nodes' sizes from which
        # each places itself (the old ranks keep theirs), not every member (W² bytes in all,
        # 12.8 GB at 8,000 ranks).
        everyone = {**identities, **{old + i: Identity(**w) for i, w in enumerate(joiners)}}
        sizes = node_sizes(list(range(len(everyone))), everyone)
        record: dict[str, Any] = {"generation": generation, "old_world_size": old,
                                  "joiners": joiners, "joins": joins, "nodes": sizes}
        if sizes is None:  # one node's ranks not numbered together: never, as torchrun numbers
            record["members"] = [asdict(identities[r]) for r in range(old)] + joiners
        decision = json.dumps(record)
        agreed = m.connections.declare.compare_set(m.key("grow", generation), "", decision)
        if generation == m.generation:
            self._decided = (generation, json.loads(agreed))
            log.info("%d node(s) ready to join: admitting them at the next step boundary",
                     len(joins))

    def _ready(self, members: list[int]) -> list[tuple[int, int, list[dict[str, Any]]]]:
        """(join, agent serial, its workers' identities) for each pending join of the round
        (its agent's latest, of an agent with no rank in the generation of ``members``) whose
        workers are all ready and that no generation admitted yet."""
        store, found, self._pending = self.member.connections.declare, [], False
        for join, serial in self.records.pending_joins(self.round, members, set()):
            if join in self._admitted:
                continue
            if store.check([join_key(self.round, join, "admitted")]):
                self._admitted.add(join)
                continue
            agent = self.records.agent(serial)
            if agent is None or not self.records.ready(self.round, join, agent.nproc):
                self._pending = True
                continue
            if not self._reachable(join):
                self._pending = True
                continue
            workers = store.multi_get([join_key(self.round, join, f"id/{local}")
                                       for local in range(agent.nproc)])
            found.append((join, serial, [json.loads(worker) for worker in workers]))
        return found

    def _reachable(self, join: int) -> bool:
        """Whether rank 0 reaches the joining node on the data network (reach.py), where the
        node said where it listens: a node admitted while its data link is still cut (it
        reaches the store, not its peers) held every rank in the new group's creation until the
        heal (13 s in ``make partitions``' one-way cut)."""
        key = join_key(self.round, join, "reach")
        store = self.member.connections.declare
        if not store.check([key]):
            return True
        source = data_address(backend_for(self.member.device))
        if source is None or not unreachable(source, {join: store.get(key).decode()}):
            self._unreached.discard(join)
            return True
        if join not in self._unreached:
            self._unreached.add(join)
            log.warning("a node ready to join (join %d) does not answer on the data network: "
                        "admitted once it does", join)
        return False

    def due(self) -> bool:
        """Rank 0, in the training thread: a decision of this generation awaits its step."""
        m, decided = self.member, self._decided
        return decided is not None and decided[0] == m.generation and m.env.rank == 0

    def admit(self, decision: dict[str, Any], change: Change) -> None:
        """Rank 0, once the step that raised the flag is done: each join of ``decision`` learns
        that ``change``'s generation admits it (before that generation begins)."""
        if self.member.env.rank != 0:
            return
        record = json.dumps({"launch": self.member.launch, "generation": change.generation,
                             "decided_in": decision["generation"], "step": change.step,
                             "evaluated_step": change.evaluated_step})
        for join in decision["joins"]:
            self.member.store.set(join_key(self.round, join["join"], "admitted"), record)
            self.records.mark_admitted(self.round, join["join"], self.member.launch,
                                       change.generation)  # for the agents
            self._admitted.add(join["join"])
            self.flapping.admitted(join["agent"], join["join"])

    def finish(self) -> None:
        """At the job's end: the thread stops, and rank 0 says the job finished."""
        with self._lock:
            self._stop.set()
            m = self.member
            if m.env.rank != 0 or m.joining:
                return
            try:
                if self._moved_on():
                    return
                identities = m.identities(m.connections.declare)
                self.records.publish_job(self._job(m.generation, identities, finished=True))
            except RuntimeError as e:
                log.warning("could not say in the rendezvous records that the job finished "
                            "(%s)", first_line(e))

    def close(self) -> None:
        self._stop.set()
        if self._listener is not None:
            self._listener.close()

    # --- a joining worker -----------------------------------------------------------------------

    def ready(self, join: int) -> None:
        """This joining worker is built: it says who it is, then that it is ready. Its node's
        first worker also listens on its data address, and says where, for rank 0 to try."""
        m = self.member
        address = data_address(backend_for(m.device)) if m.env.local_rank == 0 else None
        if address is not None:
            with contextlib.suppress(OSError):  # no listener: rank 0 admits it untried
                self._listener = Listener(address)
                m.store.set(join_key(self.round, join, "reach"), self._listener.address)
        m.store.set(join_key(self.round, join, f"id/{m.env.local_rank}"),
                    json.dumps(asdict(m.identity)))
        self.records.mark_ready(self.round, join, m.env.local_rank)

    def watch(self) -> Callable[[], str | None]:
        """Looks at the job for a joining worker that waits (for its admission, or on probation:
        eviction.py), one look a call: ``unadmitted`` when the job finished, ``stopped`` when it
        was restarted as a whole (another launch), or its beat stood still while this worker's
        own pulse moved for the membership's bound (stopped as a whole, or lost: a restart then
        brings this node in with the others); else None."""
        m, connection = self.member, self.member.connections.declare
        beat, moved_at = -1, 0  # the job's beat, and this worker's own pulse when it moved

        def look() -> str | None:
            nonlocal beat, moved_at
            job = self.records.job()
            if job is not None and job.finished:
                return "unadmitted"
            own, now = m.own_pulse(connection), self.records.beats()
            if now != beat:
                beat, moved_at = now, own
            if job is None or job.launch != m.launch or own - moved_at >= m.bound_s / PULSE_S:
                return "stopped"
            return None
        return look

    def wait(self, join: int, stopping: Callable[[], bool]) -> dict[str, Any] | str:
        """The admission of join ``join`` (its ``admitted`` record), or why none will come:
        ``left`` when this worker was asked to stop, else :meth:`watch`'s answer."""
        key, connection = join_key(self.round, join, "admitted"), self.member.connections.declare
        look, looked = self.watch(), -float("inf")
        while not connection.check([key]):
            time.sleep(ADMITTED_S)
            if time.monotonic() - looked < CHECK_S:
                continue
            looked = time.monotonic()
            if stopping():
                return "left"
            why = look()
            if why is not None:
                return why
        if self._listener is not None:  # admitted: its watchdog listens from now on
            self._listener.close()
            self._listener = None
        return json.loads(connection.get(key))

def nodes(identities: dict[int, Identity]) -> list[int]:
    """The nodes of a generation's ranks, in the order of their first ranks, by their agents'
    serials (their pids under torch's c10d rendezvous, which numbers none)."""
    order = dict.fromkeys(identities[rank].node for rank in sorted(identities))
    serials = {identity.node: identity.serial for identity in identities.values()}
    return [serials[node] if serials[node] is not None else node[1] for node in order]
