"""What a checkpoint folder's lease says: the job it names, the content of ``lease.json``, and
what tells from this machine whether its writer is still there.

The protocol that writes and keeps it is lease.py's; this room only reads and describes.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from elastic_mnist.env import DistEnv
from elastic_mnist.errors import EXIT_LEASE_LOST, first_line
from elastic_mnist.resilience.fence import Over

log = logging.getLogger(__name__)

LEASE_FILE = "lease.json"
BEATS_PER_TIMEOUT = 5
"""Renewals per --lease-timeout: a keeper may miss four in a row before its lease lapses."""
WATCHED_BEATS = 2
"""Renewal periods a lapsed-looking lease is watched for a change before it is taken over."""


@dataclass(frozen=True)
class JobIdentity:
    """What a lease names: the job, and which copy of it (a SLURM requeue is a newer copy)."""

    job: str
    copy: int = 0

    nonce: str = ""
    """Drawn once per job in its rendezvous store, which all its nodes share and which outlives
    torchrun's restarts: two jobs with one run id differ in it, one job's nodes never do."""

    @classmethod
    def of(cls, env: DistEnv, timeout_s: float = 60.0) -> JobIdentity:
        """Under a multi-node rendezvous, its id and the job's nonce in its store (OSError when
        the store does not answer); else torchrun's run id; else this process alone."""
        if env.rendezvous is not None:
            rdzv = env.rendezvous
            return cls(f"torchrun:{rdzv.run_id}", env.requeue_count,
                       job_nonce(rdzv.host, rdzv.port, rdzv.run_id, timeout_s))
        if env.launched and env.run_id:
            return cls(f"torchrun:{env.run_id}", env.requeue_count)
        return cls(f"process:{platform.node()}:{os.getpid()}:{secrets.token_hex(4)}",
                   env.requeue_count)

    def is_taken_by(self, theirs: JobIdentity) -> bool:
        """Whether a lease of ``theirs`` is another job's, or a newer copy's of this one (a
        requeued copy keeps the run id and draws a new nonce: its copy number tells)."""
        if theirs.job != self.job:
            return True
        if theirs.copy != self.copy:
            return theirs.copy > self.copy
        return theirs.nonce != self.nonce

    def describe(self) -> str:
        kind, _, name = self.job.partition(":")
        what = (f"torchrun job {name}" if kind == "torchrun" else
                f"a single process ({name.rsplit(':', 1)[0]})")
        return what + (f", requeued {self.copy} time(s)" if self.copy else "")


NONCE_KEY = "elastic_mnist/{run_id}/job"


def job_nonce(host: str, port: int, run_id: str, timeout_s: float) -> str:
    """The job's nonce in the rendezvous store at ``host:port``: drawn by the first node to ask
    (compare-and-set), read by every other, and by every restart while the store lives."""
    import datetime

    from torch.distributed import TCPStore

    try:
        store = TCPStore(host, port, is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s))
        return store.compare_set(NONCE_KEY.format(run_id=run_id), "",
                                 secrets.token_hex(8)).decode()
    except RuntimeError as e:  # DistStoreError, DistNetworkError
        raise OSError(f"the rendezvous store {host}:{port} does not answer "
                      f"({first_line(e)})") from None


@dataclass(frozen=True)
class Lease:
    """The content of lease.json."""

    job: str
    copy: int
    host: str
    pid: int
    renewed: float
    """When its keeper last wrote it: seconds since the epoch, by the keeper's clock."""
    beat: int
    """Counts the keeper's writes: a change shows a live keeper whatever the clocks say."""
    timeout_s: float
    """The holder's --lease-timeout."""
    nonce: str = ""
    """Tells this writing from any other (a lease taken away is recognised as the one judged)."""
    job_nonce: str = ""
    """The job's nonce (:attr:`JobIdentity.nonce`)."""
    agent_pid: int = 0
    """The launch's process that outlives the keeper across restarts: torchrun's agent (the
    keeper's parent), or the keeper itself without torchrun."""
    machine: str = ""
    """Where ``pid`` and ``agent_pid`` mean something: this boot of this machine, and the PID
    namespace (another container's processes are not seen from here)."""

    @property
    def identity(self) -> JobIdentity:
        return JobIdentity(self.job, self.copy, self.job_nonce)

    def age(self, now: float | None = None) -> float:
        return (time.time() if now is None else now) - self.renewed

    def looks_lapsed(self, now: float | None = None) -> bool:
        return self.age(now) > self.timeout_s

    @property
    def beat_s(self) -> float:
        return self.timeout_s / BEATS_PER_TIMEOUT


def this_machine() -> str:
    """This boot of this machine and this PID namespace ("" where /proc does not tell)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{platform.node()}:{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


def running(pid: int) -> bool:
    """Whether process ``pid`` of this machine runs (a zombie has ended)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def read_lease(folder: Path) -> Lease | None:
    """The lease in ``folder``, or None when there is none (or none that can be read)."""
    try:
        return Lease(**json.loads((Path(folder) / LEASE_FILE).read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as e:
        log.warning("ignoring an unreadable %s in %s: %s", LEASE_FILE, folder, e)
        return None


def taken_over(folder: Path, current: Lease) -> Over:
    return Over(f"checkpoint folder {folder} was taken over by {current.identity.describe()} on "
                f"host {current.host} (pid {current.pid}): this job stops without writing more",
                EXIT_LEASE_LOST)


def read_lease_file(path: Path) -> Lease | None:
    try:
        return Lease(**json.loads(Path(path).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def seen(lease: Lease) -> str:
    age = lease.age()
    return "just now" if age < 0.05 else f"{age:.1f} s ago"
