"""A generation's identities (who each rank is, as it published it in the store), read at the first
look, once: the membership keeps one for its generation, offered by the change that began it or
read ahead by its watchers (membership.py); a recovery makes one where it needs another
generation's (recovery.py).
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable, Iterator, Mapping

import torch.distributed as dist

from elastic_mnist.errors import first_line
from elastic_mnist.resilience.agreement import Identity, looked_for

log = logging.getLogger(__name__)


class ReadOnce(Mapping[int, Identity]):
    """A generation's identities, read from the store at the first look, once (or offered
    before it: :meth:`offer`)."""

    def __init__(self, read: Callable[[], dict[int, Identity]], generation: int = -1):
        self._read = read
        self.generation = generation
        self._found: dict[int, Identity] | None = None
        self._lock = threading.Lock()

    def read(self, again: bool = False) -> dict[int, Identity]:
        with self._lock:
            if self._found is None or again:
                self._found = self._read()
            return self._found

    @property
    def ready(self) -> bool:
        """Read already: a look costs no store operation."""
        return self._found is not None

    def offer(self, found: dict[int, Identity]) -> None:
        """``found``, read elsewhere, where nothing was read yet."""
        with self._lock:
            if self._found is None:
                self._found = found

    def __getitem__(self, rank: int) -> Identity:
        return self.read()[rank]

    def __iter__(self) -> Iterator[int]:
        return iter(self.read())

    def __len__(self) -> int:
        return len(self.read())


def read_ahead(known: ReadOnce, store: dist.Store, keys: list[str], timeout: datetime.timedelta,
               read: Callable[[], dict[int, Identity]], moot: Callable[[], bool]) -> None:
    """A watcher of ``known``'s generation reads its identities (``read()``) once every rank
    has said who it is (``keys``, within ``timeout``), before any fault: a lost node's pulses
    are then read from the moment the fault is known, not once W identities have been (at 2,048
    simulated ranks, 0.3 s of the 2 s an agreement may take). Looked for, not waited on, on
    ``store``, the declarations' connection (quick operations only: a wait would hold it; a
    connection of its own can take seconds to open, on the store's resolver), until ``moot()``.
    Where a rank never says who it is, or the store does not answer, a recovery reads them
    itself; where the recovery that began the generation knew them already, it offered them
    (recovery.py's ``Recovery.next_generation``)."""
    try:
        if not looked_for(store, keys, timeout.total_seconds(), pause_s=0.05, most_s=1.0,
                          moot=moot):
            if not moot():
                log.debug("the identities of generation %d were not read ahead: not every "
                          "rank said who it is within %s", known.generation, timeout)
            return
        if not moot():
            known.offer(read())
    except RuntimeError as e:  # DistStoreError: the store went; a recovery says so
        log.debug("the identities of generation %d were not read ahead: %s",
                  known.generation, first_line(e))
