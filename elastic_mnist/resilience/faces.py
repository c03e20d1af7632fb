"""The membership's two faces, below it and its helpers: what the loop and the job call
(:class:`NullMembership`, which is also the membership of a job that does not recover in
process), and what the membership's own helpers read of it (:class:`Member`: admissions.py,
recovery.py). membership.py's :class:`~elastic_mnist.resilience.membership.Membership` has
both; the helpers are handed it, and import nothing of it.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from elastic_mnist.errors import CannotRecover

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from elastic_mnist.env import DistEnv
    from elastic_mnist.resilience.agreement import Change, Fault, Identity, Position, PulseKey
    from elastic_mnist.resilience.connections import Connections
    from elastic_mnist.resilience.fence import Over
    from elastic_mnist.resilience.read_once import ReadOnce
    from elastic_mnist.resilience.relay import Relay


class NullMembership:
    """No recovery in process (one node, ``--recovery restart``, NCCL under ``auto``): collectives
    are waited on as they are, and a failure ends the worker as it always did."""

    in_process = False
    joining = False
    """A worker of a node joining a job that trains on, until the job admits it."""
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

    def admission_due(self) -> bool:
        """Rank 0: joining nodes are ready, and this generation decided to admit them."""
        return False

    def grow(self, position: Position) -> Change:
        raise CannotRecover("recovery in process is off: no node joins in process")

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

    def dropped_by_file(self) -> Over | None:
        """The same, where the store does not answer: as the checkpoint folder says it."""
        return None

    def release_agents(self) -> None:
        """At the job's end: nothing to release."""

    def finish(self) -> None:
        """At the job's end, before the agents are released: nothing to say."""

    def no_more_changes(self) -> None:
        """The job has no step left: no change begins, and no change's bound ends the process."""

    def close(self) -> None:
        pass


class Member(Protocol):
    """What admissions.py and recovery.py read and call of the membership that made them
    (membership.py's ``Membership``, where each is documented)."""

    env: DistEnv
    device: torch.device
    store: dist.Store
    generation: int
    joining: bool
    launch: str
    bound_s: float
    pg_timeout: datetime.timedelta
    identity: Identity
    pulse_key: PulseKey | None
    known: ReadOnce
    joined_agents: set[tuple[str, int]]
    connections: Connections
    relay: Relay
    inject: Callable[[str], None]
    on_fallback: Callable[[dict[str, Any]], None]

    def key(self, name: str, generation: int | None = None) -> str: ...

    def identities(self, store: dist.Store | None = None, generation: int | None = None,
                   world_size: int | None = None) -> dict[int, Identity]: ...

    def own_pulse(self, store: dist.Store) -> int: ...

    def guard(self, future: torch.futures.Future) -> torch.futures.Future: ...

    def abort(self, fault: Fault, generation: int | None = None) -> None: ...

    def declare(self, why: str, suspects: list[int], detail: str = "",
                generation: int | None = None) -> Fault | None: ...

    def dropped(self) -> Over | None: ...

    def move_on(self, change: Change, kept_ranks: list[int], gone: int = 0,
                joined: set[tuple[str, int]] = frozenset(),
                identities: dict[int, Identity] | None = None) -> None: ...
