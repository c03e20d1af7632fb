"""The training loop: global batches cut into micro-batches, shared by however many ranks there are.

The applied gradient is the mean over the global batch whatever the world size: each micro-batch's
summed loss is divided by the global batch's size, and gradients are *summed* across ranks. A rank
left without a micro-batch (more ranks than micro-batches) still joins the gradient sync with a pass
that counts for nothing.

This room is the loop and the step; the rest lives behind narrow faces: the model and its wrappers
(engine.py), which rank computes which micro-batch (balance.py), the collectives and the
watchdog's marks (comm.py), the payload and the resume rules (state.py), the recovery in process
(regroup.py), reporting (report.py), and what the loop writes through (writers.py). Every
collective of the loop is waited on through the membership (membership.py): when the group loses a
rank, the step fails, and :meth:`Trainer.recover` goes on with the ranks that are left, in the same
process, from the state they agree on (regroup.py).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from elastic_mnist import state as payloads
from elastic_mnist.balance import step_shares
from elastic_mnist.batchnorm import GlobalBatchNormStats
from elastic_mnist.comm import Comm
from elastic_mnist.config import TrainConfig
from elastic_mnist.data.datasets import Dataset
from elastic_mnist.data.order import SampleOrder, Shares
from elastic_mnist.engine import Engine
from elastic_mnist.env import DistEnv
from elastic_mnist.errors import (
    EXIT_CANNOT_SAVE,
    EXIT_DIVERGED,
    PeerStopped,
    TrainingDiverged,
    first_line,
)
from elastic_mnist.eviction import Eviction, Probation
from elastic_mnist.fast_path import adamw_kernels
from elastic_mnist.pace import Pace
from elastic_mnist.regroup import Regroup
from elastic_mnist.report import Report
from elastic_mnist.resilience.agreement import Change
from elastic_mnist.resilience.faces import NullMembership
from elastic_mnist.resilience.preemption import StopRequest
from elastic_mnist.state import Progress
from elastic_mnist.step_result import StepResult
from elastic_mnist.writers import Writers

log = logging.getLogger(__name__)


class StepFlags:
    """This rank's flags in the step's one collective, in a tensor allocated once and written
    by kernels on its device (``fill_``, a copy from the device), never copied from the host:
    whether rank 0's last save failed, a vote that the ranks asking to stop leave, rank 0's
    decision to admit joining nodes, a vote that the stragglers are evicted (eviction.py), and
    per rank whether it asks to stop and whether its loss or gradients were not finite."""

    HEAD = 4

    def __init__(self, rank: int, world_size: int, device: torch.device):
        self.rank, self.world_size = rank, world_size
        self.tensor = torch.zeros(self.HEAD + 2 * world_size, dtype=torch.float64,
                                  device=device)

    def write(self, *, checkpoint_failed: bool, leave_vote: bool, stop: bool,
              nonfinite: torch.Tensor, admit: bool = False,
              evict_vote: bool = False) -> torch.Tensor:
        flags, head = self.tensor, self.HEAD
        flags.zero_()
        if checkpoint_failed:
            flags[0].fill_(1)
        if leave_vote:
            flags[1].fill_(1)
        if admit:
            flags[2].fill_(1)
        if evict_vote:
            flags[3].fill_(1)
        if stop:
            flags[head + self.rank].fill_(1)
        flags[head + self.world_size + self.rank].copy_(nonfinite)
        return flags

    def read(self, summed: list[float]) -> tuple[bool, bool, bool, bool, list[int], list[int]]:
        """(a save failed, some rank voted to let the stopping ranks leave, rank 0 admits
        joining nodes, some rank voted to evict the stragglers, the ranks asking to stop, the
        ranks whose values were not finite) from the summed flags."""
        head, size = self.HEAD, self.world_size
        stops, nonfinite = summed[head:head + size], summed[head + size:head + 2 * size]
        return (summed[0] > 0, summed[1] > 0, summed[2] > 0, summed[3] > 0,
                [r for r, v in enumerate(stops) if v > 0],
                [r for r, v in enumerate(nonfinite) if v > 0])


def lr_at(step: int, peak: float, warmup: int, total: int) -> float:
    """Linear warm-up to ``peak`` over ``warmup`` steps, then cosine decay to zero at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def planned_steps(cfg: TrainConfig, order: SampleOrder) -> int:
    """The steps this run trains: ``--epochs`` of ``order``'s, or ``--max-steps`` if fewer."""
    steps = cfg.optim.epochs * order.steps_per_epoch
    return min(steps, cfg.optim.max_steps) if cfg.optim.max_steps else steps


class Trainer:
    """Owns the model, optimizer and progress of one worker, and runs the loop."""

    def __init__(self, cfg: TrainConfig, env: DistEnv, device: torch.device, dataset: Dataset, *,
                 run_id: str, restart_generation: int, writers: Writers | None = None,
                 membership: NullMembership | None = None,
                 after_change: Callable[[Change], Writers] | None = None):
        """``writers``: this generation's (writers.py), or none yet: the job hands them to
        :meth:`take` once a resume is checked; ``after_change(change)``: the next generation's,
        after a change of membership in process (duties.py's ``Duties.after``). A worker of a
        node that joins a job (``membership.joining``) wraps its model only once it is admitted
        (:meth:`enter`): until then it has no group."""
        self.cfg, self.env, self.device = cfg, env, device
        self.run_id, self.restart_generation = run_id, restart_generation
        self.dataset = dataset
        self.train_data = dataset.train.to(device)
        self.test_data = dataset.test.to(device)  # both splits resident: no copy per batch
        self.membership = membership or NullMembership()
        self.after_change = after_change or (lambda change: self.writers)
        self.owed: Change | None = None
        """The last change of membership, until what its agreed step owes is done."""
        o = cfg.optim
        self.order = SampleOrder(len(dataset.train), o.global_batch_size, o.micro_batch_size,
                                 o.seed)
        self.total_steps = planned_steps(cfg, self.order)

        self.engine = Engine(cfg, device, self.membership)
        self.model = self.engine.model
        self.bn_stats = GlobalBatchNormStats(self.model, compiled=cfg.run.compile)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr,
                                           weight_decay=o.weight_decay, **adamw_kernels(device))
        if not self.membership.joining:
            self.engine.wrap(env)  # rank 0's parameters everywhere, then DDP and compile
        self.progress = Progress()
        """Where training stands: one object for the whole run (a resume or an adopted state
        changes its values in place), which the report and the regroup read too."""
        self.report = Report(cfg, self.progress, self.order, self.total_steps, self.model,
                             self.optimizer, dataset, self.test_data, device)
        self.shares_said_for = 0
        self.pace = Pace(device)
        self.balance = step_shares(cfg)  # who computes which micro-batch: balance.py
        self.eviction = Eviction(cfg)  # --evict-slower-than: eviction.py
        self.regroup = Regroup(self.membership, self.engine, self.bn_stats, self.optimizer,
                               device, self.progress, self.state, self.load_state)
        self.take(writers or Writers())
        if not self.membership.joining:
            log.info("precision %s; compile: %s", self.engine.float32_math,
                     self.engine.compilation.describe())
        self.resumed_from: int | None = None
        self.resumed_source: str | None = None

    def take(self, writers: Writers) -> None:
        """This generation's writers, whole (at the start, and as the answer to a change)."""
        self.writers = writers
        self.new_world()

    def new_world(self) -> None:
        """The step's flags and collectives, sized and guarded for the current world."""
        self.flags = StepFlags(self.env.rank, self.env.world_size, self.device)
        self.comm = Comm(self.env, self.membership, self.writers.watchdog)
        self.report.enter(self.env, self.restart_generation, self.writers, self.comm)
        self.pace.enter(self.env, self.writers, self.membership)
        self.balance.enter(self.env, self.writers)
        self.eviction.enter(self.env, self.writers, self.membership)
        self.say_shares()

    def say_shares(self) -> None:
        """Rank 0 says how the ranks share a step, at the start and whenever the world size
        changes; a warning where some have nothing to do."""
        if not self.env.is_main or self.env.world_size == self.shares_said_for:
            return
        self.shares_said_for = self.env.world_size
        o = self.cfg.optim
        shares = Shares(o.global_batch_size, o.micro_batch_size, self.env.world_size)
        idle = shares.idle_warning()
        if idle:
            log.warning("%s", idle)
        else:
            log.info("%s", shares.describe())

    # --- state (state.py) ----------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Everything needed to continue exactly: the payload of a checkpoint."""
        return payloads.payload(self.model, self.optimizer, self.progress, self.device,
                                self.cfg, self.dataset, self.env.world_size, self.run_id)

    def restore(self, payload: dict[str, Any], source: str) -> None:
        """Continues from a checkpoint's payload, or says precisely why it does not fit."""
        payloads.check_compatible(payload, self.model, self.cfg, self.dataset, source)
        self.load_state(payload)
        self.resumed_from = self.progress.step
        self.resumed_source = source

    def load_state(self, payload: dict[str, Any]) -> None:
        """Takes the state of a payload (a checkpoint's, or a peer's after a change)."""
        self.progress.become(payloads.load_state(payload, self.model, self.optimizer, self.cfg,
                                                 self.device))

    # --- the loop ------------------------------------------------------------------------------

    def done(self) -> bool:
        return self.report.done()

    def fit(self, stop: StopRequest) -> str:
        """Trains until done or asked to stop; returns 'finished', 'preempted' (every rank
        stops) or 'left' (this rank stops, the others go on); a joining worker first waits to
        be admitted, and returns 'unadmitted' when the job ended first, 'stopped' when it was
        stopped or lost first."""
        if self.membership.joining:
            outcome = self.enter(stop)
            if outcome is not None:
                return outcome
        self.report.new_window()
        while True:
            try:
                if self.owed is not None:
                    self.catch_up(self.owed)
                if self.done():
                    return "finished"
                result = self.iteration(stop.requested)
            except RuntimeError as failure:  # a collective failed, or was given up on
                if self.membership.broken is None:
                    raise
                self.recover(detail=first_line(failure))
                continue
            if result.stop_requested:
                return "preempted"
            if self.env.rank in result.leavers:
                return "left"
            if self.env.rank in result.evicted:
                return "evicted"
            if result.leavers or result.evicted:
                self.recover(why="left" if result.leavers else "evicted",
                             suspects=tuple(sorted({*result.leavers, *result.evicted})))
            elif result.admit and not self.done():
                self.grow()

    def recover(self, why: str = "died", suspects: tuple[int, ...] = (), detail: str = "") -> None:
        """Goes on with the ranks that are left (regroup.py), in the new world with its writers;
        what the agreed step still owes is done before the next step. Raises CannotRecover when
        this rank cannot go on."""
        change = self.regroup.recover(self.writers, self.report.last_eval_step, why, suspects,
                                      detail)
        self.env, self.restart_generation = change.env, change.generation
        self.take(self.after_change(change))
        self.owed = change

    def grow(self) -> None:
        """Admits the joining nodes rank 0 decided on (regroup.py), in the new world with its
        writers; what the agreed step still owes is done before the next step, as after a
        shrink (a grow follows a completed step: nothing, unless it became a recovery)."""
        change = self.regroup.grow(self.writers, self.report.last_eval_step)
        self.env, self.restart_generation = change.env, change.generation
        self.take(self.after_change(change))
        self.owed = change

    def enter(self, stop: StopRequest) -> str | None:
        """A joining worker: says it is ready, waits until the job admits its node, and takes
        its place and the job's state (regroup.py); None once it has, else why it did not
        ('left' when asked to stop, 'unadmitted' when the job ended first, 'stopped' when it
        stopped beating first)."""
        held = Probation(self.cfg, self.train_data, self.device).wait(
            self.membership, lambda: stop.requested, self.membership.admissions.watch())
        if held is not None:
            return held
        self.membership.ready()
        admission = self.membership.wait_admission(lambda: stop.requested)
        if isinstance(admission, str):
            return admission
        change = self.regroup.enter(self.writers, admission)
        self.env, self.restart_generation = change.env, change.generation
        self.take(self.after_change(change))
        self.report.last_eval_step = change.evaluated_step
        self.owed = change
        return None

    def catch_up(self, change: Change) -> None:
        """What the agreed step still owes when the fault came after it: its evaluation (unless
        rank 0 has it) and its checkpoint."""
        ended = self.progress.cursor == 0 and self.progress.step > 0
        if (ended or self.done()) and change.evaluated_step != self.progress.step:
            self.report.evaluation()
        self.maybe_checkpoint(ended, final=self.done())
        self.owed = None

    def iteration(self, stop_requested: bool) -> StepResult:
        """One turn of the loop: the next step, then what follows it (progress, scalars every
        ``--log-every`` steps, the evaluation at an epoch's end, the checkpoint when due)."""
        w = self.writers
        batch = self.global_batch()
        w.faults.maybe_hang(self.progress.step + 1)
        with self.engine.compiling(lambda: self.order.micro_batches(batch), self.balance.mine,
                                   self.comm):
            result = self.train_step(batch, stop_requested)
        w.watchdog.step_done(self.progress.step + 1, result.seconds)
        if result.checkpoint_failed:
            self.stop_after_checkpoint_failure()
        epoch_ended = self.advance(len(batch))
        changed = self.regroup.maybe_report_change(w.events)
        # Work of this rank alone is "busy" for the watchdog (peers wait for it, not for a hung
        # rank); a collective inside the evaluation is waiting, like a step's.
        with self.comm.busy("logging"):
            self.count_nonfinite(result)
            self.pace.observe(self.progress.step, self.balance.at_equal_shares(result))
            self.balance.follow(self.progress.step, self.pace.detector)
            result.evicted = self.eviction.after(self.progress.step, result, self.pace.detector,
                                                 self.done())
            self.report.step(result, epoch_ended, changed)
        if epoch_ended or self.done():
            self.report.evaluation()
        if self.env.rank not in result.leavers + result.evicted:  # one that leaves hands it on
            self.maybe_checkpoint(epoch_ended, final=self.done() or result.stop_requested)
        return result

    def maybe_checkpoint(self, epoch_ended: bool, final: bool) -> None:
        with self.comm.busy("checkpointing"):
            if self.writers.checkpointer.maybe_save(self.state, self.progress.step,
                                                    epoch_end=epoch_ended, final=final):
                self.writers.metrics.flush()  # what a resume keeps (steps up to this one) is on disk

    def global_batch(self) -> torch.Tensor:
        """The next step's sample indices, on the data's device."""
        return self.order.global_batch(self.progress.epoch, self.progress.cursor,
                                       self.train_data.labels.device)

    def train_step(self, batch: torch.Tensor, stop_requested: bool) -> StepResult:
        """One optimizer step over a global batch; all ranks learn whether any wants to stop."""
        step_start, step = time.perf_counter(), self.progress.step + 1
        engine, w = self.engine, self.writers
        # The learning rate of this step.
        lr = lr_at(self.progress.step, self.cfg.optim.lr, self.cfg.optim.warmup_steps,
                   self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        # This rank's share of the global batch.
        micro_batches = self.order.micro_batches(batch)
        mine = self.balance.mine(micro_batches)  # even, or by speed under --balance
        counts = bool(mine)
        if not counts:  # more ranks than micro-batches: join the sync with a pass worth nothing
            mine = micro_batches[:1]
        scale = 1.0 / len(batch) if counts else 0.0
        if w.faults.fires("nan-grad", step):
            scale = math.nan  # this rank's gradients, poisoned for a test
        audited = w.audit.indices(mine if counts else [])  # read before any collective

        # Forward and backward, micro-batch by micro-batch; DDP sums on the last one.
        self.bn_stats.begin_step()
        self.regroup.step_begins()
        engine.begin_step(self.comm)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        correct = torch.zeros((), dtype=torch.float64, device=self.device)
        data_wait = 0.0
        for i, indices in enumerate(mine):
            fetch_start = time.perf_counter()
            images, labels = self.train_data.batch(indices)
            data_wait += time.perf_counter() - fetch_start
            last = i == len(mine) - 1
            with self.bn_stats.record(counts), engine.sync_gradients(last):
                with engine.autocast():
                    logits = self.engine.net(images)
                    loss = F.cross_entropy(logits, labels, reduction="sum")
                with self.comm.waiting_if(engine.backward_waits(last)):  # DDP's sum waits here
                    (loss * scale).backward()
            if counts:
                loss_sum += loss.detach().double()
                correct += (logits.detach().argmax(1) == labels).sum()
        nonfinite = ~torch.isfinite(loss_sum)
        compute_s = engine.own_work_done()  # this rank's own work, without its wait: pace.py
        nonfinite |= engine.nonfinite_gradients(self.comm)

        # Recorded before the step's last collective: once any rank has finished the step (and
        # may checkpoint it), every rank's record is written, even if its node dies right after.
        w.audit.record(step, self.progress.epoch, self.env.rank, self.env.world_size, audited,
                       compute_s)
        # One collective for the step: loss, accuracy, the flags and own compute seconds of every
        # rank, the BatchNorm statistics; its head read back to the host once (the step's one sync), a wait for the
        # peers as long as the collective's own (marks nest: NCCL blocks in the read).
        flags = self.flags.write(checkpoint_failed=w.checkpointer.failed,
                                 leave_vote=self.regroup.leave_vote(), stop=stop_requested,
                                 nonfinite=nonfinite, admit=self.membership.admission_due(),
                                 evict_vote=self.eviction.vote())
        times = self.pace.write(compute_s)
        packed = torch.cat([loss_sum.view(1), correct.view(1), flags, times,
                            self.bn_stats.local_sums(self.device)])
        head = 2 + flags.numel() + times.numel()
        with self.comm.waiting():
            loss_total, correct_total, *summed = self.comm.all_reduce_(packed)[:head].tolist()
        checkpoint_failed, leave_voted, admit, evict_voted, stopping, nonfinite_ranks = \
            self.flags.read(summed)

        # Apply, or skip on every rank alike: no update, statistics as they were.
        if nonfinite_ranks:
            self.bn_stats.restore()
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.bn_stats.apply(packed[head:])
            self.optimizer.step()

        leavers = self.regroup.leavers(stopping, leave_voted, self.env.world_size)
        everyone_stops = bool(stopping) and (len(stopping) == self.env.world_size
                                             or not self.membership.in_process)
        return StepResult(loss=loss_total / len(batch), accuracy=correct_total / len(batch),
                          samples=len(batch), stop_requested=everyone_stops,
                          seconds=time.perf_counter() - step_start, data_wait_s=data_wait,
                          nonfinite_ranks=nonfinite_ranks, checkpoint_failed=checkpoint_failed,
                          leavers=leavers, admit=admit, evict_voted=evict_voted,
                          compute_s=summed[flags.numel():])

    def advance(self, samples: int) -> bool:
        """Moves the cursor past a completed step; True if that step ended the epoch."""
        p = self.progress
        self.regroup.step_done()
        p.step += 1
        p.samples_seen += samples
        p.cursor += samples
        if p.cursor >= self.order.num_samples:
            p.epoch, p.cursor = p.epoch + 1, 0
            return True
        return False

    # --- the stops the loop decides ------------------------------------------------------------

    def count_nonfinite(self, result: StepResult) -> None:
        """Counts a skipped step; TrainingDiverged after ``--max-nonfinite-steps`` in a row."""
        p = self.progress
        if not result.nonfinite_ranks:
            p.nonfinite_in_a_row = 0
            return
        p.nonfinite_steps += 1
        p.nonfinite_in_a_row += 1
        ranks = result.nonfinite_ranks
        self.report.nonfinite(ranks)
        limit = self.cfg.run.max_nonfinite_steps
        if p.nonfinite_in_a_row < limit:
            return
        message = (f"{limit} steps in a row (to step {p.step}) had non-finite loss or gradients "
                   f"(rank(s) {', '.join(map(str, ranks))} at the last); none was applied, and "
                   f"no checkpoint was written after them (--max-nonfinite-steps {limit}): "
                   f"lower --lr, or check the data")
        if not self.env.is_main:  # rank 0 says it, once
            raise PeerStopped(message, exit_code=EXIT_DIVERGED)
        self.writers.metrics.flush()
        raise TrainingDiverged(message)

    def stop_after_checkpoint_failure(self) -> None:
        """Rank 0 could not save: it says why (the writer's error, or its refusal), every rank
        stops with EXIT_CANNOT_SAVE."""
        self.writers.checkpointer.wait()  # raises the writer's error, or the refusal, on rank 0
        raise PeerStopped("rank 0 could not save a checkpoint", exit_code=EXIT_CANNOT_SAVE)
