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

**Bounded, and off the step's path.** The reasons are asked in a thread of the fence's own, one
question at a time, and no lock is held while they are: a store that does not answer (a link
cut silently, an outage) holds the checks ``ASK_S`` at most from when the question was asked,
however many wait for it, and a check that may reuse a verdict (every step's)
``RECENT_WAIT_S``, and not at all for a question already in flight. Where no answer came, the
``fallback`` reason decides without the store (the checkpoint folder's copy of the job's
generation, below), and the training goes on through a store outage; an "over" that a question
finds later is acted on at the next check, whoever asked.

A coordination store that does not answer (an outage longer than its client's timeout, or its
host's agent gone first as the whole job is stopped) cannot say whether this process is still the
job's. The membership then decides from the checkpoint folder's ``generation.json``, the job's
current generation mirrored there as each is named: a process that it says the job went on
without commits nothing and leaves; otherwise the reason cannot tell (:class:`CannotTell`), and a
commit goes on (the final checkpoint of a job stopped as a whole is written), while the lease's
renewal is skipped (a lease that nobody can renew lapses by itself).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from elastic_mnist.distributed import end_process
from elastic_mnist.errors import CannotTell, first_to_say_dropped, wait_for_the_end
from elastic_mnist.resilience.in_flight import InFlight

log = logging.getLogger(__name__)

RECENT_S = 1.0
"""How long a verdict may be reused by writers that ask often (``check(recent=True)``)."""
ASK_S = 1.0
"""How long a check waits for its reasons' answer before the ``fallback`` decides: a store
answers in milliseconds, and a commit that waits holds the step (a store outage cost the job 2.3 s
at 2 s here, ``make partitions``)."""
FALLBACK_S = 1.0
"""How long the ``fallback`` (the checkpoint folder's generation.json) may take to answer."""
RECENT_WAIT_S = 0.05
"""How long a check that may reuse a verdict (every step's) waits for a fresh question's answer:
a store answers in a millisecond, and where each process paid up to ``ASK_S`` once as an outage
began, at its own step, the steps paid it once per process in turn (2.1 s at 3 × 2 ranks). An
"over" that comes later is acted on at the next check."""


class Over(NamedTuple):
    """Why this process may write no more: the line it leaves with, and its exit status."""

    line: str
    status: int


Reason = Callable[[], "Over | None"]
"""One question the fence asks: None while the process may write, else why not."""


def leave(over: Over) -> None:
    """Ends the process with ``over``'s one line and status (once: see
    :func:`~elastic_mnist.errors.first_to_say_dropped`)."""
    if not first_to_say_dropped():
        wait_for_the_end()
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

    def __init__(self, *reasons: Reason, on_over: Callable[[Over], None] = leave,
                 fallback: Reason | None = None, ask_s: float = ASK_S):
        """``fallback``: what decides, without the store, where the reasons did not answer
        within ``ask_s`` (None: nothing can tell then)."""
        self.reasons, self.fallback, self.ask_s = reasons, fallback, ask_s
        self.on_over = on_over
        """What a verdict of "over" does: the process leaves (a test records it instead)."""
        self._held_at = -float("inf")
        self._unsure = False
        """The last verdict could not tell (said once, until one can again)."""
        self._lock = threading.Lock()
        """Guards the verdict's state: held across no question."""
        self._questions = InFlight(self._ask, "fence", lambda answer: self._keep(answer[0]))
        """The reasons' question: the store's, for the writer, training and watchdog threads."""
        self._fallbacks = InFlight(lambda: fallback(), "fence-fallback", self._keep)
        """The fallback's: the checkpoint folder's, which may be a mount the cut took too."""
        self._over: Over | None = None
        """A verdict of "over", once any question found it: every later check acts on it."""

    def check(self, recent: bool = False, strict: bool = False) -> None:
        """``recent``: a verdict of the last ``RECENT_S`` seconds will do (monotonic time,
        which runs on while a process is stopped: a woken one asks again), and a question
        already in flight is not waited for."""
        over = self._over  # final: found by a question that nobody waited for, say
        if over is None and recent and time.monotonic() - self._held_at < RECENT_S:
            return
        if over is not None:
            self.on_over(over)
            raise FenceClosed(over.line)
        try:
            over, unsure = self._questions.result(self.ask_s, lambda in_flight, left: (
                0 if recent and in_flight else min(left, RECENT_WAIT_S) if recent else left))
        except concurrent.futures.TimeoutError:
            over, unsure = self._without_store(recent)
        if over is not None:
            self.on_over(over)
            raise FenceClosed(over.line)
        with self._lock:
            if unsure is not None and not self._unsure:
                log.warning("%s; writing on", unsure)
            self._unsure = unsure is not None
            if unsure is None or not strict:  # an "over" found meanwhile is acted on first
                self._held_at = time.monotonic()
        if unsure is not None and strict:
            raise unsure

    def _keep(self, over: Over | None) -> None:
        """An "over" found by any question: every later check acts on it."""
        if over is not None:
            self._over = over

    def _ask(self) -> tuple[Over | None, CannotTell | None]:
        """Every reason's verdict: the first "over", else whether one could not tell."""
        unsure = None
        for reason in self.reasons:
            try:
                over = reason()
            except CannotTell as e:
                over, unsure = None, e
            if over is not None:
                return over, None
        return None, unsure

    def _without_store(self, recent: bool) -> tuple[Over | None, CannotTell | None]:
        """The fallback's verdict, where the reasons did not answer in time: bounded too (the
        checkpoint folder may be a mount that the cut took with the store, whose read waits
        for the heal), one at a time in a daemon thread of its own, ``FALLBACK_S`` from when it
        was asked; a step's check (``recent``) waits for none in flight. An "over" it finds
        late is acted on at the next check."""
        why = CannotTell(f"the job's store did not answer the fence within {self.ask_s:g} s")
        if self.fallback is None:
            return None, why
        try:
            return self._fallbacks.result(FALLBACK_S, lambda in_flight, left: (
                0.0 if recent and in_flight else left)), None
        except CannotTell as e:
            return None, e
        except concurrent.futures.TimeoutError:
            return None, CannotTell(f"{why}, and the checkpoint folder not within "
                                    f"{FALLBACK_S:g} s")


class FenceClosed(Exception):
    """Raised after ``on_over`` where it returns (tests): the write does not happen."""
