"""One change, from the fault to the first step after it: the survivors agree on who is left and
build their new group, round after round, within a bound.

1. **Agree on who is left** (:meth:`Recovery.recover`). Each survivor checks in with where it
   stands (its committed step, whether it was in the middle of the next). The membership closes as
   soon as every rank not named in the fault has come, except those whose *pulse* stopped (the dead
   never come; a live rank still busy with its own work, an evaluation, a save, a recompile, is
   waited for), and at the latest after the hang timeout (half the bound); the first survivor to
   close it writes it, and every survivor reads the same list (agreement.py). The watchdog's
   heartbeats cannot tell the gone from the busy: they beat once a second, and stop as the
   survivors recover.
2. **A new group.** Survivors are renumbered in the order of their old ranks (rank 0 stays rank 0
   while it lives) and build a new process group on a fresh prefix of the coordination store: a new
   *generation*. The trainer then takes one agreed state (regroup.py). Every collective of this
   step (the group's creation, the state's broadcast, DDP's checks, the digests) runs in a thread,
   waited on through the membership as the loop's are (:meth:`Recovery.run`), while the waiting
   thread watches the new members' pulses: a member lost or frozen here, or a node the new group
   cannot be built across (reach.py), is declared in the new generation, and the survivors begin
   the next round at once, from the same agreed state, the lost of every round in one change.

If no step completes within ``bound_s`` of the fault's declaration (longer where the store is
away: store_wait.py), this rank leaves (EXIT_GAVE_UP) and torchrun restarts the job from its last
checkpoint; one the survivors went on without (frozen, and woken) leaves as dropped (EXIT_DROPPED).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist

from elastic_mnist.distributed import backend_for, end_process
from elastic_mnist.errors import (
    EXIT_DROPPED,
    EXIT_GAVE_UP,
    CannotRecover,
    CannotTell,
    Dropped,
    PeerFailure,
    first_line,
    first_to_say_dropped,
    wait_for_the_end,
)
from elastic_mnist.resilience.agreement import (
    NO_STATE,
    PULSE_S,
    UNKNOWN,
    Change,
    Identity,
    Position,
    Pulses,
    close_membership,
    decide_membership,
    grown,
    placed_env,
    pulse_key,
    read_present,
    successor_env,
    watchers,
)
from elastic_mnist.resilience.current import dropped_line
from elastic_mnist.resilience.deadline import Deadline
from elastic_mnist.resilience.faces import Member
from elastic_mnist.resilience.findings import Survey, survey
from elastic_mnist.resilience.in_flight import within
from elastic_mnist.resilience.reach import node_listener
from elastic_mnist.resilience.read_once import ReadOnce
from elastic_mnist.resilience.silence import kill_stopped_siblings
from elastic_mnist.resilience.store_wait import StoreWait
from elastic_mnist.resilience.survivors_group import connect_group, install_group

log = logging.getLogger(__name__)

DROPPED_QUESTION_S = 2.0
"""How long a give-up waits to learn whether the job went on without this rank."""


class Recovery:
    """The recovery of one worker's membership: lives as long as it, one change at a time."""

    def __init__(self, member: Member):
        self.member = member
        self.phase = "detecting the fault"
        """Where a recovery stands, to say where it failed."""
        self.failure = ""
        """Why the last round of a recovery failed."""
        self.change: Change | None = None
        """The change being recovered, until the first step after it: a fault meanwhile
        widens it (see :meth:`recover`)."""
        self._origin: list[int] = []
        """For each rank of the current generation, its rank where the change began."""
        self._pulse_keys: dict[int, str | None] = {}
        """The current generation's members' pulse keys, once a recovery has named them."""
        self._survey: Survey | None = None
        """What the nodes found as the round began, where this rank watches (reach.py)."""
        self._announced_in = ""
        """The prefix of the change's first generation: where the nodes said where they listen."""
        self.deadline = Deadline(lambda: member.bound_s, self._give_up)
        """The change's bound (deadline.py), longer where the store is away (store_wait.py)."""
        self.store_wait = StoreWait(lambda: member.store.clone().check(["probe"]))
        self._refilling: threading.Thread | None = None
        """Opens the spare connections a change took, once it is over."""

    def recover(self, position: Position, why: str = "died", suspects: tuple[int, ...] = (),
                detail: str = "") -> Change:
        """Agrees with the other survivors on who is left, and builds their new process group.

        Returns the change: since the last one's first step, if a fault came before it (in
        the recovery itself), so that the lost of every round are in one. Raises Dropped when
        the survivors went on without this rank; CannotRecover when the coordination store does
        not answer (and nothing says they went on without it); PeerFailure when the new group
        lost a member too (the next round follows).
        """
        m = self.member
        detected, detected_at = time.monotonic(), time.time()
        self.deadline.arm()
        self.phase = "agreeing on who is left"
        try:
            fault = m.declare(why, list(suspects), detail)
            m.abort(fault)
            if fault.why == "hung":  # a stopped sibling named hung leaves only when killed
                kill_stopped_siblings(m.identity.agent, lambda: pids_here(m, fault.suspects))
            m.inject(self.phase)
            if self.change is None:  # where the nodes said where they listen (reach.py)
                self._announced_in = m.key("")
            listener = node_listener(m.env.local_rank, backend_for(m.device))
            # For a new group that cannot be built across a cut: on the watchdog's connection,
            # idle in a change (a recovery opens no connection), one survey a round.
            if listener is not None:
                survey(lambda: m.connections.watchdog, self._announced_in, m.key(""),
                       self._origin_of(m.env.rank), listener)
            expected = set(range(m.env.world_size)) - set(fault.suspects)
            # By the node's relay, on the node's board, where this rank does not agree by
            # itself (relay.py): a node's survivors make one check-in and one read.
            m.relay.check_in(m.store, m.key(""), m.env, m.generation,
                             json.dumps(asdict(position)), expected)
            m.inject("checked in")
            # Read by the watchers (whose pulses they are: read as their generation began,
            # Membership.known), by a survivor that closes the membership itself, and where the
            # nodes' sizes do not place every survivor: every survivor reading every identity
            # was W² values (12.8 GB at 8,000 ranks).
            identities = m.known if m.known.generation == m.generation else ReadOnce(
                lambda g=m.generation, w=m.env.world_size: m.identities(generation=g,
                                                                        world_size=w))
            pulses = Pulses(m.store, lambda: {r: pulse_key(i) for r, i in identities.items()},
                            m.pulse_key)

            def decide(present: list[int], checked_in: dict[int, str]) -> dict[str, Any]:
                if UNKNOWN in identities.values():  # one said who it was after the first read
                    identities.read(again=True)
                return decide_membership(present, checked_in, identities, fault,
                                         m.env.world_size)

            agreed = m.relay.record(m.env, m.generation, expected, m.bound_s / 2, lambda: (
                close_membership(m.store, m.key(""), expected, fault.suspects, pulses,
                                 limit_s=m.bound_s / 2, rank=m.env.rank, decide=decide)))
            members = agreed["members"]
            if m.env.rank not in members:
                raise self._left_behind(closed_without_me=True)
            # A survivor that places itself from the identities, or watches the new generation
            # (it reads the new members' pulses), takes them as they are after the close (every
            # member wrote its own before it checked in), not as it first read them (a
            # watcher's, at its first look).
            needs = agreed["nodes"] is None or \
                members.index(m.env.rank) in watchers(range(len(members)))
            if needs and any(identities[r] == UNKNOWN for r in members):
                identities.read(again=True)
            self._survey = (self._surveyed(members, identities)
                            if members.index(m.env.rank) in watchers(range(len(members)))
                            else None)
            env = (placed_env(m.env, members, agreed["nodes"]) if agreed["nodes"] is not None
                   else successor_env(m.env, members, identities))
        except RuntimeError as e:  # DistStoreError, DistNetworkError: the store went
            raise self._left_behind() or CannotRecover(
                f"the coordination store does not answer: {first_line(e)}") from None
        step = agreed["step"]
        if step == NO_STATE:  # every rank that held the job's state was lost as joiners entered
            raise CannotRecover("no survivor holds the job's state (the ranks left joined it and "
                                "had not yet taken it)")
        lost = [{"rank": r, "host": host, "why": fault.why if r in fault.suspects else "died"}
                for r, host in agreed["lost"]]
        change = Change(env=env, generation=m.generation + 1,
                        old_world_size=m.env.world_size, lost=lost, why=fault.why, step=step,
                        holder=agreed["holder"], steps_redone=agreed["steps_redone"],
                        evaluated_step=agreed["evaluated_step"], detected=detected,
                        detected_at=detected_at)
        change = self._widen(change, members)
        try:
            self.next_generation(change, identities, members,
                                 gone=[tuple(node) for node in agreed["gone"]])
        except PeerFailure:
            raise
        except RuntimeError as e:  # the store went as the generation began: said in one line
            raise self._left_behind() or CannotRecover(
                f"the coordination store does not answer: {first_line(e)}") from None
        return change

    def grow(self, decision: dict[str, Any], position: Position,
             admit: Callable[[dict[str, Any], Change], None]) -> Change:
        """At a step boundary, once the step that raised rank 0's flag is done: the job's ranks
        admit the joining nodes of rank 0's ``decision`` (the old ranks keep theirs; then the
        joiners, node by node). ``admit`` (rank 0's) tells the joiners; the new group is then
        built as after a fault, within the same bound, a member lost meanwhile declared in the
        new generation (PeerFailure: the survivors recover from it)."""
        m = self.member
        detected, detected_at = time.monotonic(), time.time()
        self.deadline.arm()
        self.change, self._origin, self._survey = None, [], None
        self.phase = "admitting the joining nodes"
        change, identities = self._grown(decision, m.generation + 1, position.step,
                                         position.evaluated_step, detected, detected_at)
        try:
            admit(decision, change)
        except RuntimeError as e:  # the store went: nobody to agree with
            raise CannotRecover(f"the coordination store does not answer: {first_line(e)}") \
                from None
        self._begin(change, identities, decision)
        return change

    def enter(self, decision: dict[str, Any], admission: dict[str, Any]) -> Change:
        """A joining worker, admitted by ``admission`` into the generation of rank 0's
        ``decision``: it takes its place there, and builds the new group with the job's ranks
        (see :meth:`grow`)."""
        detected, detected_at = time.monotonic(), time.time()
        self.deadline.arm()
        self.phase = "entering the job"
        change, identities = self._grown(decision, admission["generation"], admission["step"],
                                         admission["evaluated_step"], detected, detected_at)
        self._begin(change, identities, decision)
        return change

    def _grown(self, decision: dict[str, Any], generation: int, step: int, evaluated_step: int,
               detected: float, detected_at: float) -> tuple[Change, Mapping[int, Identity]]:
        """The change of a grow as this process takes it (a rank of the job, or a joiner), and
        the new members' identities: the joiners' from the decision, the old ranks' read only
        where needed (by the new generation's watchers, for their pulses)."""
        m = self.member
        old = decision["old_world_size"]
        joiners = [Identity(**d) for d in decision["joiners"]]
        world = list(range(old + len(joiners)))
        if decision.get("members") is not None:  # every member named (see Admissions)
            members = dict(enumerate(Identity(**d) for d in decision["members"]))
            rank = [identity.key for identity in members.values()].index(m.identity.key)
            env = successor_env(dataclasses.replace(m.env, rank=rank), world, members)
            return grown(env, joiners, old, generation, step, evaluated_step, detected,
                         detected_at), members
        rank = (old + [joiner.key for joiner in joiners].index(m.identity.key) if m.joining
                else m.env.rank)
        env = placed_env(dataclasses.replace(m.env, rank=rank), world, decision["nodes"])
        decided_in = decision["generation"]
        identities = ReadOnce(lambda: {
            **m.identities(generation=decided_in, world_size=old),
            **{old + i: joiner for i, joiner in enumerate(joiners)}})
        return grown(env, joiners, old, generation, step, evaluated_step, detected,
                     detected_at), identities

    def _begin(self, change: Change, identities: Mapping[int, Identity],
               decision: dict[str, Any]) -> None:
        """The generation of a grow, begun with its members (``identities``, in their new
        order), the joiners of ``decision`` among them."""
        joined = {Identity(**d).node for d in decision["joiners"]}
        try:
            self.next_generation(change, identities, list(range(change.env.world_size)),
                                 joined=joined)
        except PeerFailure:
            raise
        except RuntimeError as e:  # the store went as the generation began: said in one line
            raise CannotRecover(f"the coordination store does not answer: {first_line(e)}") \
                from None

    def _left_behind(self, closed_without_me: bool = False) -> Dropped | None:
        """Dropped when the job went on without this rank: the survivors closed the membership
        without it (``closed_without_me``), or the fence's reason says so (where the store does
        not answer, the checkpoint folder's generation.json); else None. The bound is then off:
        no give-up follows, and no ``fallback`` record (the job did not fall back)."""
        m, over = self.member, None
        if closed_without_me:
            line = dropped_line(m.env.rank, m.generation, f"the job is at {m.generation + 1}")
        else:
            with contextlib.suppress(CannotTell):
                over = m.dropped()
            if over is None:
                return None
            line = over.line
        self.deadline.disarm()
        return Dropped(line)

    def _surveyed(self, members: list[int], identities: Mapping[int, Identity]) -> Survey | None:
        """What the nodes of ``members`` (this round's ranks, in their new order) found as the
        round began (reach.py), each node known by its first member's rank where the change
        began; None where an identity is unknown."""
        if any(identities[r] == UNKNOWN for r in members):
            return None
        first: dict[tuple[str, int], int] = {}
        for r in sorted(members):
            first.setdefault(identities[r].node, self._origin_of(r))
        return Survey(self.member.store, self.member.key(""),
                      {new: first[identities[old].node] for new, old in enumerate(members)})

    def _origin_of(self, rank: int) -> int:
        """``rank`` of this round's generation, numbered as where the change began."""
        return self._origin[rank] if self.change is not None else rank

    def _widen(self, change: Change, members: list[int]) -> Change:
        """``change`` as one with the change still being recovered, if any: from the world that
        one began in, every rank lost on the way (numbered as there)."""
        earlier = self.change
        origin = self._origin if earlier is not None else list(range(self.member.env.world_size))
        self._origin = [origin[r] for r in members]
        lost = [{**gone, "rank": origin[gone["rank"]]} for gone in change.lost]
        if earlier is not None:
            change = dataclasses.replace(
                change, old_world_size=earlier.old_world_size,
                lost=sorted(earlier.lost + lost, key=lambda gone: gone["rank"]), why=earlier.why,
                steps_redone=max(earlier.steps_redone, change.steps_redone),
                detected=earlier.detected, detected_at=earlier.detected_at)
        self.change = change
        return change

    def next_generation(self, change: Change, identities: Mapping[int, Identity],
                        members: list[int], gone: list[tuple[str, int]] = (),
                        joined: set[tuple[str, int]] = frozenset()) -> None:
        """Leaves the failed group to its threads and joins the survivors' new one: ``members``
        (ranks of ``identities``, in their new order), without the nodes that are ``gone``,
        with those that ``joined`` (a grow's)."""
        m = self.member
        # The new generation's watchers read its members' pulses (run): they need every member's
        # identity now (read once, where a grow named only its joiners), and hand them to the
        # generation (each member writes its own again there: one that has not yet is known).
        watching = change.env.rank in watchers(range(len(members)))
        if watching and isinstance(identities, ReadOnce):
            identities.read()
        known = ({new: identities[old] for new, old in enumerate(members)}
                 if not isinstance(identities, ReadOnce) or identities.ready else None)
        if known is not None and UNKNOWN in known.values():
            known = None
        if change.kind == "grow":
            m.move_on(change, list(range(change.old_world_size)), joined=joined,
                      identities=known)
        else:
            # Counted by the nodes' numbers, not by the identities the closer knew: a node
            # whose ranks were lost before they said who they were in the last generation is
            # one too (those of joined nodes are no agents of the launch's round).
            removed = m.env.group_world_size - change.env.group_world_size
            m.move_on(change, members, gone=max(0, removed - len(set(gone) & m.joined_agents)),
                      identities=known)
        # The new generation's watchers read its members' pulses (run); the others never.
        self._pulse_keys = ({new: pulse_key(identities[old]) for new, old in enumerate(members)}
                            if watching else {})
        # Built in a thread, made the default group here, in the training thread, once complete:
        # a creation given up on (a member frozen) may complete later, and changes nothing. Its
        # connection, held until the group's timeout at most, is a spare: gloo is done with it
        # once connected; NCCL is not (its later communicators meet on the group's store), and
        # the spares are refilled after the change.
        spares = m.connections.group
        connection, generation, env = spares.take(), m.generation, m.env
        store = dist.PrefixStore(m.key("pg", generation), connection)

        def create() -> dist.Backend:
            try:
                if generation != m.generation:  # given up on before it began
                    raise PeerFailure(f"generation {generation} is over")
                return connect_group(m.device, store, env.rank, env.world_size, m.pg_timeout)
            finally:
                if backend_for(m.device) != "nccl":
                    spares.give_back(connection)

        m.inject("creating the new group")
        backend, self._survey = self.run("creating the new group", create), None  # built
        install_group(backend, m.device, store, env.rank, env.world_size, m.pg_timeout)

    def run(self, phase: str, work: Callable[[], Any]) -> Any:
        """``work()``, the collectives of a recovery's ``phase``, in a thread of its own, waited
        on as a guarded collective: the wait fails (PeerFailure) when ``work`` raises, and when a
        fault is declared in this generation, which this thread does itself when a member's
        pulse stops. A thread given up on is left to its wait (gloo's: the group's timeout);
        it completes only if the member it waits for comes back to life, and that one, dropped,
        leaves (EXIT_DROPPED), so that torchrun restarts the job anyway.

        ``work`` changes nothing outside itself (no default group, no model, no trainer): it
        returns what the caller then applies, in the training thread, in the generation it ran
        for; a thread given up on that completes later changes nothing."""
        m = self.member
        self.phase = phase
        done: torch.futures.Future = torch.futures.Future()

        def body() -> None:
            try:
                if m.device.type == "cuda":  # the current device is the thread's own
                    torch.cuda.set_device(m.device)
                done.set_result(work())
            except Exception as e:  # noqa: BLE001 - the backend's error, handed to the waiter
                done.set_exception(e)

        try:  # a generation broken already runs nothing more
            guarded = m.guard(done)
        except PeerFailure as e:
            self.failure = f"{phase}: {e}"
            raise
        threading.Thread(target=body, daemon=True, name=f"membership-g{m.generation}").start()
        finished = threading.Event()
        guarded.add_done_callback(lambda _: finished.set())
        # The generation's watchers read its members' pulses; every other member waits.
        pulses = Pulses(m.store, self._pulse_keys, m.pulse_key) if self._pulse_keys else None
        began, survey_ = time.monotonic(), self._survey if pulses is not None else None
        while not finished.wait(PULSE_S):
            try:
                silent = pulses.silent() - {m.env.rank} if pulses is not None else set()
                if silent:
                    m.declare("died", sorted(silent), f"no pulse from rank(s) "
                              f"{', '.join(map(str, sorted(silent)))} while {phase}")
                elif survey_ is not None:  # members alive: across a cut? (reach.py)
                    cut, why = survey_.cut(time.monotonic() - began)
                    if cut:
                        m.declare("hung", cut, f"{why} while {phase}")
                        survey_ = None
            except RuntimeError as e:  # DistStoreError: the store went, nobody to agree with
                self.failure = f"{phase}: the coordination store does not answer"
                raise self._left_behind() or CannotRecover(
                    f"{self.failure}: {first_line(e)}") from None
        try:
            return guarded.wait()
        except PeerFailure as e:
            self.failure = f"{phase}: {e}"
            raise

    # --- the bound, and the end of a change -------------------------------------------------------

    def recovered(self) -> None:
        """The first step after a change completed: the bound is off, the change over."""
        self.deadline.disarm()
        self.change = None
        self.phase, self.failure = "detecting the fault", ""
        spares = self.member.connections.group
        if spares.idle() < spares.count:
            # The spare a second fault took, or an NCCL group keeps: opened off the training
            # thread (a new connection can wait seconds on the store's resolver, on every
            # survivor at once), and a store gone meanwhile is one warning, no traceback.
            self._refilling = threading.Thread(target=self._refill, daemon=True,
                                               name="membership-spares")
            self._refilling.start()

    def _refill(self) -> None:
        try:
            self.member.connections.group.replenish()
        except RuntimeError as e:  # DistStoreError, DistNetworkError: the store went
            log.warning("could not open a spare connection to the coordination store (%s): a "
                        "recovery opens one if it needs it", first_line(e))

    def _give_up(self) -> None:
        """At the bound, in the timer's thread: one woken after the survivors went on without
        this rank (it was frozen in the recovery) says so, and leaves as dropped; else it falls
        back. The question is bounded: a store that does not answer delays no give-up."""
        if self.store_wait.extends(self.deadline):  # it waits on for a store away
            return
        try:
            dropped = within(self._left_behind, DROPPED_QUESTION_S, "membership-dropped")
        except Exception:  # noqa: BLE001 - no answer in time, or none to give: it falls back
            dropped = None
        if not self.deadline.current():  # the change completed as the question was asked
            return
        if not first_to_say_dropped():  # another thread says the line, and ends the process
            wait_for_the_end()
        if dropped is not None:
            log.error("%s", dropped)
            end_process(EXIT_DROPPED)
            return
        self.fall_back(f"no step completed within {self.store_wait.said(self.deadline)} "
                       "of the fault"
                       + (f" (the last round failed {self.failure})" if self.failure else ""))
        end_process(EXIT_GAVE_UP)

    def fall_back(self, reason: str) -> None:
        """One line, and a ``fallback`` record in events.jsonl where this rank can write it:
        the recovery in process failed (in which phase, why), torchrun restarts the job."""
        m = self.member
        log.error("recovery in process failed while %s: %s; leaving, so that torchrun restarts "
                  "the job from its last checkpoint", self.phase, reason)
        record = {"phase": self.phase, "reason": reason, "rank": m.env.rank,
                  "generation": m.generation}
        try:
            m.on_fallback(record)
        except Exception as e:  # noqa: BLE001 - leaving anyway: the line above says it
            log.warning("the fallback record was not written: %s", first_line(e))


def pids_here(m: Member, ranks: list[int]) -> set[int]:
    """The pids of ``ranks`` of the current generation that run on this host, as they said who
    they are (read only for them: a hang's survivors look only where a sibling is stopped)."""
    keys = [m.key(f"id/{rank}") for rank in ranks]
    found = (Identity(**json.loads(v)) for v in read_present(m.store, keys).values())
    return {i.pid for i in found if i.host == m.identity.host}
