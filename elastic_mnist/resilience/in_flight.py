"""Calls that a silent connection may hold (a store or a mount across a link cut silently, an
outage), made in daemon threads of their own and waited for a bound: what waits for them waits
the bound at most, and a held call is left to its thread, never holding the process's exit.

In torch 2.14.1 a store call on a connection whose peer went silent waits past the store's own
timeout, as long as TCP keeps the connection (about 15 minutes), and so does the opening of a
connection whose peer accepts and then says nothing (``tests/test_silent_store.py``).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def within(call: Callable[[], T], bound_s: float, name: str) -> T:
    """``call()``'s result (or its error) where it returns within ``bound_s``; TimeoutError
    otherwise, the call left to a daemon thread named ``name``."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(call())
        except BaseException as e:  # noqa: BLE001 - handed to the caller, if it still waits
            future.set_exception(e)

    threading.Thread(target=run, daemon=True, name=name).start()
    return future.result(bound_s)


class InFlight:
    """A question asked in a daemon thread of its own (one that a silent store or folder holds
    never holds the process's exit), one at a time: a check while one is in flight waits for
    that one, and each question's bound runs from when it was asked, so that a store silent for
    minutes costs the checks of those minutes the bound in all, not the bound each."""

    def __init__(self, ask: Callable[[], Any], name: str, found: Callable[[Any], None]):
        """``ask()``: the question; ``found(answer)``: told every answer, in the asking thread,
        waited for or not."""
        self._ask, self._name, self._found = ask, name, found
        self._lock = threading.Lock()
        self._future: concurrent.futures.Future | None = None
        self._asked_at = 0.0

    def result(self, bound_s: float, wait_s: Callable[[bool, float], float]) -> Any:
        """The answer of the question in flight, or of one asked now, waited for
        ``wait_s(in_flight, left)`` seconds (``left``: what remains of ``bound_s`` since it was
        asked); the question's error, or TimeoutError."""
        with self._lock:
            future, in_flight = self._future, True
            if future is None or future.done():
                future, in_flight = concurrent.futures.Future(), False
                self._future, self._asked_at = future, time.monotonic()
                threading.Thread(target=self._answer, args=(future,), daemon=True,
                                 name=self._name).start()
            left = max(0.0, self._asked_at + bound_s - time.monotonic())
        return future.result(wait_s(in_flight, left))

    def pending(self) -> concurrent.futures.Future | None:
        """The question in flight, if one is."""
        with self._lock:
            future = self._future
        return None if future is None or future.done() else future

    def left(self, bound_s: float) -> float:
        """What remains of ``bound_s`` since the last question was asked."""
        with self._lock:
            return max(0.0, self._asked_at + bound_s - time.monotonic())

    def _answer(self, future: concurrent.futures.Future) -> None:
        try:
            answer = self._ask()
        except BaseException as e:  # noqa: BLE001 - handed to the check that waits for it
            future.set_exception(e)
            return
        self._found(answer)
        future.set_result(answer)
