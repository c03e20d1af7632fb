"""The node's record, written into the coordination store off the pulse's thread, and never held
by a connection that does not answer.

The worker that speaks for its node (board.py) writes the node's pulses every ``PULSE_S``. Where
that write waited in the pulse's own thread, a store that stopped answering (a link cut
silently, an outage) stopped the writer's pulse with it, and once the store was back, TCP's
retransmissions, backed off to tens of seconds by a long outage, kept the write waiting after
the heal: its node looked silent to the others for that long (``make partitions``' store
outage named rank 0 hung 25 s after the heal). So a writer thread writes the latest record only
(a record not yet written is replaced by the next), and a write that has not returned within
``STUCK_S`` is left to its connection: the next record goes on a fresh one, opened in a thread of
its own (one at a time), which reaches a store that is back at once. The opening is waited for
``CONNECT_S`` (in_flight.py: a store that accepts and then says nothing holds it as long as a
call), then the next record tries again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from elastic_mnist.errors import first_line
from elastic_mnist.resilience.in_flight import within

log = logging.getLogger(__name__)

STUCK_S = 0.5
"""A write that has not returned in this long is given up on: a store answers in milliseconds."""

CONNECT_S = 2.0
"""How long the opening of a fresh connection is waited for."""


class Speaker:
    """Writes ``key`` with the latest record it is handed, on ``store``, or on a fresh
    connection from ``fresh()`` once a write is stuck."""

    def __init__(self, store: dist.Store, key: str, fresh: Callable[[], dist.Store]):
        self.key, self._fresh = key, fresh
        self._cond = threading.Condition()
        self._pending: str | None = None
        self._closed = False
        self._writer = 0
        """The writer thread that may write: a stuck one, replaced, leaves when it returns."""
        self._since: float | None = None
        """When the writer's write in flight began (None: none in flight)."""
        self._opening = False
        self._start(store, self._writer)

    def say(self, record: str) -> None:
        """Hands the writer ``record``, in place of one it has not written yet."""
        with self._cond:
            self._pending = record
            if (self._since is not None and time.monotonic() - self._since > STUCK_S
                    and not self._opening):
                self._opening, self._writer, self._since = True, self._writer + 1, None
                threading.Thread(target=self._replace, args=(self._writer,), daemon=True,
                                 name="membership-speaker-connect").start()
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _start(self, store: dist.Store, writer: int) -> None:
        threading.Thread(target=self._write, args=(store, writer), daemon=True,
                         name="membership-speaker").start()

    def _replace(self, writer: int) -> None:
        """Opens a fresh connection for writer ``writer``."""
        try:
            store = within(self._fresh, CONNECT_S, "membership-speaker-open")
        except (RuntimeError, TimeoutError) as e:  # DistStoreError, DistNetworkError, or no
            # answer: the store is still away
            log.debug("no fresh connection for the node's record: %s", first_line(e))
            store = None
        with self._cond:
            self._opening = False
            if store is None:  # no writer now: the next record tries again
                self._since = time.monotonic() - 2 * STUCK_S
                return
        self._start(store, writer)

    def _write(self, store: dist.Store, writer: int) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed and writer == self._writer:
                    self._cond.wait()
                if self._closed or writer != self._writer:
                    return
                record, self._pending = self._pending, None
                self._since = time.monotonic()
            try:
                store.set(self.key, record)
            except RuntimeError as e:  # a broken connection: the next record replaces it
                log.debug("the node's record was not written: %s", first_line(e))
                with self._cond:
                    if writer == self._writer:
                        self._since = time.monotonic() - 2 * STUCK_S
                return
            with self._cond:
                if writer == self._writer:
                    self._since = None
