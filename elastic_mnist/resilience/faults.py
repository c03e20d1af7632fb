"""Fault injection, for tests and the chaos harness only: faults that are not crashes, on demand.

``ELASTIC_MNIST_FAULT`` holds a comma-separated list of ``KIND@STEP[:RANK]`` (RANK 0 if left out):

    nan-grad@STEP:RANK   that rank's gradients of optimizer step STEP become NaN
    hang@STEP:RANK       that rank stops itself (SIGSTOP) as it begins step STEP, as a wedged
                         process would: no thread of it runs, and it does not exit
    stall@STEP:RANK      that rank's training thread waits forever as it begins step STEP, as a
                         deadlocked one would: its other threads run on
    hang-save@STEP       rank 0 stops itself (SIGSTOP) as its checkpoint writer is about to write
                         step STEP's checkpoint: woken, it holds a save of a step that others
                         may have written since
    disk-full@STEP       rank 0's checkpoint writer fails with ENOSPC on step STEP's checkpoint
    die@STEP:RANK        that rank kills its own node as it begins step STEP: its agent (its
                         parent), then itself, with SIGKILL
    busy@STEP:RANK       in the first recovery in process from step STEP on (a fault in that
                         step or later), that rank checks in BUSY_S late, alive, as one that
                         was evaluating, saving or recompiling when the fault came would
    die-recovering@STEP:RANK     in that recovery, once the survivors agreed on who is left,
                         that rank kills its own node (as ``die``) as it begins to create their
                         new group
    freeze-recovering@STEP:RANK  the same, but it stops itself (SIGSTOP) there
    die-agreeing@STEP:RANK       in that recovery, that rank kills its own node just after it
                         checked in, while the survivors agree on who is left (it is counted
                         among them, and the new group waits for it)
    freeze-agreeing@STEP:RANK    the same, but it stops itself (SIGSTOP) there
    die-adopting@STEP:RANK       in that recovery, once the new group is built, that rank kills
                         its own node as the survivors begin to take the agreed state
    freeze-adopting@STEP:RANK    the same, but it stops itself (SIGSTOP) there
    slow@STEP:RANK       from step STEP on, whichever process holds that rank (in every
                         generation) takes SLOW_S longer over each step, as a slower machine
                         would: a pace for tests that act while a job trains

Each fires at most once per worker process (``slow`` at every step). All but ``nan-grad`` and
``slow`` fire only in a launch's first
attempt (``TORCHELASTIC_RESTART_COUNT`` 0), before any change of membership in
process: the attempt torchrun restarts after them, or the group the survivors regroup in, runs
clean, as it would once a real fault has passed, instead of meeting them again forever (a survivor
that takes the frozen rank's number would freeze at the same step).
A ``nan-grad`` step that a restart runs again is poisoned again (and skipped again). Nothing here
runs unless the variable is set.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from elastic_mnist.errors import EnvError

FAULT_VAR = "ELASTIC_MNIST_FAULT"
KINDS = ("nan-grad", "slow", "hang", "stall", "disk-full", "die", "busy", "die-recovering",
         "freeze-recovering", "hang-save", "die-agreeing", "freeze-agreeing", "die-adopting",
         "freeze-adopting")
FIRST_ATTEMPT = KINDS[2:]
BUSY_S = 3.0
"""How late ``busy`` makes its rank: twice the silence that gives the dead away (SILENT_PULSES)."""
SLOW_S = 0.05
"""How much longer ``slow`` makes each step of its rank."""


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int = 0


def parse(text: str) -> tuple[Fault, ...]:
    """``nan-grad@5:1,hang@12:1`` → faults; EnvError, in one line, on anything else."""
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, _, where = item.partition("@")
        step, _, rank = where.partition(":")
        if kind not in KINDS or not step.isdigit() or not (rank == "" or rank.isdigit()):
            raise EnvError(f"{FAULT_VAR}: {item!r} is not KIND@STEP[:RANK] with KIND one of "
                           f"{', '.join(KINDS)}")
        faults.append(Fault(kind, int(step), int(rank or 0)))
    return tuple(faults)


class Faults:
    """The faults this process is to inject; asked at the places where each would strike."""

    def __init__(self, faults: tuple[Fault, ...] = (), rank: int = 0):
        self.pending = {(f.kind, f.step) for f in faults if f.rank == rank and f.kind != "slow"}
        self.slow_from = min((f.step for f in faults if f.rank == rank and f.kind == "slow"),
                             default=None)

    @classmethod
    def from_environ(cls, rank: int, restart_count: int,
                     environ: Mapping[str, str] | None = None, *,
                     regrouped: bool = False) -> Faults:
        """``regrouped``: for a rank of a group the survivors built in process."""
        text = (os.environ if environ is None else environ).get(FAULT_VAR, "")
        faults = parse(text)  # checked on every attempt: a bad value is said at once
        first = restart_count == 0 and not regrouped
        return cls(tuple(f for f in faults if first or f.kind not in FIRST_ATTEMPT), rank)

    def fires(self, kind: str, step: int) -> bool:
        """True once for a fault of ``kind`` at ``step`` meant for this rank."""
        if (kind, step) in self.pending:
            self.pending.discard((kind, step))
            return True
        return False

    def maybe_hang(self, step: int) -> None:
        if self.slow_from is not None and step >= self.slow_from:
            time.sleep(SLOW_S)
        if self.fires("hang", step):
            freeze_here()
        if self.fires("stall", step):
            threading.Event().wait()
        if self.fires("die", step):
            kill_own_node()

    def maybe_strike_recovery(self, phase: str, step: int) -> None:
        """At a recovery's ``phase`` (the membership's: where it stands, or "checked in") that
        began in step ``step``."""
        kinds = {"agreeing on who is left": ("busy",),
                 "checked in": ("die-agreeing", "freeze-agreeing"),
                 "creating the new group": ("die-recovering", "freeze-recovering"),
                 "adopting the agreed state": ("die-adopting", "freeze-adopting")}.get(phase, ())
        for kind, at in sorted(self.pending):
            if kind in kinds and at <= step:
                self.pending.discard((kind, at))
                if kind == "busy":
                    time.sleep(BUSY_S)
                    continue
                if kind.startswith("die-"):
                    kill_own_node()
                freeze_here()

    def before_save(self, step: int) -> None:
        """In rank 0's checkpoint writer, before it writes step ``step``'s checkpoint."""
        if self.fires("hang-save", step):
            freeze_here()
        if self.fires("disk-full", step):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def freeze_here() -> None:
    """Stops this process (SIGSTOP) before the calling thread takes another step. Sent to the
    process, the signal may be taken by another of its threads, and this one runs on meanwhile
    (a checkpoint writer then writes what it was to stop before); sent to this thread, it stops
    the thread on its way back from the call, and the whole process with it."""
    signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


def kill_own_node() -> None:
    """The loss of this worker's node, as far as one worker can cause it: its torchrun agent
    first (its parent), then itself."""
    os.kill(os.getppid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
