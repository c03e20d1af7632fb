"""How a process ends: every exit code, and every exception that crosses from one room to another.

The one place an operator (``sacct``, torchrun's failure summary, a shell's ``$?``) or a reader
of the code learns what a status means. Each code has one meaning; where two paths share a
code, they share its meaning (said at the code). docs/operations.md has the table.

No code of the project and no torch is imported here: every room may import it.
"""

from __future__ import annotations

import signal
import sys
import threading

# --- exit codes -----------------------------------------------------------------------------------

EXIT_USAGE = 2
"""Bad input, the user's to mend: flags, data, environment, ports, a checkpoint that must not be
resumed, a checkpoint folder another live job holds. argparse's code, kept for all of them."""
EXIT_DIVERGED = 3
"""Too many steps in a row had non-finite loss or gradients (``--max-nonfinite-steps``):
rank 0 says why in one line, every other rank leaves with the same code."""
EXIT_CANNOT_SAVE = 4
"""A checkpoint cannot be written: the folder is found unwritable before the first step, or a
write failed (full, read-only, not permitted), or rank 0 refused to save weights that are not
finite. Shared on purpose: no checkpoint comes of going on either way, and the ranks that learn
it from another (a failed or refused save, through the next step's collective) leave with it
too."""
EXIT_LEASE_LOST = 5
"""Another job took this job's checkpoint folder (``--take-over``, or the lease lapsed): this
one stops writing and leaves."""
EXIT_DROPPED = 6
"""This process is no longer one of the job's ranks: the survivors of a fault went on in a
generation without it (a frozen rank woken), or the rendezvous moved on to a round without its
agent, or the job let its node go as a straggler (``--evict-slower-than``, under our
rendezvous). It leaves with one line and without writing, whichever of its threads learns it
first (a writer's fence, its recovery, its watchdog, its eviction); its agent restarts it into
the job."""
EXIT_GAVE_UP = 7
"""The recovery in process failed (no step within its bound, the coordination store gone with
nothing to say the others went on without this rank): torchrun restarts the job from its last
checkpoint."""
EXIT_HUNG = 124
"""The watchdog found a collective or a step hung past ``--hang-timeout`` with nobody to go on
without it: every rank leaves and torchrun restarts the job. timeout(1)'s code."""
EXIT_INTERRUPTED = 128 + signal.SIGINT
"""Ended by Ctrl-C without a launcher: what shells read as "ended by SIGINT" (130)."""
EXIT_PREEMPTED = 128 + signal.SIGTERM
"""Stopped at an agreed step after SIGTERM, with a checkpoint (or this node left while the others
go on): what schedulers read as "terminated, not finished" (143)."""

# --- bad input ------------------------------------------------------------------------------------


class ConfigError(ValueError):
    """A flag's value is out of range or contradicts another flag."""


class EnvError(ValueError):
    """The torchrun environment is missing a variable or contradicts itself."""


class DataError(RuntimeError):
    """A data file is missing, corrupt or truncated; the message names it."""


class RendezvousError(Exception):
    """The store cannot be served; the message is one line for the user."""


class CheckpointError(RuntimeError):
    """A checkpoint that must not be loaded: unsafe, or from another model or config."""


class CheckpointWriteError(CheckpointError):
    """The checkpoint folder cannot take a checkpoint: full, read-only, or not permitted."""

    exit_code = EXIT_CANNOT_SAVE


class RefusedToSave(CheckpointError):
    """The state to save holds non-finite values: written, it would poison every resume."""

    exit_code = EXIT_CANNOT_SAVE


class InvalidCheckpoint(Exception):
    """A checkpoint that is corrupt, truncated or half-written; the previous one is used instead."""


class FolderInUse(Exception):
    """Another live job holds the checkpoint folder; the message is one line for the user."""


class TrainingDiverged(RuntimeError):
    """Too many steps in a row with non-finite loss or gradients: said in one line."""

    exit_code = EXIT_DIVERGED


USER_ERRORS: tuple[type[Exception], ...] = (EnvError, ConfigError, DataError, RendezvousError)
"""Bad flags, data, environment or ports: one line and EXIT_USAGE, never a traceback."""

# --- between ranks, and between the training loop and the membership ------------------------------


class PeerStopped(Exception):
    """Another rank reported why the job stops; this one leaves with the same exit code."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class PeerFailure(RuntimeError):
    """A collective of the training loop failed, or was given up on: the group changed."""


class CannotRecover(Exception):
    """This rank cannot go on in process; it leaves (EXIT_GAVE_UP), and torchrun restarts the
    job."""


_SAYING_DROPPED = threading.Lock()


def first_to_say_dropped() -> bool:
    """True for the first of a process's threads to find that the job went on without it (a
    writer's fence, the watchdog's, the recovery's), once per process: it says the one line and
    ends the process; any other waits for that end (:func:`wait_for_the_end`)."""
    return _SAYING_DROPPED.acquire(blocking=False)


def wait_for_the_end() -> None:
    """Another thread of this process is saying its line and ending the process: a few
    seconds at most (then this one goes on, and says its own)."""
    threading.Event().wait(5.0)


class Dropped(Exception):
    """The survivors of a fault went on without this rank (it was frozen as they closed their
    membership): it leaves with this one line and EXIT_DROPPED, writing nothing, not even a
    ``fallback`` record: the job did not fall back."""

    exit_code = EXIT_DROPPED


class CannotTell(Exception):
    """Raised by a reason of the fence that cannot answer now: nothing says this process was
    dropped, and nothing can say that it was not."""


def report_user_error(command: str, error: Exception) -> int:
    """An error said in one line on stderr; returns its exit code (EXIT_USAGE unless the error
    names its own).

    One write of the whole line: ``print`` writes the newline apart, and the lines of workers
    that share torchrun's output could then run into each other.
    """
    sys.stderr.write(f"elastic-mnist {command}: error: {error}\n")
    sys.stderr.flush()
    return getattr(error, "exit_code", EXIT_USAGE)


def first_line(error: BaseException) -> str:
    """An error in one line, for a message of one line: its message's first, else its type."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
