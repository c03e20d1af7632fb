"""The writers of each generation and rank 0's duties moving: who writes what (rank 0's
TensorBoard, events.jsonl, checkpoints, progress bar and train.log; every rank's audit file and
watchdog), given out at the start and again after each change of membership, and the records
their threads leave (a committed checkpoint, a declared hang, a fallback to a restart)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch.distributed as dist

from elastic_mnist.audit import AuditLog
from elastic_mnist.checkpoint import Manifest, write_run_file
from elastic_mnist.checkpointer import Checkpointer, NullCheckpointer
from elastic_mnist.config import TrainConfig
from elastic_mnist.distributed import backend_for
from elastic_mnist.env import DistEnv
from elastic_mnist.events import EventLog, NullEventLog
from elastic_mnist.logs import add_file_handler, setup_logging
from elastic_mnist.metrics import NullMetrics, TensorBoardMetrics
from elastic_mnist.progress import progress_display
from elastic_mnist.resilience.agreement import Change
from elastic_mnist.resilience.faces import NullMembership
from elastic_mnist.resilience.faults import Faults
from elastic_mnist.resilience.fence import NullFence
from elastic_mnist.resilience.silence import GenerationPulses
from elastic_mnist.resilience.watchdog import NullWatchdog, Watchdog
from elastic_mnist.state import Progress
from elastic_mnist.writers import Writers


@dataclass
class Duties:
    """Who writes what: rank 0's writers (TensorBoard, events.jsonl, checkpoints, the progress
    bar, train.log), every rank's audit file and watchdog. Given out at the start, and again
    after each change of membership to whichever process then holds each rank."""

    cfg: TrainConfig
    run_id: str
    run_dir: Path
    checkpoint_dir: Path
    group_store: dist.Store | None
    """The launch's process group's store: the watchdog's where nothing outlives rank 0."""
    membership: NullMembership
    fence: NullFence = dataclasses.field(default_factory=NullFence)
    """Asked by every writer before it commits: whether this process is still the job's."""

    writers: Writers = dataclasses.field(default_factory=Writers, init=False)
    """The current generation's bundle, which the next one is built from."""
    env: DistEnv = dataclasses.field(default_factory=DistEnv, init=False)
    """This process's place in the current generation, whose bundle ``writers`` is."""
    total_steps: int = dataclasses.field(default=0, init=False)

    def first(self, env: DistEnv, generation: int, faults: Faults, step: int,
              total_steps: int) -> Writers:
        """The launch's writers, for a loop that starts at ``step``: rank 0's dashboards and
        records are opened at the step after it (whatever an earlier rank 0 logged there or
        later is hidden: its steps are done again). The watchdog is built, not yet started."""
        self.total_steps = total_steps
        self.env, self.writers = env, self._bundle(env, generation, faults, step, Writers(
            checkpointer=self.checkpointer(env, generation, faults),
            audit=self.audit(env, generation)))
        return self.writers

    def after(self, change: Change) -> Writers:
        """After a change of membership: this process's new rank takes its duties, in a new
        bundle (the checkpointer, dashboards and records that stay with it carried over)."""
        env, generation = change.env, change.generation
        setup_logging(env)
        if env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            add_file_handler(str(self.run_dir / "train.log"))
        if env.is_local_main:
            self.fence.check()
            write_run_file(self.checkpoint_dir, self.run_id, generation)
        faults = Faults.from_environ(env.rank, env.restart_count, regrouped=True)
        old = self.writers
        old.audit.close()
        audit = self.audit(env, generation)
        checkpointer = old.checkpointer
        if isinstance(checkpointer, Checkpointer):
            checkpointer.restart_generation = generation
        elif env.is_main:
            checkpointer = self.checkpointer(env, generation, faults, taking_over_at=change.step)
        kept = dataclasses.replace(old, checkpointer=checkpointer, audit=audit)
        self.env, self.writers = env, self._bundle(env, generation, faults, change.step, kept)
        self.writers.watchdog.start()
        return self.writers

    def _bundle(self, env: DistEnv, generation: int, faults: Faults, step: int,
                kept: Writers) -> Writers:
        """``kept``'s checkpointer and audit with a new display, rank 0's dashboards and
        records (opened once per process, at the step after ``step``), a new watchdog."""
        kept.display.close()
        display = progress_display(env.is_main, self.total_steps, step, env.world_size)
        metrics, events, checkpointer = kept.metrics, kept.events, kept.checkpointer
        if env.is_main and not isinstance(metrics, TensorBoardMetrics):
            metrics = TensorBoardMetrics(self.run_dir, purge_step=step + 1, fence=self.fence)
            events = EventLog(self.run_dir / "events.jsonl", self.fence)
            checkpointer.on_commit = partial(record_checkpoint, metrics, events, checkpointer)
        return Writers(metrics=metrics, checkpointer=checkpointer, audit=kept.audit,
                       events=events, display=display, watchdog=self.watchdog(env, events),
                       faults=faults)

    def checkpointer(self, env: DistEnv, generation: int, faults: Faults,
                     taking_over_at: int | None = None) -> NullCheckpointer:
        c = self.cfg.checkpoint
        return (Checkpointer(self.checkpoint_dir, every=c.checkpoint_every,
                             every_seconds=c.checkpoint_every_seconds, keep_last=c.keep_last,
                             restart_generation=generation, before_write=faults.before_save,
                             taking_over_at=taking_over_at, fence=self.fence)
                if env.is_main else NullCheckpointer())

    def audit(self, env: DistEnv, generation: int) -> AuditLog:
        path = self.run_dir / "audit" / f"g{generation}-r{env.rank}.jsonl"
        return AuditLog(path if self.cfg.run.audit_samples else None, self.fence)

    def watchdog(self, env: DistEnv, events: NullEventLog) -> NullWatchdog:
        """The watchdog of the current group (not yet started): on the coordination store where
        the survivors go on in process (it names the hung ranks to them), else on the group's.
        Its thread reports a hang through ``events``, this generation's."""
        in_process = self.membership.in_process
        store = self.membership.generation_store() if in_process else self.group_store
        if store is None or self.cfg.run.hang_timeout <= 0:
            return NullWatchdog()
        return Watchdog(
            env, store, self.cfg.run.hang_timeout,
            report=partial(record_hang, env, events, self.run_dir, self.fence),
            go_on_without=partial(self.membership.declare, "hung",
                                  generation=self.membership.generation) if in_process else None,
            store_host=None if in_process else 0, fence=self.fence,
            silent=GenerationPulses(self.membership.connections.watchdog, self.membership.known,
                                    self.membership.pulse_key) if in_process else None,
            backend=backend_for(self.membership.device) if in_process else "")


def record_checkpoint(metrics: NullMetrics, events: NullEventLog, checkpointer: Checkpointer,
                      manifest: Manifest, blocking_ms: float) -> None:
    """A committed checkpoint, on the dashboards and in events.jsonl (from the writer thread)."""
    metrics.scalars(manifest.step, {"ckpt/save_ms": blocking_ms, "ckpt/bytes": manifest.bytes})
    events.emit("checkpoint", manifest.step, path=str(checkpointer.directory / manifest.file),
                blocking_ms=blocking_ms, bytes=manifest.bytes)


def record_hang(env: DistEnv, events: NullEventLog, run_dir: Path, fence: NullFence,
                record: dict) -> None:
    """The ``hang`` event, from the watchdog thread of the rank that declared it: rank 0's log,
    or, from another rank, the run folder's events.jsonl where this node can see it."""
    if env.is_main:
        events.emit("hang", record["last_step"], **record)
    elif run_dir.is_dir():
        events = EventLog(run_dir / "events.jsonl", fence)
        events.emit("hang", record["last_step"], **record)
        events.close()


def record_fallback(duties: Duties, progress: Progress, record: dict) -> None:
    """The ``fallback`` event at ``progress``'s step: a recovery in process failed, torchrun
    restarts the job. Rank 0 writes it through its generation's writers (``duties.writers``);
    another rank, its node's first, in the run folder's events.jsonl where this node can see it.
    Runs in the training thread or in the membership's give-up timer: it reads no trainer."""
    step, env, run_dir = progress.step, duties.env, duties.run_dir
    if env.is_main:
        duties.writers.events.emit("fallback", step, **record)
    elif env.is_local_main and run_dir.is_dir():
        events = EventLog(run_dir / "events.jsonl", duties.fence)  # fenced: a dropped rank
        events.emit("fallback", step, **record)  # writes nothing
        events.close()
