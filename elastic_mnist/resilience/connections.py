"""A process's connections to the coordination store, opened at start and used by every
generation in turn: a recovery opens none.

torch's TCPStore server resolves every new client's address to a name inside its one event loop
(``LibUVStoreDaemon::onConnect``), and where the resolver does not answer at once every client of
the store waits, up to the resolver's timeout (5 s): 24 survivors of 32 opening theirs during a
recovery took 11.6 to 11.9 s to their first step, 1.6 s without.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Connections:
    """A process's connections to the coordination store besides its main one, opened at start
    and used by every generation in turn."""

    declare: dist.Store
    """Declarations, from the training thread and the watchdog's; the round's guard; the
    pulse (see :class:`Pulses`). None of them waits on it."""
    wake: dist.Store
    """The wake-up thread's, which waits to be woken."""
    group: Spares
    """The process group's: gloo's rendezvous, one for each creation under way."""
    watchdog: dist.Store
    """The watchdog's: heartbeats, and the verdict on a hang."""

    @classmethod
    def open(cls, store: dist.Store) -> Connections:
        return cls(declare=store.clone(), wake=store.clone(), group=Spares(store),
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

