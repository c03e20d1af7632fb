"""The glue to torchrun's agents, read against torch 2.14.1: the one room that knows them.

Its one job: keep this process's torchrun agent in the c10d rendezvous, and say what the
membership needs of the agents, through :class:`TorchrunAgents` (or :class:`NoAgents` without a
multi-node rendezvous), the object a :class:`~elastic_mnist.resilience.membership.Membership` is
handed. The membership asks it three things: :meth:`~NoAgents.join` (the round this process's
agent is in, and its name there), :meth:`~NoAgents.guard` (a thread that renews lapsing
keep-alives and leaves when the rendezvous moved on without this node) and
:meth:`~NoAgents.release` (arrivals at the exit barrier for agents that are gone). Another agent
backend (a rendezvous of our own) replaces this room without touching the membership.

Everything below reads or writes torch's own records as its agents do (the rendezvous state's
pickle, the exit barrier's keys): private names of torch 2.14.1
(``C10dRendezvousBackend``, ``_RendezvousState``, ``_TERMINAL_STATE_SYNC_ID``, ...), checked by
tests/test_membership.py and tests/test_multinode.py when torch changes.
"""

from __future__ import annotations

import datetime
import io
import logging
import os
import pickle
import platform
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastic_mnist.distributed import end_process
from elastic_mnist.env import DistEnv, Rendezvous
from elastic_mnist.errors import EXIT_DROPPED, first_line

log = logging.getLogger(__name__)

CHECKED_TORCH = ("2.14.1",)
"""The torch versions whose private rendezvous records this room was read against and tested
with (``make test``); under another, :meth:`TorchrunAgents.unusable` finds out at start whether
they still hold."""
ROUND_CHECK_S = 2.0
"""How often each rank reads the rendezvous round (:meth:`TorchrunAgents.guard`): well within
the seconds a node that starts a round alone takes to its first checkpoint. A node's local rank
0 reads it at least once per keep-alive interval of its agent, to renew a lapsing one."""


@dataclass(frozen=True)
class Members:
    """What the guard asks of the membership, each time it asks (they change with generations)."""

    agent: int
    """This process's agent's pid."""
    closed: Callable[[], bool]
    generation: Callable[[], int]
    rank: Callable[[], int]
    local_rank: Callable[[], int]
    agents: Callable[[], tuple[int, set[tuple[str, int]]]]
    """The generation, and the agents of its ranks (name in the rendezvous, pid); ``(-1, set())``
    until every rank has said who it is."""


class NoAgents:
    """No multi-node rendezvous: no round to keep, no exit barrier to open for anyone."""

    round: int | None = None
    """The rendezvous round this process's agent is in (None: none)."""
    name = ""
    """The agent's name in the rendezvous."""

    def join(self, store: dist.Store, agent: int, group_rank: int) -> str:
        """The agent's name in the rendezvous (sets :attr:`round`); empty without one."""
        return ""

    def unusable(self, store: dist.Store) -> str | None:
        """Why the agents' records cannot be kept from this process, in words (the faults are
        then recovered by a restart); None where they can."""
        return None

    def guard(self, store: dist.Store, members: Members) -> None:
        """Keeps the agents in the rendezvous from a thread, while ``members`` is open."""

    def release(self, store: dist.Store, gone: int,
                members: Callable[[], set[tuple[str, int]]], launch_agents: int) -> None:
        """At the job's end, rank 0: nothing to release."""


def agents_for(env: DistEnv) -> NoAgents:
    """torchrun's agents of ``env``'s c10d rendezvous, or none (none either under our own
    rendezvous, whose handler keeps its agents itself)."""
    rdzv = env.rendezvous
    return TorchrunAgents(rdzv) if rdzv is not None and rdzv.backend == "c10d" else NoAgents()


class TorchrunAgents(NoAgents):
    """The torchrun agents of one c10d rendezvous, as one worker sees and keeps them."""

    def __init__(self, rdzv: Rendezvous):
        self.rdzv = rdzv

    def unusable(self, store: dist.Store) -> str | None:
        """None where torch keeps the c10d rendezvous as the torch versions this room was read
        against did (:data:`CHECKED_TORCH`): its state reads, and lists agents by name and pid
        in rounds. Else what failed, in one line."""
        try:
            # What the job's end needs too (arrive_at_exit_barrier, _unprefixed).
            from torch.distributed.elastic.agent.server.api import (  # noqa: F401
                _TERMINAL_STATE_SYNC_ID,
            )
            from torch.distributed.elastic.utils.store import (  # noqa: F401
                _LAST_MEMBER_CHECKIN,
                _NUM_MEMBERS,
            )

            _unprefixed(dist.PrefixStore("probe", store))
            state, _ = RendezvousReader(store, self.rdzv.run_id).read()
            int(state.round)
            for node in state.participants:
                str(node.addr), int(node.pid)
            dict(state.last_heartbeats)
        except Exception as e:  # noqa: BLE001 - any failure means: not the torch we read
            return (f"torch {torch.__version__}'s c10d rendezvous state is not as this code read "
                    f"it in torch {', '.join(CHECKED_TORCH)} ({type(e).__name__}: "
                    f"{first_line(e)})")
        return None

    def join(self, store: dist.Store, agent: int, group_rank: int) -> str:
        """The rendezvous round this process's agent is in, and the agent's name there (torch
        names it by its own host's name, which this process's resolver may not give back).
        Leaves at once, writing nothing, when the current round does not list the agent: its
        keep-alives lapsed, the rendezvous dropped it, and a round that another node started
        is no round of this process's (see :meth:`guard`)."""
        rdzv = self.rdzv
        state, _ = RendezvousReader(store, rdzv.run_id).read()
        names = [rdzv.local_addr or socket.getfqdn(), platform.node()]
        name = agent_name(state, agent, names, rank=group_rank)
        if name is None:
            log.error("the rendezvous is in round %d, which does not list this node's torchrun "
                      "agent (pid %d; its keep-alives lapsed): leaving, so that torchrun "
                      "restarts this node into the job", state.round, agent)
            end_process(EXIT_DROPPED)
        self.round, self.name = state.round, name
        return name

    def guard(self, store: dist.Store, members: Members) -> None:
        threading.Thread(target=self._guard, args=(store, members), daemon=True,
                         name="membership-round").start()

    def _guard(self, store: dist.Store, members: Members) -> None:
        """Keeps this process's agent in the rendezvous, and leaves at once when the rendezvous
        has moved on to a round without it.

        torch's rendezvous drops an agent whose keep-alives lapsed, and torch's agent stops
        sending them for good once its own has lapsed in the store (a store that stalls, a
        machine starved of CPU; see :meth:`RendezvousReader.renew`). So each node's local rank
        0, while its agent lives, renews the keep-alives of every agent of the generation's
        ranks where they are nearly lapsed (a node that is gone has no rank left among them),
        but for agents that are dead while their workers live on (an agent SIGKILLed alone:
        torchrun starts its workers in sessions of their own): each rank whose parent is no
        longer its agent says so in the store, and that agent is left to lapse.

        When the rendezvous has dropped every agent of a round all the same, the next node to
        come starts a new round alone and trains beside the job, into its folders, while the
        dropped agents, who see no node waiting, leave their workers alone. Nothing else moves
        the round while workers of the last one run: agents that restart their workers leave
        the round only once those have exited, and a new round begins only when every agent
        has left the last one. So a process that sees a newer round stops, writing nothing
        more; its agent restarts it into the new round, which makes the agents there restart
        theirs, and the job is one again, from its last checkpoint."""
        rdzv = self.rdzv
        reader = RendezvousReader(store, rdzv.run_id)
        lapse_s = rdzv.keep_alive_interval_s * rdzv.keep_alive_max_attempt
        renew_after_s = lapse_s - rdzv.keep_alive_interval_s / 2
        agents: tuple[int, set[tuple[str, int]]] = (-1, set())
        orphaned = said_orphaned = False
        while not members.closed():
            orphaned = orphaned or os.getppid() != members.agent
            keeper = members.local_rank() == 0 and not orphaned
            time.sleep(min(ROUND_CHECK_S, rdzv.keep_alive_interval_s) if keeper
                       else ROUND_CHECK_S)
            try:
                if orphaned and not said_orphaned:
                    store.set(_dead_agent_key((self.name, members.agent)), str(members.rank()))
                    said_orphaned = True
                    log.warning("this node's torchrun agent (pid %d) is gone: the other nodes "
                                "no longer keep it in the rendezvous", members.agent)
                state, token = reader.read()
                renewed = None
                if keeper and state.round == self.round:
                    if agents[0] != members.generation():
                        agents = members.agents()
                    renewed = reader.renew(state, token, self._living(store, agents[1]),
                                           renew_after_s)
            except Exception:  # noqa: BLE001, S112 - the store stalls or went (torch's
                continue  # rendezvous errors are no RuntimeError): the loop's own waits tell
            if members.closed():
                return
            if state.round != self.round:
                log.error("the rendezvous moved on to round %d without this node's agent (in "
                          "round %d; its keep-alives lapsed): leaving, so that torchrun "
                          "restarts this node into the job", state.round, self.round)
                end_process(EXIT_DROPPED)
            if renewed is not None:
                log.warning("%d of this job's torchrun agents had sent no keep-alive for up to "
                            "%.1f s (the rendezvous drops one at %.0f s, and it sends none once "
                            "its own has lapsed): renewed in their place", *renewed, lapse_s)

    def _living(self, store: dist.Store, agents: set[tuple[str, int]]) -> set[tuple[str, int]]:
        """``agents`` but those that their own workers found dead (see :meth:`_guard`)."""
        return {agent for agent in agents if not store.check([_dead_agent_key(agent)])}

    def release(self, store: dist.Store, gone: int,
                members: Callable[[], set[tuple[str, int]]], launch_agents: int) -> None:
        """Arrives at torchrun's exit barrier for the agents that never will (``gone``: those a
        change removed, their node died, left, or froze; and those of ``members`` that died
        alone, their workers still ``members()``), so that the surviving agents exit as soon as their
        workers have, instead of waiting ``exit_barrier_timeout`` (300 s) for them. Rank 0 does
        it, once, at the end; after a run without a change, for none (an arrival for a live
        agent opens the barrier early: the agent serving the store may then exit while another
        still watches its workers). ``launch_agents``: the agents of the round the launch
        started in."""
        run_id = self.rdzv.run_id
        try:
            agents = members()
            missing = gone + len(agents - self._living(store, agents))
            if missing <= 0:
                return
            round_ = rendezvous_round(store, run_id)
            if round_ != self.round:
                raise ValueError(f"the rendezvous is in round {round_}, this job's agents were "
                                 f"in {self.round}")
            arrive_at_exit_barrier(store, run_id, round_, missing, launch_agents)
        except Exception as e:  # noqa: BLE001 - a job that trained ends, whatever torch did
            log.warning("could not release the agents of the nodes that are gone (%s): the "
                        "others wait for them up to torchrun's exit barrier timeout (300 s)",
                        first_line(e))
            return
        log.info("arrived at the exit barrier of rendezvous round %d for %d agent(s) that are "
                 "gone", round_, missing)


def _dead_agent_key(agent: tuple[str, int]) -> str:
    """Where a worker whose agent (name in the rendezvous, pid) died says so."""
    return f"dead-agent/{agent[0]}/{agent[1]}"


# --- torchrun's own records, read and written as its agents do -------------------------------------


class _StateUnpickler(pickle.Unpickler):
    """The rendezvous state is a pickle (``_BackendRendezvousStateHolder``): only its own
    classes are loaded, never anything else a store's writer might have put there."""

    ALLOWED = frozenset({
        ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_RendezvousState"),
        ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_NodeDesc"),
        ("datetime", "datetime"), ("datetime", "timezone"), ("datetime", "timedelta")})

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"unexpected {module}.{name} in the rendezvous state")
        return super().find_class(module, name)


class RendezvousReader:
    """The state of the c10d rendezvous ``run_id`` that its agents keep in ``store`` (the raw
    store, no prefix), read as their own backend reads it; and one agent's keep-alive renewed
    in it, as that agent writes it."""

    def __init__(self, store: dist.Store, run_id: str):
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
            C10dRendezvousBackend,
        )

        self.run_id = run_id
        self._backend = C10dRendezvousBackend(_unprefixed(store), run_id)

    def read(self) -> tuple[Any, Any]:
        """The state (torch's ``_RendezvousState``) and its token, for :meth:`renew`."""
        found = self._backend.get_state()
        if found is None:
            raise ValueError(f"no rendezvous state for {self.run_id}")
        return _StateUnpickler(io.BytesIO(found[0])).load(), found[1]

    def __call__(self) -> int:
        """The round the agents are in."""
        return self.read()[0].round

    def renew(self, state: Any, token: Any, agents: set[tuple[str, int]], older_than_s: float,
              ) -> tuple[int, float] | None:
        """Renews, in ``state``, the keep-alives of the participants among ``agents`` (name in
        the rendezvous, pid) whose last one is older than ``older_than_s``, in one
        compare-and-set on ``token``, so that nothing another writer wrote since is lost. How
        many it renewed and the oldest one's age, when it did.

        An agent of torch 2.14 whose own keep-alive in the store is older than the rendezvous
        keeps a node (``keep_alive_interval × keep_alive_max_attempt``) never sends another:
        every read drops the lapsed entries from its copy of the state, its own with them, and
        ``_should_keep_alive`` finds no entry of its own to renew. A store that stalls that long
        does it to every agent at once (``make chaos32``: 32 workers connecting, each new
        client's name looked up in the store's one event loop); the first agent to write again
        then drops the others, and the next node to join drops them all and starts a round
        alone. Renewed together, every agent reads its own entry again and goes on renewing it
        by itself."""
        now = datetime.datetime.now(datetime.timezone.utc)
        ages = {node: (now - last).total_seconds() for node, last in state.last_heartbeats.items()
                if (node.addr, node.pid) in agents and node in state.participants}
        lapsing = {node: age for node, age in ages.items() if age > older_than_s}
        if not lapsing:
            return None
        state.last_heartbeats.update(dict.fromkeys(lapsing, now))
        written = self._backend.set_state(pickle.dumps(state), token)
        return (len(lapsing), max(lapsing.values())) if written is not None and written[2] \
            else None


def agent_name(state: Any, pid: int, names: list[str], rank: int) -> str | None:
    """The name this host's torchrun agent of pid ``pid`` and rank ``rank`` in the round
    (``GROUP_RANK``) goes by among the participants of the rendezvous ``state`` (torch's
    ``_NodeDesc``: the agent's ``--local_addr`` or its host's fully qualified name, its pid;
    ``participants`` maps each to its rank): the only such participant, else the one of them
    named as this host is (``names``), else ``names[0]``. None when no participant of that pid
    holds that rank: the round does not list the agent (agents in containers share pids)."""
    mine = [node.addr for node, at in state.participants.items() if node.pid == pid and at == rank]
    if not mine:
        return None
    named = [addr for addr in mine if addr in names]
    return mine[0] if len(mine) == 1 else named[0] if len(named) == 1 else names[0]


def rendezvous_round(store: dist.Store, run_id: str) -> int:
    """The round of the c10d rendezvous ``run_id`` that its agents are in."""
    return RendezvousReader(store, run_id)()


def arrive_at_exit_barrier(store: dist.Store, run_id: str, round_: int, count: int,
                           agents: int) -> None:
    """Counts ``count`` arrivals at the exit barrier that the ``agents`` agents of rendezvous
    round ``round_`` wait in at their end, as each of them does for itself
    (``torch.distributed.elastic.utils.store.barrier`` under the round's prefix)."""
    from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
    from torch.distributed.elastic.utils.store import _LAST_MEMBER_CHECKIN, _NUM_MEMBERS

    barrier = dist.PrefixStore(f"torch.rendezvous.{run_id}.{round_}", _unprefixed(store))
    arrived = barrier.add(_TERMINAL_STATE_SYNC_ID + _NUM_MEMBERS, count)
    if arrived == agents:  # the last arrival lets everyone go, as the last agent would
        barrier.set(_TERMINAL_STATE_SYNC_ID + _LAST_MEMBER_CHECKIN, "<val_ignored>")


def _unprefixed(store: dist.Store) -> dist.Store:
    return store._underlying_non_prefix_store if isinstance(store, dist.PrefixStore) else store
