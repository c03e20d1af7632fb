"""Whether this process may still write into the job's folders: the fence every commit passes.

A process can outlive its place in the job. A rank frozen (SIGSTOP, a wedged machine) is dropped
by the others, who go on in process in a new generation without it; a job whose checkpoint folder
another job took (``--take-over``) is no longer the folder's. Woken, such a process still holds
its writers: a queued checkpoint, ``latest``, events.jsonl, TensorBoard, its audit file. So each
writer asks the fence right before it commits (each rename of a checkpoint's files, the pruning
of old ones, an event record, every TensorBoard record, an audit record, the run file), and a
fence that no longer holds ends the process at once, from whichever thread asked, with one line
and the status of its reason, writing nothing more.

A check is a round trip to the coordination store (or a read of the lease file): commits and
records are rare and check every time; what runs every step (audit records) or every
``--log-every`` steps (scalars) may reuse a verdict for a second. A freeze that falls between a
check and the write it allows is the one gap left.

A coordination store that does not answer (an outage longer than its client's timeout, or its
host's agent gone first as the whole job is stopped) cannot say whether this process is still the
job's. The membership then decides from the checkpoint folder's ``generation.json``, the job's
current generation mirrored there as each is named: a process that it says the job went on
without commits nothing and leaves; otherwise the reason cannot tell (:class:`CannotTell`), and a
commit goes on (the final checkpoint of a job stopped as a whole is written), while the lease's
renewal is skipped (a lease that nobody can renew lapses by itself).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from elastic_mnist.distributed import end_process
from elastic_mnist.errors import CannotTell

log = logging.getLogger(__name__)

RECENT_S = 1.0
"""How long a verdict may be reused by writers that ask often (``check(recent=True)``)."""


class Over(NamedTuple):
    """Why this process may write no more: the line it leaves with, and its exit status."""

    line: str
    status: int


Reason = Callable[[], "Over | None"]
"""One question the fence asks: None while the process may write, else why not."""


def leave(over: Over) -> None:
    log.error("%s", over.line)
    end_process(over.status)


class NullFence:
    """Nothing can take this process's place while it lives: writers never ask anyone."""

    def check(self, recent: bool = False, strict: bool = False) -> None:
        """Returns while this process may write; ends it otherwise. ``strict``: a reason that
        cannot tell raises CannotTell to the caller, instead of letting the write go on."""


NO_FENCE = NullFence()


class Fence(NullFence):
    """Asks each of its reasons (the membership's generation, the folder's lease) before a write."""

    def __init__(self, *reasons: Reason, on_over: Callable[[Over], None] = leave):
        self.reasons = reasons
        self.on_over = on_over
        """What a verdict of "over" does: the process leaves (a test records it instead)."""
        self._held_at = -float("inf")
        self._unsure = False
        """The last verdict could not tell (said once, until one can again)."""
        self._lock = threading.Lock()

    def check(self, recent: bool = False, strict: bool = False) -> None:
        """``recent``: a verdict of the last ``RECENT_S`` seconds will do (monotonic time,
        which runs on while a process is stopped: a woken one asks again)."""
        if recent and time.monotonic() - self._held_at < RECENT_S:
            return
        with self._lock:  # one question at a time: the writer, training and watchdog threads
            unsure = None
            for reason in self.reasons:
                try:
                    over = reason()
                except CannotTell as e:
                    over, unsure = None, e
                if over is not None:
                    self.on_over(over)
                    raise FenceClosed(over.line)
            if unsure is not None:
                if strict:
                    raise unsure
                if not self._unsure:
                    log.warning("%s; writing on", unsure)
            self._unsure = unsure is not None
            self._held_at = time.monotonic()


class FenceClosed(Exception):
    """Raised after ``on_over`` where it returns (tests): the write does not happen."""
