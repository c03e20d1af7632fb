"""An agent's exit barrier (agents.py), its one job: at the job's end, each agent waits for the
live agents of its job to arrive too (the dead are not waited for), and the agent serving the
store lingers until those still using it are done. torch's agent reaches it through the store
each rendezvous hands it (:class:`ExitStore`), which knows what the barrier asks of a store and
nothing else.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable

import torch.distributed as dist

from elastic_mnist.resilience.agent_settings import NAME
from elastic_mnist.resilience.roster import Liveness, Roster

log = logging.getLogger(__name__)

POLL_S = 0.05
"""How often an agent reads the store at the exit barrier."""
LINGER_S = 1.0
"""How long the agent serving the store waits, as it shuts down, for the agents at the exit
barrier to leave it (their store goes with it)."""


class ExitBarrier:
    """Agent ``serial``'s exit barrier: it waits there for the live agents of its job, and, where
    it serves the store, lingers at its end for those still using it."""

    def __init__(self, roster: Roster, serial: int, liveness: Liveness,
                 round_: Callable[[], int | None], settle: Callable[[], None] = lambda: None):
        """``round_()``: the round whose job this agent is in (the round it was last answered
        in, else the one whose job it waits to enter); ``settle()``: called before the barrier
        uses the store (the agent's monitor may still ask it, agent_monitor.py)."""
        self.roster, self.serial, self.liveness, self.round = roster, serial, liveness, round_
        self.settle = settle

    def wait(self, timeout_s: float) -> None:
        """Waits until every live agent of the job has arrived here too, at most ``timeout_s``:
        the agents of the job's last record of this round (``P job``'s nodes), else those of the
        round."""
        self.settle()
        roster = self.roster
        roster.arrive_at_exit(self.serial)
        start = time.monotonic()
        arrived: set[int] = {self.serial}
        while True:
            expected = self.expected()
            missing = [n for n in expected if n not in arrived]
            arrived |= {n for n in missing if roster.at_exit(n)}
            missing = [n for n in missing if n not in arrived]
            if missing:
                missing = sorted(set(missing) - self.liveness.dead(missing))
            if not missing:
                break
            if time.monotonic() - start >= timeout_s:
                raise dist.DistStoreError(
                    f"the exit barrier timed out after {timeout_s:g}s: agent(s) "
                    f"{', '.join(map(str, missing))} of the job are alive and have not arrived")
            time.sleep(POLL_S)
        roster.pass_exit(self.serial)

    def expected(self) -> list[int]:
        """This agent and those of its round's job (``P job``'s nodes where it runs in process,
        else the round's), with the agents that asked to join the job and were not admitted
        (their workers read in the store that the job ended without them, then their agents come
        here: the store must outlive them)."""
        round_ = self.round()
        job = self.roster.job()
        if job is not None and job.round == round_ and job.in_process:  # else it names none
            nodes = job.nodes + [n for _, n in self.roster.pending_joins(round_, job.nodes,
                                                                        set(), job)]
        else:
            nodes = self.roster.members(round_) or []
        return sorted(set(nodes) | {self.serial})

    def linger(self) -> None:
        """The agent serving the store waits, at most LINGER_S, for the other live agents to be
        done with it: those at the exit barrier to pass it, those that wait to enter the job to
        see that it ended and leave. The store goes with this process."""
        roster = self.roster
        expected = [n for n in self.expected() if n != self.serial]
        until = time.monotonic() + LINGER_S
        while time.monotonic() < until:
            others = {n for n in expected if roster.at_exit(n) and not roster.passed_exit(n)}
            others |= set(roster.waiting_agents()) - {self.serial}
            if not others - self.liveness.dead(sorted(others)):
                return
            time.sleep(POLL_S / 5)


class ExitStore(dist.Store):
    """The store torchrun's agent gets with each rendezvous, which it uses for its exit barrier
    alone (with ``TORCH_ELASTIC_WORKER_IDENTICAL=1``): ``set_timeout`` and ``timeout``, ``add``
    and ``set`` (kept under this agent's private prefix, ``P exitstore/<n>/``, whatever the key),
    and ``wait``, which is our barrier (:meth:`ExitBarrier.wait`). Anything else it is
    asked is refused with an error that names it: torch's agent asks more than ours knows."""

    ASKED = ("set_timeout", "timeout", "add", "set", "wait")

    def __init__(self, barrier: ExitBarrier, store: dist.Store, timeout_s: float):
        """``store``: the agent's connection to the rendezvous store; ``timeout_s``: the
        barrier's, unless torch's agent sets its own."""
        super().__init__()
        # Private names: the public ones of dist.Store (its barrier() among them) are refused.
        self._barrier, self._store = barrier, store
        self._timeout = datetime.timedelta(seconds=timeout_s)

    @property
    def timeout(self) -> datetime.timedelta:
        return self._timeout

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._barrier.settle()  # torch's first call: before any reaches the store
        self._timeout = timeout

    def _key(self, key: str) -> str:
        return self._barrier.roster.key(f"exitstore/{self._barrier.serial}/{key}")

    def add(self, key: str, value: int) -> int:
        self._barrier.settle()
        return self._store.add(self._key(key), value)

    def set(self, key: str, value: str | bytes) -> None:
        self._barrier.settle()
        self._store.set(self._key(key), value)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._barrier.wait((timeout or self._timeout).total_seconds())


def _refused(name: str) -> Callable[..., None]:
    def refuse(self: ExitStore, *args: object, **kwargs: object) -> None:
        message = (f"torchrun's agent asked the exit store for {name}(), which the {NAME} "
                   f"rendezvous does not provide (it knows {', '.join(ExitStore.ASKED)}): "
                   f"elastic_mnist/resilience/exit_barrier.py needs to learn this torch")
        log.error(message)
        raise RuntimeError(message)

    return refuse


for _name in dir(dist.Store):
    if not _name.startswith("_") and _name not in ExitStore.ASKED:
        setattr(ExitStore, _name, _refused(_name))
