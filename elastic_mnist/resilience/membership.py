"""Who is in the group: when a node dies, leaves or freezes, the others go on in the same processes.

torchrun restarts every worker of a job whenever one of them fails. When a whole node goes away,
though, the agents of the other nodes leave their workers alone (``SimpleElasticAgent._invoke_run``
restarts a group only when a local worker failed or a node waits to join), so the survivors can
go on by themselves, without a process start, a new CUDA context or a checkpoint read:

1. **Notice.** Every collective of the training loop is waited on through :meth:`Membership.guard`.
   A rank whose collective fails (a peer's connection closed), or whose watchdog finds a peer
   hung, or whose peers asked to leave, *declares* the fault in the coordination store; a watcher
   thread in every rank sees the declaration and fails that rank's pending collectives at once.
   gloo cannot abort a collective blocked on a frozen peer (its thread returns at the group's
   timeout): the rank simply stops waiting for it, and the group is abandoned to its thread.
2. **Agree on who is left.** Each survivor checks in with where it stands (its committed step,
   whether it was in the middle of the next). The membership closes as soon as every rank not
   named in the fault has come, except those whose *pulse* stopped (the dead never come; a live
   rank still busy with its own work, an evaluation, a save, a recompile, is waited for), and
   at the latest after the hang timeout; the first survivor to close it writes it, and every
   survivor reads the same list. Every process's pulse is a counter in the coordination store
   that a thread of its own raises every ``PULSE_S``: one that stood still while the reader's own
   moved ``SILENT_PULSES`` times is gone or frozen (a store that stalls, or a reader starved of
   CPU, holds the reader's own pulse back as well). The watchdog's heartbeats cannot tell it:
   they beat once a second, and stop as the survivors begin to recover.
3. **A new group.** Survivors are renumbered in the order of their old ranks (rank 0 stays rank
   0 while it lives) and build a new process group on a fresh prefix of the coordination store:
   a new *generation*. The trainer then takes one agreed state (see ``Trainer.adopt``). Every
   collective of this step (the group's creation, the state's broadcast, DDP's checks, the
   digests) runs in a thread, waited on through the membership as the loop's are
   (:meth:`Membership.run`), while the waiting thread watches the new members' pulses: a member
   lost or frozen here is declared in the new generation, and the survivors begin the next
   round at once, from the same agreed state, the lost of every round in one change.

A recovery opens no connection to the coordination store: each process opens its few at start
and every generation reuses them. torch's TCPStore server resolves every new client's address to
a name inside its one event loop (``LibUVStoreDaemon::onConnect``), and where the resolver does
not answer at once every client of the store waits, up to the resolver's timeout (5 s): 24
survivors of 32 opening theirs during a recovery took 11.6 to 11.9 s to their first step, 1.6 s
without. Such a stall also lapses the agents' keep-alives in the rendezvous, and torch's agent
sends none once its own has lapsed: the workers renew them in their place. If every
agent is dropped all the same, torch's rendezvous starts a new round without them, and a joining
node trains alone in it beside the job; so every rank watches the round, and one that moved on
while this process still trains means its agent was dropped (see :meth:`TorchrunAgents.guard`,
torchrun_agents.py).

The coordination store is the c10d rendezvous store torchrun's agents meet at (its endpoint is
on the agent's command line): it outlives any node but its own host, and every node when it is
served by ``elastic-mnist rendezvous``. Losing the node that serves it ends the job anyway, since
the agents themselves can no longer meet. Each launch has a nonce of its own under the run id,
and each generation a prefix of its own under it, so nothing of an earlier group is read by a
later one (torchft's per-quorum stores; NVIDIA resiliency-ext's per-iteration prefixes).

If the survivors have not completed a step within ``bound_s`` of the fault, they give up and
leave, and torchrun restarts the job from its last checkpoint: the worst case is the restart.
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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elastic_mnist.distributed import backend_for, end_process
from elastic_mnist.env import DistEnv
from elastic_mnist.errors import EXIT_DROPPED, EXIT_GAVE_UP, CannotRecover, CannotTell, PeerFailure
from elastic_mnist.fsutil import atomic_write_bytes
from elastic_mnist.resilience.fence import Over
from elastic_mnist.resilience.survivors_group import (
    abort_default_group,
    connect_group,
    install_group,
)
from elastic_mnist.resilience.torchrun_agents import Members, NoAgents, agents_for

log = logging.getLogger(__name__)

PREFIX = "elastic_mnist"
PULSE_S = 0.1
"""How often each process raises its pulse in the coordination store."""
SILENT_PULSES = 15
"""A process whose pulse stood still while the reader's own moved this many times is gone or
frozen (about 1.5 s). Above the second that a live rank's pulse thread can wait for the CPU
where many ranks share few cores (4 nodes × 8 workers on 2 cores: more than 0.6 s was seen,
and a live rank judged dead costs the job a restart); below the 2 s that a node lost inside a
recovery may add to it (it is named by this silence when nothing else fails first)."""
WATCH_TIMEOUT = datetime.timedelta(hours=24)
CURRENT = "current"
"""The key naming the job's current generation, and the processes of the last one it kept."""
GENERATION_FILE = "generation.json"
"""The same, mirrored into the checkpoint folder with the launch it belongs to: what the fence
decides from when the coordination store does not answer (see :meth:`Membership.dropped`)."""
WHY = ("died", "left", "hung")
"""Why ranks went: their connections closed; they asked to stop; they stopped making progress."""


@dataclass(frozen=True)
class Identity:
    """A worker as its peers find it: where it runs, and which torchrun agent started it."""

    host: str
    pid: int
    agent: int
    """The agent's pid: workers of one node share it."""
    local_rank: int
    agent_addr: str = ""
    """The agent's name in the rendezvous, as its state names the participant of the agent's
    pid (``--local_addr``, else the agent's own resolver's name for its host); empty without a
    multi-node rendezvous."""
    nonce: str = ""
    """Drawn at random by the process as it starts: processes of one host name and pid
    (containers, each its node's pid 1, on hosts of one name) are told apart by it."""

    @property
    def key(self) -> str:
        """This process's own name in the coordination store, unlike any other's."""
        return f"{self.host}/{self.pid}/{self.nonce}"


UNKNOWN = Identity("unknown", 0, 0, 0)
"""The identity of a rank lost before it said who it was."""


@dataclass(frozen=True)
class Position:
    """Where a rank stood when the fault struck."""

    step: int
    """Its last committed step."""
    mid_step: bool
    """It had begun the next one: that work is lost."""
    evaluated_step: int
    """The last step whose evaluation it completed."""


@dataclass(frozen=True)
class Fault:
    """The declaration every rank of a generation recovers from: the first one made."""

    why: str
    suspects: list[int]
    """Ranks known to be gone: the ones that left, or that the watchdog found hung."""
    reported_by: int
    detail: str
    time: float


@dataclass(frozen=True)
class Change:
    """What a recovery returns to the trainer: the new world and how it came to be."""

    env: DistEnv
    generation: int
    old_world_size: int
    lost: list[dict[str, Any]]
    """``{"rank", "host", "why"}`` for each rank of the old generation that is not in the new."""
    why: str
    step: int
    """The agreed step: the newest one a survivor committed."""
    holder: int
    """The new rank whose state every survivor takes: the first one at the agreed step."""
    steps_redone: int
    """1 when a survivor had begun the step after the agreed one, whose work is lost; else 0."""
    evaluated_step: int
    """The last step whose evaluation the new rank 0 completed (and logged)."""
    detected: float
    """``time.monotonic()`` when this rank learned of the fault."""
    detected_at: float
    """``time.time()`` then."""


@dataclass(frozen=True)
class Connections:
    """A process's connections to the coordination store besides its main one, opened at start
    and used by every generation in turn."""

    declare: dist.Store
    """Declarations, from the training thread and the watchdog's; the round's guard; the
    pulse (see :class:`Pulses`). None of them waits on it."""
    watch: dist.Store
    """The watcher thread's, which waits to be woken."""
    group: Spares
    """The process group's: gloo's rendezvous, one for each creation under way."""
    watchdog: dist.Store
    """The watchdog's: heartbeats, and the verdict on a hang."""

    @classmethod
    def open(cls, store: dist.Store) -> Connections:
        return cls(declare=store.clone(), watch=store.clone(), group=Spares(store),
                   watchdog=store.clone())


class Spares:
    """Connections to the coordination store that a group's creation takes and gives back: one
    in use, one spare. A creation given up on can wait on its connection until the group's
    timeout (for a member that never came); the next round takes the spare instead of opening
    one in the middle of the recovery, and :meth:`replenish` opens its replacement once the
    change is over."""

    def __init__(self, store: dist.Store, count: int = 2):
        self._store, self.count = store, count
        self._idle = [store.clone() for _ in range(count)]
        self._lock = threading.Lock()

    def take(self) -> dist.Store:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        log.warning("every spare connection to the coordination store still waits in a group "
                    "given up on: opening one during the recovery")
        return self._store.clone()

    def give_back(self, connection: dist.Store) -> None:
        with self._lock:
            if len(self._idle) < self.count:
                self._idle.append(connection)

    def idle(self) -> int:
        with self._lock:
            return len(self._idle)

    def replenish(self) -> None:
        """Opens what the last recovery took and has not given back (outside any recovery)."""
        while self.idle() < self.count:
            self.give_back(self._store.clone())


class NullMembership:
    """No recovery in process (one node, ``--recovery restart``, NCCL under ``auto``): collectives
    are waited on as they are, and a failure ends the worker as it always did."""

    in_process = False
    faulted: Fault | None = None
    broken: str | None = None
    """Why this generation's collectives fail (None while it is whole): a fault was declared, or
    a collective failed."""

    def guard(self, future: torch.futures.Future) -> torch.futures.Future:
        return future

    def declare(self, why: str, suspects: list[int], detail: str = "") -> Fault | None:
        return None

    def recover(self, position: Position, why: str = "died", suspects: tuple[int, ...] = (),
                detail: str = "") -> Change:
        raise CannotRecover("recovery in process is off")

    def recovered(self) -> None:
        """The first step after a change completed."""

    def run(self, phase: str, work: Callable[[], Any]) -> Any:
        """``work()``: the collectives of a recovery's ``phase``."""
        return work()

    def fall_back(self, reason: str) -> None:
        """This rank cannot go on in process: one line and one record say where and why."""

    def inject(self, phase: str) -> None:
        """Fault injection at a recovery's ``phase`` (faults.py), for tests."""

    def generation_store(self) -> dist.Store | None:
        return None

    def dropped(self) -> Over | None:
        """Why this process is no longer one of the job's ranks, or None: see :class:`Fence`."""
        return None

    def release_agents(self) -> None:
        """At the job's end: nothing to release."""

    def close(self) -> None:
        pass


class Membership(NullMembership):
    """One worker's view of its group: the generation, the agreement on the next, the new group.

    Lives as long as the process; its generation moves on at each change.
    """

    in_process = True

    def __init__(self, env: DistEnv, device: torch.device, store: dist.Store, generation: int,
                 pg_timeout_s: float, bound_s: float, folder: Path | None = None,
                 launch: str = "", agents: NoAgents | None = None):
        """``store``: the coordination store, under this launch's own prefix; ``bound_s``: how
        long after a fault the survivors may take to complete a step before they give up;
        ``folder``: the checkpoint folder, where the job's current generation is mirrored
        (``GENERATION_FILE``) for the launch ``launch``; ``agents``: the launcher's agents, the
        membership's one face to them (torchrun's of ``env``'s rendezvous by default)."""
        self.env, self.device = env, device
        self.folder, self.launch = (None if folder is None else Path(folder)), launch
        self.store = store
        self.generation = generation
        self.pg_timeout = datetime.timedelta(seconds=pg_timeout_s)
        self.bound_s = bound_s
        self.launch_agents = env.group_world_size
        """Agents of the rendezvous round this launch started in (all meet at the exit barrier)."""
        self.identity = Identity(platform.node(), os.getpid(), os.getppid(), env.local_rank,
                                 nonce=secrets.token_hex(8))
        self.agents: set[tuple[str, int]] | None = None
        """The agents of the current generation's members; None until a change: the launch's."""
        self.gone_agents = 0
        """Agents of the launch's round that changes removed (no rank of theirs is left): they
        never come to torchrun's exit barrier."""
        self.faulted = None
        self.broken = None
        self._lock = threading.RLock()
        self._group_lock = threading.Lock()
        """Held while the default group is aborted or destroyed, and the generation moved on."""
        self._pending: set[torch.futures.Future] = set()
        self._declaring = threading.Lock()
        self._deadline: threading.Timer | None = None
        self._refilling: threading.Thread | None = None
        """Opens the spare connections a change took, once it is over."""
        self._closed = False
        self._connections = Connections.open(store)
        self._watcher: threading.Thread | None = None
        self.launcher = agents if agents is not None else agents_for(env)
        """The launcher's agents (torchrun_agents.py): kept in the rendezvous, released at
        the end."""
        agent_addr = self.launcher.join(store, self.identity.agent, env.group_rank)
        self.identity = dataclasses.replace(self.identity, agent_addr=agent_addr)
        self.round: int | None = self.launcher.round
        """The rendezvous round this process's agent is in (None: no rendezvous)."""
        self.pulse_key = pulse_key(self.identity)
        self._connections.declare.add(self.pulse_key, 1)  # exists before this rank says who it is
        self._pulse_keys: dict[int, str] = {}
        """The current generation's members' pulse keys, once a recovery has named them."""
        self.phase = "detecting the fault"
        """Where a recovery stands, to say where it failed."""
        self.failure = ""
        """Why the last round of a recovery failed."""
        self.inject: Callable[[str], None] = lambda phase: None
        self.on_fallback: Callable[[dict[str, Any]], None] = lambda record: None
        """Writes the ``fallback`` record where this rank can (job.py)."""
        self._change: Change | None = None
        """The change being recovered, until the first step after it: a fault meanwhile
        widens it (see :meth:`recover`)."""
        self._origin: list[int] = []
        """For each rank of the current generation, its rank where the change began."""
        threading.Thread(target=self._pulse, daemon=True, name="membership-pulse").start()
        self._start_generation()
        self.launcher.guard(self._connections.declare, Members(
            agent=self.identity.agent, closed=lambda: self._closed,
            generation=lambda: self.generation, rank=lambda: self.env.rank,
            local_rank=lambda: self.env.local_rank, agents=self._member_agents))

    # --- the generation's keys --------------------------------------------------------------------

    def generation_store(self) -> dist.Store:
        """This generation's own prefix of the coordination store, on its watchdog's connection."""
        return dist.PrefixStore(f"g{self.generation}", self._connections.watchdog)

    def _key(self, name: str, generation: int | None = None) -> str:
        return f"g{self.generation if generation is None else generation}/{name}"

    def _start_generation(self) -> None:
        self.store.set(self._key(f"id/{self.env.rank}"), json.dumps(asdict(self.identity)))
        # The last generation's watcher was woken by the fault's declaration and is done: its
        # connection is free (a new one only if it still waits, for a store that stalls).
        if self._watcher is not None:
            self._watcher.join(timeout=2)
        store = (self._connections.watch if self._watcher is None or not self._watcher.is_alive()
                 else self.store.clone())
        self._watcher = threading.Thread(target=self._watch, daemon=True,
                                         args=(self.generation, self.env.rank, store),
                                         name=f"membership-watch-g{self.generation}")
        self._watcher.start()

    def _watch(self, generation: int, rank: int, store: dist.Store) -> None:
        """Waits to be woken (by a declaration, or by :meth:`close`); then, for a declared fault,
        gives up on every collective of the generation."""
        store.set_timeout(WATCH_TIMEOUT)
        try:
            store.wait([self._key(f"wake/{rank}", generation)])
            if self._closed:
                return
            fault = Fault(**json.loads(store.get(self._key("fault", generation))))
        except Exception as e:  # noqa: BLE001 - the coordination store went: nothing to agree on
            log.warning("the coordination store does not answer (%s); a lost node now ends "
                        "the job", _first_line(e))
            return
        self.abort(fault, generation)  # nothing if the generation is over meanwhile

    def close(self) -> None:
        """Stops watching (the job has ended)."""
        self._closed = True
        with contextlib.suppress(RuntimeError):
            self.store.set(self._key(f"wake/{self.env.rank}"), "closed")

    def _pulse(self) -> None:
        """Raises this process's pulse every PULSE_S while it lives: see :class:`Pulses`."""
        while not self._closed:
            time.sleep(PULSE_S)
            with contextlib.suppress(RuntimeError):  # a store that stalls: the readers see it
                self._connections.declare.add(self.pulse_key, 1)

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
                self.broken = self.broken or f"a collective failed: {_first_line(error)}"
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
        store = self._connections.declare
        with self._declaring:
            env, current = self.env, self.generation  # keys of one generation, read once
            if generation is not None and generation != current:
                log.info("a verdict on generation %d dropped (%s %s): the group is at %d now",
                         generation, why, suspects, current)
                return None
            fault = Fault(why, sorted(suspects), env.rank, detail, time.time())
            agreed = store.compare_set(self._key("fault", current), "", json.dumps(asdict(fault)))
            # Every rank that declares wakes every rank: one that dies between the two writes
            # leaves the waking to the others.
            wake = [self._key(f"wake/{r}", current) for r in range(env.world_size)]
            store.multi_set(wake, ["fault"] * len(wake))
        return Fault(**json.loads(agreed))

    # --- recovery ---------------------------------------------------------------------------------

    def recover(self, position: Position, why: str = "died", suspects: tuple[int, ...] = (),
                detail: str = "") -> Change:
        """Agrees with the other survivors on who is left, and builds their new process group.

        Returns the change: since the last one's first step, if a fault came before it (in
        the recovery itself), so that the lost of every round are in one. Raises
        CannotRecover when this rank is not among the survivors or the coordination store does
        not answer; PeerFailure when the new group lost a member too (the next round follows).
        """
        detected, detected_at = time.monotonic(), time.time()
        self._arm_deadline()
        self.phase = "agreeing on who is left"
        try:
            fault = self.declare(why, list(suspects), detail)
            self.abort(fault)
            self.inject(self.phase)
            self.store.set(self._key(f"in/{self.env.rank}"), json.dumps(asdict(position)))
            self.store.add(self._key("arrivals"), 1)
            self.inject("checked in")
            identities = self._identities()
            pulses = Pulses(self.store, {r: pulse_key(i) for r, i in identities.items()},
                            self.pulse_key)
            expected = set(range(self.env.world_size)) - set(fault.suspects)
            members = close_membership(self.store, self._key(""), expected, fault.suspects,
                                       pulses, limit_s=self.bound_s / 2)
            if self.env.rank not in members:
                raise CannotRecover(f"the other ranks went on without this one (rank "
                                    f"{self.env.rank}) after the fault at generation "
                                    f"{self.generation}")
            positions = [Position(**json.loads(value)) for value in self.store.multi_get(
                [self._key(f"in/{r}") for r in members])]
        except RuntimeError as e:  # DistStoreError, DistNetworkError: the store went
            raise CannotRecover(f"the coordination store does not answer: {_first_line(e)}") \
                from None
        step = max(p.step for p in positions)
        env = successor_env(self.env, members, identities)
        lost = [{"rank": r, "host": identities[r].host,
                 "why": fault.why if r in fault.suspects else "died"}
                for r in range(self.env.world_size) if r not in members]
        change = Change(env=env, generation=self.generation + 1,
                        old_world_size=self.env.world_size, lost=lost, why=fault.why, step=step,
                        holder=next(i for i, p in enumerate(positions) if p.step == step),
                        steps_redone=int(any(p.mid_step and p.step == step for p in positions)),
                        evaluated_step=positions[0].evaluated_step, detected=detected,
                        detected_at=detected_at)
        change = self._widen(change, members)
        try:
            self._next_generation(change, identities, members)
        except PeerFailure:
            raise
        except RuntimeError as e:  # the store went as the generation began: said in one line
            raise CannotRecover(f"the coordination store does not answer: {_first_line(e)}") \
                from None
        return change

    def _widen(self, change: Change, members: list[int]) -> Change:
        """``change`` as one with the change still being recovered, if any: from the world that
        one began in, every rank lost on the way (numbered as there)."""
        earlier = self._change
        origin = self._origin if earlier is not None else list(range(self.env.world_size))
        self._origin = [origin[r] for r in members]
        lost = [{**gone, "rank": origin[gone["rank"]]} for gone in change.lost]
        if earlier is not None:
            change = dataclasses.replace(
                change, old_world_size=earlier.old_world_size,
                lost=sorted(earlier.lost + lost, key=lambda gone: gone["rank"]), why=earlier.why,
                steps_redone=max(earlier.steps_redone, change.steps_redone),
                detected=earlier.detected, detected_at=earlier.detected_at)
        self._change = change
        return change

    def _identities(self, store: dist.Store | None = None) -> dict[int, Identity]:
        """Every rank's identity as it published it (read on ``store``, the main connection by
        default); a rank lost before it could is unknown."""
        store = store or self.store
        found = {}
        for rank in range(self.env.world_size):
            key = self._key(f"id/{rank}")
            found[rank] = (Identity(**json.loads(store.get(key)))
                           if store.check([key]) else UNKNOWN)
        return found

    def _next_generation(self, change: Change, identities: dict[int, Identity],
                         members: list[int]) -> None:
        """Leaves the failed group to its threads and joins the survivors' new one."""
        # A verdict declared meanwhile names ranks of one generation; a watcher of the last one
        # acts in it or not at all.
        with self._group_lock:
            if dist.is_initialized():
                # gloo's threads may still wait in the old group (for a frozen peer, until its
                # timeout); it is not destroyed while they do: whatever holds it keeps it alive.
                dist.destroy_process_group()
            with self._declaring, self._lock:
                self.env, self.generation = change.env, change.generation
                self.faulted = self.broken = None
        agents = {(identities[r].host, identities[r].agent) for r in members}
        self.gone_agents += (self.launch_agents if self.agents is None else len(self.agents)) \
            - len(agents)
        self.agents = agents
        self._pulse_keys = {new: pulse_key(identities[old]) for new, old in enumerate(members)}
        self._publish_current([identities[r] for r in members])
        self._start_generation()
        # The group is built in a thread, and made the default one here, in the training
        # thread, only once it is complete: a creation given up on (a member frozen) may still
        # complete later, and then changes nothing. Its connection, which it may hold until
        # the group's timeout, is one of the spares. gloo is done with it once connected;
        # NCCL is not (its later communicators, a split, meet on the group's store): the
        # connection stays with an NCCL group, and the spares are refilled after the change.
        connection, generation, env = self._connections.group.take(), self.generation, self.env
        store = dist.PrefixStore(self._key("pg", generation), connection)

        def create() -> dist.Backend:
            try:
                if generation != self.generation:  # given up on before it began
                    raise PeerFailure(f"generation {generation} is over")
                return connect_group(self.device, store, env.rank, env.world_size,
                                     self.pg_timeout)
            finally:
                if backend_for(self.device) != "nccl":
                    self._connections.group.give_back(connection)

        self.inject("creating the new group")
        backend = self.run("creating the new group", create)
        install_group(backend, self.device, store, env.rank, env.world_size, self.pg_timeout)

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
        self.phase = phase
        done: torch.futures.Future = torch.futures.Future()

        def body() -> None:
            try:
                if self.device.type == "cuda":  # the current device is the thread's own
                    torch.cuda.set_device(self.device)
                done.set_result(work())
            except Exception as e:  # noqa: BLE001 - the backend's error, handed to the waiter
                done.set_exception(e)

        try:  # a generation broken already runs nothing more
            guarded = self.guard(done)
        except PeerFailure as e:
            self.failure = f"{phase}: {e}"
            raise
        threading.Thread(target=body, daemon=True, name=f"membership-g{self.generation}").start()
        finished = threading.Event()
        guarded.add_done_callback(lambda _: finished.set())
        members = self._pulse_keys
        pulses = Pulses(self.store, members, self.pulse_key) if members else None
        while not finished.wait(PULSE_S):
            try:
                silent = pulses.silent() - {self.env.rank} if pulses is not None else set()
                if silent:
                    self.declare("died", sorted(silent), f"no pulse from rank(s) "
                                 f"{', '.join(map(str, sorted(silent)))} while {phase}")
            except RuntimeError as e:  # DistStoreError: the store went, nobody to agree with
                self.failure = f"{phase}: the coordination store does not answer"
                raise CannotRecover(f"{self.failure}: {_first_line(e)}") from None
        try:
            return guarded.wait()
        except PeerFailure as e:
            self.failure = f"{phase}: {e}"
            raise

    # --- the job's current generation, for the fence (fence.py) -----------------------------------

    def _publish_current(self, kept: list[Identity]) -> None:
        """Names this generation the job's current one, with the processes of the last that it
        ``kept``: every survivor writes the same, before the new group is built, so before any
        of them commits in it; never over a later one."""
        value = json.dumps({"generation": self.generation,
                            "kept": [i.key for i in kept]})
        store, found = self._connections.declare, ""
        while (found := store.compare_set(CURRENT, found, value).decode()) != value:
            if json.loads(found)["generation"] >= self.generation:
                return
        self._mirror_current(json.loads(value))

    def _mirror_current(self, current: dict[str, Any]) -> None:
        """Writes the generation just named into the checkpoint folder (each node's local rank
        0 of it: node-local folders each get theirs), never over a later one of this launch."""
        if self.folder is None or self.env.local_rank != 0:
            return
        try:
            found = read_generation_file(self.folder)
            if found is not None and found.get("launch") == self.launch \
                    and found["generation"] >= self.generation:
                return
            atomic_write_bytes(self.folder / GENERATION_FILE,
                               json.dumps({"launch": self.launch, **current}).encode())
        except OSError as e:  # the store's copy is the one asked first
            log.warning("could not mirror generation %d into %s: %s", self.generation,
                        self.folder / GENERATION_FILE, e.strerror or e)

    def dropped(self) -> Over | None:
        """Why this process is no longer one of the job's ranks (the survivors of a fault went
        on in a generation without it), or None while it is, or is on its way to the current
        generation as one of the processes it kept, or left it of its own accord (its last
        records are its own).

        When the store does not answer (an outage, or its host gone first as the whole job
        stops), the checkpoint folder's ``GENERATION_FILE`` decides: dropped when it names a
        later generation of this launch that did not keep this process; else CannotTell (a
        commit goes on: the final checkpoint of a job stopped as a whole is written)."""
        generation, rank = self.generation, self.env.rank
        me = self.identity.key
        store = self._connections.declare
        try:
            if not store.check([CURRENT]):
                return None
            current = json.loads(store.get(CURRENT))
            if still_in(current, generation, me):
                return None
            key = self._key("fault", generation)
            fault = Fault(**json.loads(store.get(key))) if store.check([key]) else None
        except RuntimeError as e:  # DistStoreError, DistNetworkError: the store went
            return self._dropped_by_file(generation, me, e)
        if fault is not None and fault.why == "left" and rank in fault.suspects:
            return None
        return Over(f"rank {rank} was dropped from the job at generation {generation} (the job "
                    f"is at {current['generation']}): leaving without writing", EXIT_DROPPED)

    def _dropped_by_file(self, generation: int, me: str, error: RuntimeError) -> Over:
        """Why this process was dropped, as the checkpoint folder's ``GENERATION_FILE`` says it
        while the store does not answer; CannotTell when it does not say so."""
        rank = self.env.rank
        found = read_generation_file(self.folder) if self.folder is not None else None
        if found is None or found.get("launch") != self.launch or still_in(found, generation, me):
            raise CannotTell(f"rank {rank} cannot tell whether it is still one of the job's "
                             f"ranks: the coordination store does not answer "
                             f"({_first_line(error)}), and {GENERATION_FILE} names no later "
                             f"generation without it")
        return Over(f"rank {rank} was dropped from the job at generation {generation} "
                    f"({GENERATION_FILE} says the job is at {found['generation']}; the "
                    f"coordination store does not answer): leaving without writing",
                    EXIT_DROPPED)

    def _arm_deadline(self) -> None:
        if self._deadline is None:
            self._deadline = threading.Timer(self.bound_s, self._give_up)
            self._deadline.daemon = True
            self._deadline.start()

    def recovered(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._change = None
        self.phase, self.failure = "detecting the fault", ""
        if self._connections.group.idle() < self._connections.group.count:
            # The spare a second fault took, or an NCCL group keeps: opened off the training
            # thread (a new connection can wait seconds on the store's resolver, on every
            # survivor at once), and a store gone meanwhile is one warning, no traceback.
            self._refilling = threading.Thread(target=self._refill, daemon=True,
                                               name="membership-spares")
            self._refilling.start()

    def _refill(self) -> None:
        try:
            self._connections.group.replenish()
        except RuntimeError as e:  # DistStoreError, DistNetworkError: the store went
            log.warning("could not open a spare connection to the coordination store (%s): a "
                        "recovery opens one if it needs it", _first_line(e))

    def _member_agents(self) -> tuple[int, set[tuple[str, int]]]:
        """The generation, and the agents of its ranks as the rendezvous names them (name, pid);
        none until every rank has said who it is. All or none: the first agent to write again
        drops from the state every other whose keep-alive is still lapsed."""
        generation = self.generation
        found = self._identities(self._connections.declare).values()
        if UNKNOWN in found or generation != self.generation:
            return -1, set()
        return generation, {(i.agent_addr, i.agent) for i in found}

    def _give_up(self) -> None:
        self.fall_back(f"no step completed within {self.bound_s:.0f} s of the fault"
                       + (f" (the last round failed {self.failure})" if self.failure else ""))
        end_process(EXIT_GAVE_UP)

    def fall_back(self, reason: str) -> None:
        """One line, and a ``fallback`` record in events.jsonl where this rank can write it:
        the recovery in process failed (in which phase, why), torchrun restarts the job."""
        log.error("recovery in process failed while %s: %s; leaving, so that torchrun restarts "
                  "the job from its last checkpoint", self.phase, reason)
        record = {"phase": self.phase, "reason": reason, "rank": self.env.rank,
                  "generation": self.generation}
        try:
            self.on_fallback(record)
        except Exception as e:  # noqa: BLE001 - leaving anyway: the line above says it
            log.warning("the fallback record was not written: %s", _first_line(e))

    # --- the job's end ----------------------------------------------------------------------------

    def release_agents(self) -> None:
        """Rank 0, at the end: the launcher's agents that a change removed, or whose workers
        found them dead, are released from its exit barrier (see :meth:`TorchrunAgents.release`)."""
        if self.env.is_main:
            self.launcher.release(self.store, self.gone_agents,
                                  lambda: self._member_agents()[1], self.launch_agents)


def still_in(current: dict[str, Any], generation: int, me: str) -> bool:
    """Whether the job's ``current`` generation (``{"generation", "kept"}``) leaves the process
    ``me`` of ``generation`` one of its ranks: it is no later, or the next one, which kept it."""
    return current["generation"] <= generation or (current["generation"] == generation + 1
                                                   and me in current["kept"])


def read_generation_file(folder: Path) -> dict[str, Any] | None:
    """The checkpoint folder's ``GENERATION_FILE``; None when there is none or it is unreadable."""
    try:
        found = json.loads((Path(folder) / GENERATION_FILE).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(found, dict) and isinstance(found.get("generation"), int) \
        and isinstance(found.get("kept"), list)
    return found if ok else None


def close_membership(store: dist.Store, prefix: str, expected: set[int], excluded: list[int],
                     pulses: Pulses, limit_s: float) -> list[int]:
    """The survivors, as the first rank to close the membership saw them: every rank that checked
    in (``{prefix}in/<rank>``) once all ``expected`` have, but for those whose pulse stopped,
    or once ``limit_s`` has passed; never one of ``excluded``."""
    key = f"{prefix}members"
    count, present, silent = -1, set(), set()
    start = next_read = time.monotonic()
    while not store.check([key]):
        arrivals = store.add(f"{prefix}arrivals", 0)
        if arrivals != count:
            count = arrivals
            present = {rank for rank in expected | set(excluded)
                       if store.check([f"{prefix}in/{rank}"])} - set(excluded)
        now = time.monotonic()
        if now >= next_read:
            silent, next_read = pulses.silent(), now + PULSE_S
        if present >= expected - silent or now - start >= limit_s:
            store.compare_set(key, "", json.dumps(sorted(present)))
            break
        time.sleep(0.005)
    return json.loads(store.get(key))


class Pulses:
    """Who is still there, by the pulses in the coordination store: a process is silent when its
    pulse stood still while the reader's own moved SILENT_PULSES times. Measured by the reader's
    own pulse, not its clock: a store that stalls, or a reader starved of CPU, holds back both."""

    def __init__(self, store: dist.Store, keys: dict[int, str | None], own: str):
        """``keys``: each rank's pulse key (None for a rank that never said who it was)."""
        self.store, self.keys, self.own = store, keys, own
        self.seen: dict[int, tuple[int, int]] = {}
        """rank → (its pulse, the reader's own when it last moved)."""

    def silent(self) -> set[int]:
        known = [rank for rank, key in self.keys.items() if key is not None]
        values = [int(v) for v in self.store.multi_get([self.own]
                                                        + [self.keys[r] for r in known])]
        mine, theirs = values[0], dict(zip(known, values[1:]))
        for rank in self.keys:
            pulse = theirs.get(rank, -1)
            if self.seen.get(rank, (None,))[0] != pulse:
                self.seen[rank] = (pulse, mine)
        return {rank for rank, (_, since) in self.seen.items() if mine - since >= SILENT_PULSES}


def pulse_key(identity: Identity) -> str | None:
    """Where the process of ``identity`` raises its pulse (None: it never said who it was)."""
    return None if identity == UNKNOWN else f"pulse/{identity.key}"


def successor_env(env: DistEnv, members: list[int], identities: dict[int, Identity]) -> DistEnv:
    """This rank's place among the survivors: ranks in the order of the old ones, local ranks
    among the survivors started by the same agent, node ranks in the order nodes first appear."""
    mine = identities[env.rank]
    node = (mine.host, mine.agent)
    siblings = [r for r in members if (identities[r].host, identities[r].agent) == node]
    nodes = list(dict.fromkeys((identities[r].host, identities[r].agent) for r in members))
    return dataclasses.replace(env, rank=members.index(env.rank), world_size=len(members),
                               local_rank=siblings.index(env.rank),
                               local_world_size=len(siblings), group_rank=nodes.index(node),
                               group_world_size=len(nodes))


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
