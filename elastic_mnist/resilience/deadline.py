"""A change's bound: one timer for the change, whichever thread begins it.

A change begins in one of several threads: the watchdog's or the silence watch's, as they declare
a fault (a declaration waits for a store that may be away), or the training thread's, as it
recovers, grows or enters the job. Each arms the bound; the first one arms it, and only that
timer may end the process. It is disarmed once the change is over (its first step), once the job
has no step left, or where the declaration that armed it failed (nothing was declared: no change
follows). Arming and disarming race across those threads, so both hold one lock, and a timer
that fires after it was replaced or disarmed does nothing.
"""

from __future__ import annotations

import threading
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
        self._lock = threading.Lock()

    def arm(self) -> bool:
        """Starts the bound, where it has not started; True where this call started it."""
        with self._lock:
            if self.timer is not None:
                return False
            self.timer = threading.Timer(self.seconds(), self._fire)
            self.timer.daemon = True
            self.timer.start()
            return True

    def disarm(self) -> None:
        """Stops the bound: the change is over (or the job, or the declaration that began it)."""
        with self._lock:
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None

    def during(self, call: Callable[[], T]) -> T:
        """``call()``, a fault's declaration, within the bound, which starts here where it has
        not; a call that fails leaves behind no bound that it started."""
        armed = self.arm()
        try:
            return call()
        except BaseException:
            if armed:
                self.disarm()
            raise

    def _fire(self) -> None:
        with self._lock:  # replaced or disarmed meanwhile: another change's, or none
            if threading.current_thread() is not self.timer:
                return
        self.expire()
