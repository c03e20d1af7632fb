"""One live job per checkpoint folder: a lease file that the job's nodes keep renewing, and the
protocol that takes, keeps and releases it (what the file says: lease_record.py).

``<checkpoint dir>/lease.json`` names the job that uses the folder and when it was last seen. Every
node's LOCAL_RANK 0 takes it before the job's first step and rewrites it every ``--lease-timeout``
/ 5 seconds (where nodes share the folder, every node's keeper rewrites the one lease); a launch
of another job that finds it fresh is refused, on every rank, with one line naming the job, its
host and how long ago it was seen. So whichever process is rank 0 after a resize or an in-process
recovery, the lease needs no hand-over: its keepers are the nodes' first processes, and a node
whose first process is gone has gone as a whole.

**The same job.** A lease names a job, not a process:

- under a multi-node c10d rendezvous, its id and a nonce that the job's first node draws in the
  rendezvous store (compare-and-set) and every other node reads: its nodes share that store,
  which outlives torchrun's restarts, resizes and in-process recoveries, so two jobs of one
  rendezvous id (``RUN_ID`` left at a default, say) differ, and one job's nodes launched without
  ``--rdzv_id`` (torchrun's ``none``) agree;
- under torchrun on one node, the rendezvous id (``TORCHELASTIC_RUN_ID``): ``torchrun
  --standalone`` draws a fresh one per launch, single-node ``jobs/node.sh`` too;
  ``jobs/slurm.sbatch`` gives the SLURM job id, which a requeued job keeps;
- with it, under SLURM, the job's copy (``SLURM_RESTART_COUNT``): a requeued copy takes the lease
  over from an older copy of the same job, and an older copy that still runs stops at its next
  renewal; an older copy is refused where a newer one holds the lease;
- without torchrun, the process alone: two plain ``elastic-mnist train`` are two jobs.

**When the folder is free again.** A job that finishes or is stopped by Ctrl-C removes its lease.
One that stops in a way its launcher may follow with a restart (SIGTERM: a preemption, or torchrun
restarting the group after a failure or for a resize; an error) leaves it, so that no other launch
slips in before the restart. A lease records the processes of the launch that holds it (the
keeper, and its torchrun agent) and the machine they run on (boot and PID namespace): a launch on
that machine takes over at once a lease whose launch has ended, whether it ended in order, failed
or was SIGKILLed. From another machine, where those processes cannot be seen, a lease is free
once it has gone unrenewed for ``--lease-timeout`` seconds (15) and two more renewal periods have
passed without a change, watched by the launch that takes it over: at most 21 s with the
defaults. ``--take-over`` takes it at once, for when the user knows that job is gone; a job whose
lease was taken (it was not gone after all) stops at its next write (every writer asks the lease
first: :meth:`LeaseHold.taken`, fence.py) or renewal, writing nothing more.

**No locks across hosts.** The file is only ever created whole (written aside, then ``link``ed
into place, which fails when another launch got there first: atomic on NFS too), replaced whole
(``rename``), and judged by its content: a renewal time, the writer's wall clock, and a counter.
Nodes' clocks are assumed to agree within a few seconds (NTP); a lease that looks lapsed is still
watched for two renewal periods before it is taken, so a live writer whose clock lags is seen by
its counter moving. It works where nodes share the folder (one lease, renewed by every node's
keeper) and where each node has its own (one lease per folder).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path

import torch

from elastic_mnist import distributed
from elastic_mnist.checkpoint import read_run_file, unwritable
from elastic_mnist.config import TrainConfig
from elastic_mnist.env import DistEnv
from elastic_mnist.errors import (
    EXIT_CANNOT_SAVE,
    EXIT_PREEMPTED,
    CannotTell,
    CheckpointWriteError,
    FolderInUse,
    PeerStopped,
)
from elastic_mnist.resilience.fence import NO_FENCE, NullFence, Over, leave
from elastic_mnist.resilience.lease_record import (
    BEATS_PER_TIMEOUT,
    LEASE_FILE,
    WATCHED_BEATS,
    JobIdentity,
    Lease,
    read_lease,
    read_lease_file,
    running,
    seen,
    taken_over,
    this_machine,
)

log = logging.getLogger(__name__)


class LeaseKeeper:
    """Takes and keeps the lease of one checkpoint folder for one job.

    ``acquire()`` takes it or raises FolderInUse; ``start()`` renews it from a thread;
    ``close()`` stops renewing and releases it. ``on_lost`` runs (in the thread) when another
    job has taken it over: by default the process says so and ends without writing more.
    """

    def __init__(self, folder: Path, identity: JobIdentity, timeout_s: float,
                 on_lost: Callable[[Lease], None] | None = None, agent_pid: int | None = None,
                 machine: str | None = None):
        self.folder = Path(folder)
        self.path = self.folder / LEASE_FILE
        self.identity = identity
        self.timeout_s = timeout_s
        self.on_lost = on_lost or self._stop_process
        self.agent_pid = os.getpid() if agent_pid is None else agent_pid
        self.machine = this_machine() if machine is None else machine
        self.beat = 0
        self.nonce = ""
        self.fence: NullFence = NO_FENCE
        """Asked before each renewal: a process dropped from the job renews nothing."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = False
        self._unsure = False
        """The fence could not tell at the last beat (said once, until it can again)."""

    @property
    def beat_s(self) -> float:
        return self.timeout_s / BEATS_PER_TIMEOUT

    # --- taking it ---------------------------------------------------------------------------

    def acquire(self, take_over: bool = False) -> None:
        """Takes the lease: creates it, adopts the job's own, takes one whose launch has ended
        or that lapsed (or any, with ``take_over``); raises FolderInUse naming the job that holds
        it. OSError when the folder cannot be written."""
        self.folder.mkdir(parents=True, exist_ok=True)
        for _ in range(100):  # each turn loses a race to another launch; rarely more than one
            current = read_lease(self.folder)
            if current is None:
                if self._create():
                    return
                continue
            theirs = current.identity
            if not self.identity.is_taken_by(theirs):
                self._write()  # its own restart, resize or recovery, or an older copy
                return
            why = "--take-over" if take_over else self._why_free(current)
            if not why:
                whose = ("another job" if theirs.job != self.identity.job else
                         "a newer copy of this job" if theirs.copy > self.identity.copy else
                         "another job of the same rendezvous id (another rendezvous store)")
                raise FolderInUse(self._refusal(current, whose))
            log.warning("checkpoint folder %s: taking over the lease of %s on host %s (pid %d), "
                        "last seen %s (%s)", self.folder, current.identity.describe(),
                        current.host, current.pid, seen(current), why)
            self._take_away(current)
        raise FolderInUse(f"checkpoint folder {self.folder}: could not take its lease; other "
                          f"launches keep taking it")

    def _why_free(self, current: Lease) -> str:
        """Why another launch's lease no longer holds the folder, or "" while it does."""
        if (current.machine and current.machine == self.machine
                and not running(current.pid) and not running(current.agent_pid)):
            return "its launch has ended"
        return "lapsed" if self._lapsed(current) else ""

    def _lapsed(self, current: Lease) -> bool:
        """Whether a lease's keeper is gone: unrenewed for its timeout by the clocks, and
        unchanged while watched for two of its renewal periods (a lagging clock shows in that)."""
        if not current.looks_lapsed():
            return False
        deadline = time.monotonic() + WATCHED_BEATS * current.beat_s + 0.5
        while time.monotonic() < deadline:
            time.sleep(min(0.2, current.beat_s))
            if read_lease(self.folder) != current:
                return False
        return True

    def _refusal(self, current: Lease, whose: str) -> str:
        run = read_run_file(self.folder).get("run_id")
        named = f"run {run}, " if run else ""
        if current.machine and current.machine == self.machine:  # its processes run here
            after = "--take-over takes the folder from it"
        else:
            lapses = max(0.0, current.timeout_s - current.age()) + WATCHED_BEATS * current.beat_s
            after = (f"if that job is gone, its lease lapses within {lapses:.0f} s, or start "
                     f"with --take-over")
        return (f"checkpoint folder {self.folder} is in use by {whose}: {named}"
                f"{current.identity.describe()} on host {current.host} (pid {current.pid}), "
                f"last seen {seen(current)}; wait for it to end, or use another "
                f"--checkpoint-dir; {after}")

    def _take_away(self, current: Lease) -> None:
        """Moves the lease judged lapsed out of the way, unless it changed meanwhile."""
        aside = self.folder / f".{LEASE_FILE}.{secrets.token_hex(4)}.lapsed"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        if read_lease_file(aside) != current:  # renewed or replaced since it was judged
            with contextlib.suppress(OSError):
                os.link(aside, self.path)  # back, unless a new one is there already
        aside.unlink(missing_ok=True)

    # --- writing it --------------------------------------------------------------------------

    def _content(self) -> bytes:
        self.beat += 1
        self.nonce = secrets.token_hex(8)
        lease = Lease(job=self.identity.job, copy=self.identity.copy, host=platform.node(),
                      pid=os.getpid(), renewed=time.time(), beat=self.beat,
                      timeout_s=self.timeout_s, nonce=self.nonce, agent_pid=self.agent_pid,
                      machine=self.machine, job_nonce=self.identity.nonce)
        return json.dumps(asdict(lease)).encode()

    def _aside(self) -> Path:
        """A file of this lease's content beside it, under a name of this writer's own."""
        name = f".{LEASE_FILE}.{platform.node()}.{os.getpid()}.{secrets.token_hex(4)}"
        aside = self.folder / name
        with open(aside, "wb") as f:
            f.write(self._content())
            f.flush()
            os.fsync(f.fileno())
        return aside

    def _create(self) -> bool:
        """Creates the lease unless one exists: False when another launch got there first."""
        aside = self._aside()
        try:
            os.link(aside, self.path)
            return True
        except FileExistsError:
            # NFS may answer a retried link with EEXIST after it succeeded: look at the content.
            return read_lease(self.folder) == read_lease_file(aside)
        finally:
            aside.unlink(missing_ok=True)

    def _write(self) -> None:
        os.replace(self._aside(), self.path)

    # --- keeping it --------------------------------------------------------------------------

    def start(self) -> None:
        """Renews the lease from a thread until ``close``."""
        self._thread = threading.Thread(target=self._keep, name="lease-keeper", daemon=True)
        self._thread.start()

    def _keep(self) -> None:
        while not self._stop.wait(self.beat_s):
            try:
                current = read_lease(self.folder)
                if current is not None and self._is_taken(current):
                    self._stop.set()
                    self.on_lost(current)
                    return
                try:
                    self.fence.check(strict=True)
                except CannotTell as e:  # skipped: a lease nobody can renew lapses by itself
                    if not self._unsure:
                        log.warning("lease %s not renewed: %s", self.path, e)
                    self._unsure = True
                    continue
                self._unsure = False
                if current is None:  # released by another node of this job as it left
                    self._create()
                else:
                    self._write()
            except OSError as e:  # try again at the next beat; say it once
                if not self._warned:
                    log.warning("cannot renew the lease %s: %s", self.path, e.strerror or e)
                    self._warned = True

    def _is_taken(self, current: Lease) -> bool:
        return self.identity.is_taken_by(current.identity)

    def _stop_process(self, current: Lease) -> None:
        leave(taken_over(self.folder, current))

    def close(self, release: bool = True) -> None:
        """Stops renewing; releases the lease (if this keeper wrote it last) unless told not
        to: a restart of the job may follow."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if release:
            self.release()

    def release(self) -> None:
        """Removes the lease if this keeper wrote it last: where several nodes of the job renew
        one lease, one that leaves (its workers restarting, say) leaves it to the others."""
        current = read_lease(self.folder)
        if current is not None and current.nonce == self.nonce:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


class LeaseHold:
    """What the job tells its lease as it ends: the exit status, which says whether the folder
    is left to a restart (EXIT_PREEMPTED) or released (finished, Ctrl-C). And what every rank
    asks of it before a write (:meth:`taken`, a reason of the writers' fence)."""

    def __init__(self, folder: Path, identity: JobIdentity,
                 keeper: LeaseKeeper | None = None) -> None:
        self.folder, self.identity = folder, identity
        self.keeper = keeper
        self.status: int | None = None

    def fence_renewals(self, fence: NullFence) -> None:
        """This node's renewals pass the writers' fence too."""
        if self.keeper is not None:
            self.keeper.fence = fence

    def taken(self) -> Over | None:
        """Why this job may write no more into the folder (another job took its lease), or
        None while the lease is this job's (or none: a node of it released it as it left)."""
        current = read_lease(self.folder)
        if current is None or not self.identity.is_taken_by(current.identity):
            return None
        return taken_over(self.folder, current)

    def ended(self, status: int) -> int:
        self.status = status
        return status

    @property
    def releases(self) -> bool:
        return self.status is not None and self.status != EXIT_PREEMPTED


@contextlib.contextmanager
def checkpoint_folder_lease(cfg: TrainConfig, env: DistEnv,
                            device: torch.device) -> Iterator[LeaseHold]:
    """Holds the checkpoint folder's lease for the job while the block runs: every node's first
    process takes it (all nodes agree before any proceeds) and renews it; the block tells the
    yielded hold its exit status, and a finished or interrupted job releases the lease.

    Raises FolderInUse on every rank when another live job holds it on any node, before anything
    is written; a node whose folder cannot be written stops the job as check_writable would.
    """
    folder = Path(cfg.checkpoint.checkpoint_dir)
    identity, keeper, outcome = None, None, None
    if env.is_local_main:
        try:
            identity = JobIdentity.of(env, cfg.run.pg_timeout)
        except OSError as e:
            outcome = ("in use", f"checkpoint folder {folder}: cannot tell which job this is: {e}")
        else:
            keeper = LeaseKeeper(folder, identity, cfg.checkpoint.lease_timeout,
                                 agent_pid=os.getppid() if env.launched else os.getpid())
            try:
                keeper.acquire(take_over=cfg.checkpoint.take_over)
            except FolderInUse as e:
                outcome = ("in use", str(e))
            except OSError as e:
                outcome = ("cannot write", str(unwritable(folder, e)))
    gathered = distributed.all_gather_object((outcome, identity), device)
    outcomes = [o for o, _ in gathered if o is not None]
    if outcomes:
        if keeper is not None and outcome is None:
            keeper.release()  # the job does not start: leave the folder as it was
        in_use = [message for kind, message in outcomes if kind == "in use"]
        if in_use:
            raise FolderInUse(in_use[0])
        if outcome is not None:
            raise CheckpointWriteError(outcome[1])
        raise PeerStopped("another node cannot write the checkpoint folder",
                          exit_code=EXIT_CANNOT_SAVE)
    named = next((i for _, i in gathered if i is not None), None)
    if named is None:  # a joining node's other workers: no group to learn it from yet
        named = JobIdentity.of(env, cfg.run.pg_timeout)
    hold = LeaseHold(folder, named, keeper)
    if keeper is None:
        yield hold
        return
    keeper.start()
    try:
        yield hold
    finally:
        keeper.close(release=hold.releases)
