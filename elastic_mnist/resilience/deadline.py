"""A change's bound: one timer for the change, whichever thread begins it.

A change begins in one of several threads: the watchdog's or the silence watch's, as they declare
a fault (a declaration waits for a store that may be away), or the training thread's, as it
recovers, grows or enters the job. Each arms the bound; the first one arms it, and only that
timer may end the process. It is disarmed once the change is over (its first step), and closed
once the job has no step left (no change can begin then). A declaration that fails keeps the
bound it started: its store is gone, and the process leaves at the bound in one line. Arming and
disarming race across those threads, so both hold one lock, and a timer that fires after it was
replaced or disarmed does nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Deadline:
    """The bound of the change under way, if any."""

    def __init__(self, seconds: Callable[[], float], expire: Callable[[], None]):
        """``seconds()``: the bound, read as it is armed; ``expire()``: what happens at it, in the
        timer's thread."""
        self.seconds, self.expire = seconds, expire
        self.timer: threading.Timer | None = None
        """The armed timer; None while no change is under way."""
        self.armed_at = 0.0
        """When the bound of the change under way (or the last) started (monotonic)."""
        self._lock = threading.Lock()
        self._closed = False

    def arm(self) -> bool:
        """Starts the bound, where it has not started; True where this call started it."""
        with self._lock:
            if self.timer is not None or self._closed:
                return False
            self.armed_at = time.monotonic()
            self._start(self.seconds())
            return True

    def extend(self, seconds: float) -> bool:
        """From the timer's thread at the bound: ``seconds`` more (store_wait.py); False where
        the bound was disarmed or replaced meanwhile."""
        with self._lock:
            if threading.current_thread() is not self.timer or self._closed:
                return False
            self._start(seconds)
            return True

    def _start(self, seconds: float) -> None:
        self.timer = threading.Timer(seconds, self._fire)
        self.timer.daemon = True
        self.timer.start()

    def disarm(self) -> None:
        """Stops the bound: the change is over (or the job, or the declaration that began it)."""
        with self._lock:
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None

    def close(self) -> None:
        """The job has no step left: no change begins, and no bound ends the process."""
        with self._lock:
            self._closed = True
        self.disarm()

    def during(self, call: Callable[[], T]) -> T:
        """``call()``, a fault's declaration, within the bound, which starts here where it has
        not."""
        self.arm()
        return call()

    def current(self) -> bool:
        """Whether the calling thread may end the process for the bound: not a timer replaced
        or disarmed meanwhile (a change that completed as its bound ran out)."""
        thread = threading.current_thread()
        with self._lock:
            return not isinstance(thread, threading.Timer) or thread is self.timer

    def _fire(self) -> None:
        if self.current():
            self.expire()
