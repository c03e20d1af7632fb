"""Who is in the group: the generation of ranks, its collectives that can be given up on, and
the fault declared in it. When a node dies, leaves or freezes, the others go on in the same
processes.

torchrun restarts every worker of a job whenever one of them fails. When a whole node goes away,
though, the agents of the other nodes leave their workers alone (``SimpleElasticAgent._invoke_run``
restarts a group only when a local worker failed or a node waits to join), so the survivors can
go on by themselves, without a process start, a new CUDA context or a checkpoint read:

1. **Notice** (here). Every collective of the training loop is waited on through
   :meth:`Membership.guard`. A rank whose collective fails (a peer's connection closed), or whose
   watchdog finds a peer hung, or whose peers asked to leave, *declares* the fault in the
   coordination store; a wake-up thread in every rank sees the declaration and fails that rank's
   pending collectives at once. gloo cannot abort a collective blocked on a frozen peer (its
   thread returns at the group's timeout): the rank simply stops waiting for it, and the group is
   abandoned to its thread. Every process also raises a *pulse* every ``PULSE_S``, on its node's
   board, which one worker of the node writes into the store for all (board.py; agreement.py:
   :class:`Pulses` tells the gone or frozen from the busy).
2. **Agree on who is left**, and 3. **a new group** (a new *generation*), within ``bound_s`` of
   the fault, else torchrun restarts the job: recovery.py. The worst case is the restart.

A node that joins enters the same way, at a step boundary: rank 0 decides to admit it
(admissions.py), the step's flags say so, and every rank moves with the joiners to the next
generation (:meth:`Membership.grow`; a joiner's side is :meth:`Membership.enter`).

A recovery opens no connection to the coordination store (connections.py). Under torch's c10d
rendezvous the workers renew their agents' keep-alives and watch the round (torchrun_agents.py).
The job's current generation is named for the fence (current.py).

The coordination store is the rendezvous store torchrun's agents meet at: it outlives any node
but its own host (every node, served by ``elastic-mnist rendezvous``). Each launch has a nonce
of its own under the run id, and each generation a prefix of its own under it, so nothing of an
earlier group is read by a later one (torchft's per-quorum stores).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import platform
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elastic_mnist.distributed import backend_for
from elastic_mnist.env import DistEnv
from elastic_mnist.errors import CannotRecover, PeerFailure, first_line
from elastic_mnist.resilience.admissions import Admissions
from elastic_mnist.resilience.agreement import (
    PULSE_S,
    UNKNOWN,
    Change,
    Fault,
    Identity,
    Position,
    declare_fault,
    generation_key,
    pulse_key,
    read_present,
    watchers,
)
from elastic_mnist.resilience.board import NodeBoard, board_for, parse
from elastic_mnist.resilience.connections import Connections
from elastic_mnist.resilience.current import CurrentGeneration
from elastic_mnist.resilience.faces import NullMembership
from elastic_mnist.resilience.fence import Over
from elastic_mnist.resilience.read_once import ReadOnce, read_ahead
from elastic_mnist.resilience.recovery import Recovery
from elastic_mnist.resilience.relay import Relay, by_themselves
from elastic_mnist.resilience.roster import Roster
from elastic_mnist.resilience.speaker import Speaker
from elastic_mnist.resilience.survivors_group import abort_default_group
from elastic_mnist.resilience.torchrun_agents import Members, NoAgents, agents_for

log = logging.getLogger(__name__)

PREFIX = "elastic_mnist"
WAKE_TIMEOUT = datetime.timedelta(hours=24)
"""How long the wake-up thread waits on one wait: as long as a generation may last."""


class Membership(NullMembership):
    """One worker's view of its group: the generation, its guarded collectives, its one fault.

    Lives as long as the process; its generation moves on at each change (:attr:`recovery`).
    """

    in_process = True

    def __init__(self, env: DistEnv, device: torch.device, store: dist.Store, generation: int,
                 pg_timeout_s: float, bound_s: float, folder: Path | None = None,
                 launch: str = "", agents: NoAgents | None = None,
                 records: Roster | None = None, run_id: str = "", joining: bool = False,
                 board: NodeBoard | None = None):
        """``store``: the coordination store, under this launch's own prefix; ``bound_s``: how
        long after a fault the survivors may take to complete a step before they give up;
        ``folder``: the checkpoint folder, where the job's current generation is mirrored
        (``GENERATION_FILE``) for the launch ``launch``; ``agents``: the launcher's agents, the
        membership's one face to them (torchrun's of ``env``'s rendezvous by default);
        ``records``: the rendezvous records, where the job is published for nodes that join
        it, on a connection of their own (None: no node joins in process); ``run_id``: the
        training run's; ``joining``: this worker's node joins the job, at ``generation`` now,
        and is a member only once the job admits it (:meth:`enter`); ``board``: where this
        process raises its pulse with its node's other workers (board.py; by default the file
        of its agent and launch)."""
        self.env, self.device = env, device
        self.folder, self.launch = (None if folder is None else Path(folder)), launch
        self.store = store
        self.generation = generation
        self.pg_timeout = datetime.timedelta(seconds=pg_timeout_s)
        self.bound_s = bound_s
        self.launch_agents = env.group_world_size
        """Agents of the rendezvous round this launch started in (all meet at the exit barrier)."""
        self.identity = Identity(platform.node(), os.getpid(), os.getppid(), env.local_rank,
                                 nonce=secrets.token_hex(8),
                                 serial=int(env.rendezvous.agent)
                                 if env.rendezvous and env.rendezvous.agent else None)
        self.joining = joining
        self.gone_agents = 0
        """Agents of the launch's round that changes removed (no rank of theirs is left): they
        never come to torchrun's exit barrier."""
        self.joined_agents: set[tuple[str, int]] = set()
        """Agents of nodes that joined in process: no agents of the launch's round."""
        self.faulted = self.broken = None
        self._lock = threading.RLock()
        self._group_lock = threading.Lock()
        """Held while the default group is aborted or destroyed, and the generation moved on."""
        self._pending: set[torch.futures.Future] = set()
        self._declaring, self._closed = threading.Lock(), False
        self.connections = Connections.open(store)
        """The process's connections to the store besides ``store``, one per use."""
        self.current = CurrentGeneration(self.connections.declare, self.folder, launch)
        """The job's current generation, named and mirrored for the fence."""
        self._waker: threading.Thread | None = None
        self.launcher = agents if agents is not None else agents_for(env)
        """The launcher's agents (torchrun_agents.py): kept in the rendezvous, released at
        the end."""
        agent_addr = self.launcher.join(store, self.identity.agent, env.group_rank)
        self.identity = dataclasses.replace(self.identity, agent_addr=agent_addr)
        self.round: int | None = self.launcher.round
        """The rendezvous round this process's agent is in (None: no rendezvous)."""
        self.board = board if board is not None else board_for(
            self.identity.host, self.identity.agent, launch, env.local_world_size,
            env.local_rank)
        self.identity = dataclasses.replace(self.identity, board=self.board.node)
        self.relay = Relay(self.board)
        """This process's side of its node's board in a change (relay.py)."""
        self.pulse_key = pulse_key(self.identity)
        # The node's record exists before this rank says who it is: a read never waits for it.
        self.connections.declare.set(self.board.key, self.board.record(self.board.counts()))
        self.inject: Callable[[str], None] = lambda phase: None
        self.on_fallback: Callable[[dict[str, Any]], None] = lambda record: None
        """Writes the ``fallback`` record where this rank can (duties.py)."""
        self.known = ReadOnce(dict)
        """The current generation's identities (set as each generation begins)."""
        self.recovery = Recovery(self)
        """The change under way, if any: agreement, new group, bound (recovery.py)."""
        self._pulsing = threading.Thread(target=self._pulse, daemon=True, name="membership-pulse")
        self._pulsing.start()
        self.admissions: Admissions | None = None
        """The job in the rendezvous records, and the nodes that join it (admissions.py)."""
        if records is not None:
            round_ = env.rendezvous.round if env.rendezvous and env.rendezvous.round is not None \
                else self.round
            self.admissions = Admissions(self, records, run_id, round_ or 0)
        if joining:
            return
        self._start_generation()
        self.launcher.guard(self.connections.declare, Members(
            agent=self.identity.agent, closed=lambda: self._closed,
            generation=lambda: self.generation, rank=lambda: self.env.rank,
            local_rank=lambda: self.env.local_rank, agents=self._member_agents))

    # --- the generation's keys --------------------------------------------------------------------

    def generation_store(self) -> dist.Store:
        """This generation's own prefix of the coordination store, on its watchdog's connection."""
        return dist.PrefixStore(f"g{self.generation}", self.connections.watchdog)

    def key(self, name: str, generation: int | None = None) -> str:
        """``name`` in the prefix of ``generation`` (the current one by default)."""
        return generation_key(self.generation if generation is None else generation, name)

    def _start_generation(self, identities: dict[int, Identity] | None = None) -> None:
        """Says who this rank is in the generation, and watches it. ``identities``: every
        member's, where the change that began it knew them."""
        self.store.set(self.key(f"id/{self.env.rank}"), json.dumps(asdict(self.identity)))
        generation, world_size = self.generation, self.env.world_size
        self.known = ReadOnce(lambda: self.identities(generation=generation,
                                                      world_size=world_size), generation)
        """The generation's identities: its watchers read them as it begins
        (:meth:`_read_identities`), the others only if a recovery needs them."""
        if identities is not None:
            self.known.offer(identities)
        if self.env.rank in watchers(range(world_size)) and not self.known.ready:
            threading.Thread(target=self._read_identities, args=(self.known, world_size),
                             daemon=True, name=f"membership-identities-g{generation}").start()
        # The last generation's wake-up thread was woken by the fault's declaration and is done:
        # its connection is free (a new one only if it still waits, for a store that stalls).
        if self._waker is not None:
            self._waker.join(timeout=2)
        store = (self.connections.wake if self._waker is None or not self._waker.is_alive()
                 else self.store.clone())
        self._waker = threading.Thread(target=self._await_wake, daemon=True,
                                         args=(self.generation, self.env.rank, store,
                                               self._reads_the_fault()),
                                         name=f"membership-wake-g{self.generation}")
        self._waker.start()

    def _reads_the_fault(self) -> bool:
        """Whether this rank reads a fault of its generation from the store as it is woken,
        rather than from its node's board (relay.py): its node's first rank does, for its
        siblings; and so do the watchers and backups, which agree by themselves (a node of
        them, in a small job, waits on no sibling)."""
        return (self.env.local_rank == 0
                or self.env.rank in by_themselves(set(range(self.env.world_size))))

    def _read_identities(self, known: ReadOnce, world_size: int) -> None:
        """A watcher of ``known``'s generation reads its identities ahead, before any fault
        (:func:`read_ahead`), on the declarations' connection; moot once they are known, the
        generation over or the membership closed."""
        store = self.connections.declare
        read_ahead(known, store, [self.key(f"id/{rank}", known.generation)
                                  for rank in range(world_size)], self.pg_timeout,
                   read=lambda: self.identities(store, known.generation, world_size),
                   moot=lambda: (known.ready or known.generation != self.generation
                                 or self._closed))

    def _await_wake(self, generation: int, rank: int, store: dist.Store, first: bool) -> None:
        """Waits to be woken (by a declaration, or by :meth:`close`); then, for a declared fault,
        gives up on every collective of the generation. The fault is read by the node's
        ``first`` rank, and taken from the node's board by the others (relay.py)."""
        store.set_timeout(WAKE_TIMEOUT)
        try:
            store.wait([self.key(f"wake/{rank}", generation)])
            if self._closed or generation != self.generation:  # closed, or a grow moved on
                return
            fault = Fault(**json.loads(self.relay.fault(
                generation, rank, first, lambda: store.get(self.key("fault", generation)))))
        except Exception as e:  # noqa: BLE001 - the coordination store went: nothing to agree on
            log.warning("the coordination store does not answer (%s); a lost node now ends "
                        "the job", first_line(e))
            return
        self.abort(fault, generation)  # nothing if the generation is over meanwhile

    def close(self) -> None:
        """Stops watching (the job has ended): no change's bound ends the process now."""
        self._closed = True
        self.recovery.deadline.disarm()
        if self.admissions is not None:
            self.admissions.close()
        with contextlib.suppress(RuntimeError):
            self.store.set(self.key(f"wake/{self.env.rank}"), "closed")
        self._pulsing.join(timeout=2 * PULSE_S)

    def _pulse(self) -> None:
        """Raises this process's pulse on its node's board every PULSE_S while it lives, and
        has the node's record written when it speaks for the node (speaker.py): see :class:`Pulses`."""
        speaker = Speaker(self.connections.declare, self.board.key, self.store.clone)
        while not self._closed:
            time.sleep(PULSE_S)
            record = self.board.beat()
            if record is not None:
                speaker.say(record)
        speaker.close()
        self.board.close()

    def own_pulse(self, store: dist.Store) -> int:
        """This process's pulse as its node's record in the store says it."""
        key, slot = self.pulse_key
        counts = parse(store.get(key))
        return counts[slot] if slot < len(counts) else -1

    # --- collectives that can be given up on ------------------------------------------------------

    def guard(self, future: torch.futures.Future) -> torch.futures.Future:
        """``future`` as one this rank can stop waiting for: it fails with PeerFailure when the
        collective fails, and as soon as any rank declares a fault in this generation."""
        mine: torch.futures.Future = torch.futures.Future()
        with self._lock:
            if self.broken is not None:
                raise PeerFailure(self.broken)
            self._pending.add(mine)
            generation = self.generation

        def settle(done: torch.futures.Future) -> None:
            try:
                value, error = done.value(), None
            except Exception as e:  # noqa: BLE001 - the backend's error, handed to the waiter
                value, error = None, e
            with self._lock:
                self._pending.discard(mine)
                if mine.done():  # given up on already
                    return
                if generation != self.generation:  # a collective of a group that is gone
                    mine.set_exception(PeerFailure(f"generation {generation} is over"))
                    return
                if error is None:
                    mine.set_result(value)
                    return
                self.broken = self.broken or f"a collective failed: {first_line(error)}"
                mine.set_exception(PeerFailure(self.broken))

        future.add_done_callback(settle)
        return mine

    def abort(self, fault: Fault, generation: int | None = None) -> None:
        """Fails every collective this rank waits for, and every later one of the generation
        (``generation``, the current one by default: nothing once it is over)."""
        with self._lock:
            if generation is not None and generation != self.generation:
                return
            if self.faulted is None:
                self.faulted = fault
                self.broken = f"the group changed: ranks {fault.why} (reported by rank " \
                              f"{fault.reported_by})"
            pending, self._pending = self._pending, set()
            for future in pending:
                if not future.done():
                    future.set_exception(PeerFailure(self.broken))
        if backend_for(self.device) == "nccl":
            # NCCL, unlike gloo, can abort the collectives in flight: the default group's, if
            # it is still this generation's. Checked again, and aborted, under the lock the
            # training thread moves to the next generation under (before it installs that
            # one's group): a late watcher never aborts the next generation's group. Not under
            # _lock, which the futures' callbacks take, in NCCL's threads, as it aborts.
            with self._group_lock:
                if (generation is None or generation == self.generation) \
                        and dist.is_initialized():
                    abort_default_group()

    def declare(self, why: str, suspects: list[int], detail: str = "",
                generation: int | None = None) -> Fault | None:
        """This rank's verdict, unless another rank's came first: the generation's one fault.

        ``generation``: the one the verdict was made in (the watchdog's, which names ranks of
        its own generation); a verdict on a generation that is over is dropped (None)."""
        store = self.connections.declare
        with self._declaring:  # across no store call: a silent one holds no generation's move
            env, current = self.env, self.generation  # keys of one generation, read once
            if generation is not None and generation != current:
                log.info("a verdict on generation %d dropped (%s %s): the group is at %d now",
                         generation, why, suspects, current)
                return None
            known = self.faulted  # read once: the wake-up thread may set it meanwhile
            if known is not None and env.rank not in watchers(range(env.world_size)):
                # Woken by the generation's one fault (or declared already), which woke every
                # rank: nothing to say (a compare_set by every rank was W operations at once).
                return known
            fault = json.dumps(asdict(Fault(why, sorted(suspects), env.rank, detail, time.time())))
            self.recovery.deadline.arm()  # the change's bound, from here: before a move ends it
        # One that found the fault itself, or a watcher, wakes every rank (declare_fault).
        agreed = declare_fault(store, self.key("", current), env.world_size, fault)
        if self.generation != current:  # moved on as it was declared: dropped
            log.info("a verdict on generation %d dropped (%s %s): the group moved on to %d",
                     current, why, suspects, self.generation)
            return None
        return Fault(**json.loads(agreed))

    def identities(self, store: dist.Store | None = None, generation: int | None = None,
                   world_size: int | None = None) -> dict[int, Identity]:
        """Every rank's identity as it published it (read on ``store``, the main connection by
        default), in ``generation`` of ``world_size`` ranks (the current one by default); a
        rank lost before it could is unknown."""
        if generation is None:
            generation, world_size = self.generation, self.env.world_size
        keys = [self.key(f"id/{rank}", generation) for rank in range(world_size)]
        found = read_present(store or self.store, keys)
        return {rank: Identity(**json.loads(found[key])) if key in found else UNKNOWN
                for rank, key in enumerate(keys)}

    # --- a change, recovered (recovery.py) --------------------------------------------------------

    def recover(self, position: Position, why: str = "died", suspects: tuple[int, ...] = (),
                detail: str = "") -> Change:
        """Agrees on who is left, and builds the new group: see :meth:`Recovery.recover`."""
        return self.recovery.recover(position, why, suspects, detail)

    def run(self, phase: str, work: Callable[[], Any]) -> Any:
        """A recovery's collectives, given up on with the generation: :meth:`Recovery.run`."""
        return self.recovery.run(phase, work)

    def recovered(self) -> None:
        self.recovery.recovered()

    def no_more_changes(self) -> None:  # the job has no step left (faces.py)
        self.recovery.deadline.close()

    # --- nodes that join (admissions.py, recovery.py) ---------------------------------------------

    def admission_due(self) -> bool:
        return self.admissions is not None and self.admissions.due()

    def grow(self, position: Position) -> Change:
        """At the end of the step whose flag said so: the job admits the joining nodes that rank
        0 decided on, and every rank moves to their new generation (see :meth:`Recovery.grow`)."""
        decision = json.loads(self.store.get(self.key("grow")))
        return self.recovery.grow(decision, position, self.admissions.admit)

    def ready(self) -> None:
        """A joining worker is built: the job may admit its node once all its workers are."""
        self.admissions.ready(self.env.join)

    def wait_admission(self, stopping: Callable[[], bool]) -> dict[str, Any] | str:
        """A joining worker: its node's admission, or why none comes (:meth:`Admissions.wait`)."""
        return self.admissions.wait(self.env.join, stopping)

    def enter(self, admission: dict[str, Any]) -> Change:
        """A joining worker, admitted: it moves into the job's new generation with the job's
        ranks (see :meth:`Recovery.enter`)."""
        if admission["launch"] != self.launch:
            raise CannotRecover("the job was restarted as a whole since this node asked to join")
        decision = json.loads(self.store.get(self.key("grow", admission["decided_in"])))
        return self.recovery.enter(decision, admission)

    def fall_back(self, reason: str) -> None:
        self.recovery.fall_back(reason)

    def move_on(self, change: Change, kept_ranks: list[int], gone: int = 0,
                joined: set[tuple[str, int]] = frozenset(),
                identities: dict[int, Identity] | None = None) -> None:
        """Leaves the failed group to its threads and moves to ``change``'s generation, of the
        last generation's ``kept_ranks`` (and the joiners of a grow): named the job's current
        one, and watched. ``gone``: the agents of the launch's round that the change removed
        (none of their ranks is kept); ``joined``: the nodes a grow admitted; ``identities``:
        the new generation's, where the change knew them (its watchers read none)."""
        # A verdict declared meanwhile names ranks of one generation; a watcher of the last one
        # acts in it or not at all.
        woken = None if self.joining else self.key(f"wake/{self.env.rank}")
        with self._group_lock:
            if dist.is_initialized():
                # gloo's threads may still wait in the old group (for a frozen peer, until its
                # timeout); it is not destroyed while they do: whatever holds it keeps it alive.
                dist.destroy_process_group()
            with self._declaring, self._lock:
                self.env, self.generation = change.env, change.generation
                self.faulted = self.broken = None
                self.joining = False
        if woken is not None:  # the last generation's watcher, which no fault woke after a grow
            self.connections.declare.set(woken, "over")
        self.joined_agents |= joined
        self.gone_agents += gone
        self._publish_current(kept_ranks)
        self._start_generation(identities)

    # --- the job's current generation, for the fence (current.py) ---------------------------------

    def _publish_current(self, kept: list[int]) -> None:
        """Names this generation the job's current one, with the ranks of the last that it
        ``kept`` (see :meth:`CurrentGeneration.publish`)."""
        self.current.publish(self.generation, kept,
                             mirror=self.env.local_rank == 0)

    def dropped(self) -> Over | None:
        """Why this process is no longer one of the job's ranks, or None while it is (none while
        it joins): see :meth:`CurrentGeneration.dropped`."""
        with self._lock:  # its generation and rank together: a change moves both (move_on)
            joining, generation, rank = self.joining, self.generation, self.env.rank
        return None if joining else self.current.dropped(generation, rank)

    def dropped_by_file(self) -> Over | None:
        """:meth:`dropped`, as the checkpoint folder says it: a fence's, whose store is silent."""
        with self._lock:
            joining, generation, rank = self.joining, self.generation, self.env.rank
        return None if joining else self.current.dropped_by_file(generation, rank, "no answer")

    def _member_agents(self) -> tuple[int, set[tuple[str, int]]]:
        """The generation, and the agents of its ranks as the rendezvous names them (name, pid);
        none until every rank has said who it is. All or none: the first agent to write again
        drops from the state every other whose keep-alive is still lapsed."""
        generation = self.generation
        found = self.identities(self.connections.declare).values()
        if UNKNOWN in found or generation != self.generation:
            return -1, set()
        return generation, {(i.agent_addr, i.agent) for i in found}

    # --- the job's end ----------------------------------------------------------------------------

    def finish(self) -> None:
        """At the job's end: rank 0 says so in the rendezvous records (no node joins it now)."""
        if self.admissions is not None:
            self.admissions.finish()

    def release_agents(self) -> None:
        """Rank 0, at the end: the launcher's agents that a change removed, or whose workers
        found them dead, are released from its exit barrier (see :meth:`TorchrunAgents.release`)."""
        if self.env.is_main:
            self.launcher.release(self.store, self.gone_agents,
                                  lambda: self._member_agents()[1], self.launch_agents)

