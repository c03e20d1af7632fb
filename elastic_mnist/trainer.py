"""The training loop: global batches cut into micro-batches, shared by however many ranks there are.

The applied gradient is the mean over the global batch whatever the world size: each micro-batch's
summed loss is divided by the global batch's size, and gradients are *summed* across ranks. A rank
left without a micro-batch (more ranks than micro-batches) still joins the gradient sync with a pass
that counts for nothing.

Every collective of the loop is waited on through the membership (membership.py): when the group
loses a rank, the step fails, and :meth:`Trainer.recover` goes on with the ranks that are left, in
the same process, from the state they agree on.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from elastic_mnist import distributed
from elastic_mnist.batchnorm import GlobalBatchNormStats
from elastic_mnist.checkpoint import NullCheckpointer, snapshot
from elastic_mnist.config import TrainConfig
from elastic_mnist.data.datasets import Dataset, Digits
from elastic_mnist.data.fingerprint import SHORT
from elastic_mnist.data.order import SampleOrder, epoch_number, share
from elastic_mnist.env import DistEnv
from elastic_mnist.errors import (
    EXIT_CANNOT_SAVE,
    EXIT_DIVERGED,
    CannotRecover,
    CheckpointError,
    PeerFailure,
    PeerStopped,
    TrainingDiverged,
)
from elastic_mnist.events import NullEventLog, utc_time
from elastic_mnist.fast_path import (
    adamw_kernels,
    choose_compilation,
    micro_batches_per_rank,
    set_float32_math,
)
from elastic_mnist.metrics import NullMetrics
from elastic_mnist.model import build_model, state_digest
from elastic_mnist.progress import LogLines
from elastic_mnist.render import prediction_grid
from elastic_mnist.resilience.faults import Faults
from elastic_mnist.resilience.fence import NO_FENCE, NullFence
from elastic_mnist.resilience.membership import Change, NullMembership, Position
from elastic_mnist.resilience.preemption import StopRequest
from elastic_mnist.resilience.watchdog import NullWatchdog
from elastic_mnist.rng import restore_rng_state, rng_state

log = logging.getLogger(__name__)

# Config fields that fix which samples each step sees: a checkpoint written under other values
# cannot be continued exactly.
RESUME_INVARIANTS = (("optim", "seed"), ("optim", "global_batch_size"),
                     ("optim", "micro_batch_size"))
LEAVE_GRACE_S = 1.0
"""How long some ranks' stop request must stand alone before they leave and the others go on
without them: the nodes of one job told to stop together (a scheduler's preemption, the agents'
restart when a node joins) all ask within it, and then everyone stops at one step."""


@dataclass
class Progress:
    """Where training stands; the data cursor is ``cursor`` samples into ``epoch``'s order."""

    step: int = 0
    epoch: int = 0
    cursor: int = 0
    samples_seen: int = 0
    nonfinite_steps: int = 0
    """Steps skipped because their loss or gradients were not finite, in the whole run."""
    nonfinite_in_a_row: int = 0

    def epoch_number(self) -> int:
        """The epoch of the last completed step, counted from 1 (data/order.py)."""
        return epoch_number(self.step, self.epoch, self.cursor)


@dataclass
class StepResult:
    loss: float
    accuracy: float
    samples: int
    stop_requested: bool
    """Every rank asked to stop (or one did, where the others cannot go on without it)."""
    seconds: float = 0.0
    data_wait_s: float = 0.0
    nonfinite_ranks: list[int] = field(default_factory=list)
    """Ranks whose loss or own gradients were NaN or infinite: the step was skipped."""
    checkpoint_failed: bool = False
    """Rank 0 could not write a checkpoint: every rank stops."""
    leavers: list[int] = field(default_factory=list)
    """Ranks that asked to stop while the others go on without them, from the next step."""


class GradCheck:
    """The DDP hook's state: whether this rank's own gradients (before the sum) are finite, the
    membership whose guard the sum is waited on through, and on a GPU an event recorded where
    this rank's own work of the step ends and the sum begins."""

    def __init__(self, device: torch.device, membership: NullMembership):
        self.group = None  # the default process group
        self.nonfinite = torch.zeros((), dtype=torch.bool, device=device)
        self.membership = membership
        self.computed = torch.cuda.Event() if device.type == "cuda" else None


class StepFlags:
    """This rank's flags in the step's one collective, in a tensor allocated once and written
    by kernels on its device (``fill_``, a copy from the device), never copied from the host:
    whether rank 0's last save failed, a vote that the ranks asking to stop leave, and per rank
    whether it asks to stop and whether its loss or gradients were not finite."""

    def __init__(self, rank: int, world_size: int, device: torch.device):
        self.rank, self.world_size = rank, world_size
        self.tensor = torch.zeros(2 + 2 * world_size, dtype=torch.float64, device=device)

    def write(self, *, checkpoint_failed: bool, leave_vote: bool, stop: bool,
              nonfinite: torch.Tensor) -> torch.Tensor:
        flags = self.tensor
        flags.zero_()
        if checkpoint_failed:
            flags[0].fill_(1)
        if leave_vote:
            flags[1].fill_(1)
        if stop:
            flags[2 + self.rank].fill_(1)
        flags[2 + self.world_size + self.rank].copy_(nonfinite)
        return flags

    def read(self, summed: list[float]) -> tuple[bool, bool, list[int], list[int]]:
        """(a save failed, some rank voted to let the stopping ranks leave, the ranks asking to
        stop, the ranks whose values were not finite) from the summed flags."""
        stops, nonfinite = summed[2:2 + self.world_size], summed[2 + self.world_size:]
        return (summed[0] > 0, summed[1] > 0, [r for r, v in enumerate(stops) if v > 0],
                [r for r, v in enumerate(nonfinite) if v > 0])


def require_group() -> None:
    """Raises PeerFailure when this process has no process group any more: torch clears the
    default group when a generation's NCCL communicator is aborted (``Membership.abort``), and
    a collective skipped for want of a group would hand back this rank's own values."""
    if not dist.is_initialized():
        raise PeerFailure("the process group is gone (its generation was aborted)")


def sum_allreduce_hook(state, bucket):
    """DDP communication hook that sums gradients (the loss is already divided by the batch),
    noting first whether this rank's own gradients hold NaN or infinity (without a sync).

    A group of one has nothing to sum: its bucket comes back as it is, without a round trip
    through the backend's threads (which costs whole milliseconds on a busy machine).

    Unannotated on purpose: DDP checks the annotations' runtime values, which postponed
    annotations turn into strings.
    """
    state.nonfinite |= ~torch.isfinite(bucket.buffer()).all()
    if state.computed is not None:
        state.computed.record()  # the step's own kernels are queued before it: see _own_work_done
    require_group()
    if dist.get_world_size(state.group) == 1:
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done
    work = dist.all_reduce(bucket.buffer(), group=state.group, async_op=True)
    return state.membership.guard(work.get_future()).then(lambda fut: fut.value()[0])


def lr_at(step: int, peak: float, warmup: int, total: int) -> float:
    """Linear warm-up to ``peak`` over ``warmup`` steps, then cosine decay to zero at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


class AuditLog:
    """``--audit-samples``: one JSON line per step with the sample indices this rank used,
    written as the rank reaches the step's last collective (scripts/check_audit.py takes, for each
    step, the newest generation's records, so a step cut short and redone counts once). Each
    record passes ``fence`` (a verdict of the last second will do)."""

    def __init__(self, path: Path | None, fence: NullFence = NO_FENCE):
        self.fence = fence
        self.file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a", buffering=1)  # noqa: SIM115 - closed by close()

    def indices(self, micro_batches: list[torch.Tensor]) -> list[int]:
        """The sample indices of this rank's micro-batches, read back from the device at the
        step's start, before it queues a collective (a read behind one waits for the peers)."""
        if self.file is None or not micro_batches:  # they leave the device only for the audit
            return []
        return torch.cat(micro_batches).tolist()

    def record(self, step: int, epoch: int, rank: int, world_size: int,
               indices: list[int]) -> None:
        if self.file is not None:
            self.fence.check(recent=True)
            self.file.write(json.dumps({"step": step, "epoch": epoch, "rank": rank,
                                        "world_size": world_size, "time": time.time(),
                                        "indices": indices}) + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


@torch.no_grad()
def evaluate(model: nn.Module, digits: Digits, device: torch.device, env: DistEnv,
             batch_size: int = 1000,
             computing: contextlib.AbstractContextManager | None = None,
             waiting: contextlib.AbstractContextManager | None = None,
             all_reduce_: Callable[[torch.Tensor], torch.Tensor] = distributed.all_reduce_,
             ) -> tuple[float, float]:
    """(mean loss, accuracy) over the whole split; each rank computes a share, then all reduce.

    ``digits`` on ``device`` (the Trainer keeps both splits there) means no batch is copied.
    ``computing`` is entered around this rank's share (the watchdog's "busy": not the wait),
    ``waiting`` around the sum of the ranks' totals and its read, where NCCL blocks;
    ``all_reduce_`` sums the ranks' totals.
    """
    was_training = model.training
    model.eval()
    try:
        mine = torch.arange(env.rank, len(digits), env.world_size, device=digits.labels.device)
        totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
        with computing or contextlib.nullcontext():
            for indices in torch.split(mine, batch_size):
                images, labels = digits.batch(indices)  # where the split lives: on the device
                logits = model(images.to(device, non_blocking=True))
                labels = labels.to(device, non_blocking=True)
                totals[0] += F.cross_entropy(logits, labels, reduction="sum").double()
                totals[1] += (logits.argmax(1) == labels).sum()
                totals[2] += labels.numel()
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the share is computed before the wait begins
        with waiting or contextlib.nullcontext():
            loss_sum, correct, count = all_reduce_(totals).tolist()
    finally:
        model.train(was_training)
    return loss_sum / max(count, 1), correct / max(count, 1)


class Trainer:
    """Owns the model, optimizer and progress of one worker, and runs the loop."""

    def __init__(self, cfg: TrainConfig, env: DistEnv, device: torch.device, dataset: Dataset, *,
                 run_id: str, restart_generation: int,
                 metrics: NullMetrics | None = None,
                 checkpointer: NullCheckpointer | None = None,
                 audit: AuditLog | None = None,
                 membership: NullMembership | None = None):
        self.cfg, self.env, self.device = cfg, env, device
        self.run_id, self.restart_generation = run_id, restart_generation
        self.dataset = dataset
        self.train_data = dataset.train.to(device)
        self.test_data = dataset.test.to(device)  # both splits resident: no copy per batch
        self.metrics = metrics or NullMetrics()
        self.checkpointer = checkpointer or NullCheckpointer()
        self.audit = audit or AuditLog(None)
        self.events: NullEventLog = NullEventLog()
        self.watchdog: NullWatchdog = NullWatchdog()
        self.membership = membership or NullMembership()
        self.on_change: Callable[[Change], None] = lambda change: None
        """Called after a change of membership, before the next step: rank 0's duties move."""
        self.faults = Faults()
        self.display: LogLines = LogLines()
        self.last_eval: tuple[float, float] | None = None
        self.last_eval_step = -1
        self.mid_step = False
        """A step has begun and not completed: what it changed is undone if it fails."""
        self.change: Change | None = None
        """The last change of membership, until the first step after it completes."""
        self.owed: Change | None = None
        """The last change of membership, until what its agreed step owes is done."""
        self._partial_stop_since: float | None = None
        o = cfg.optim
        self.order = SampleOrder(len(dataset.train), o.global_batch_size, o.micro_batch_size,
                                 o.seed)
        self.total_steps = o.epochs * self.order.steps_per_epoch
        if o.max_steps:
            self.total_steps = min(self.total_steps, o.max_steps)
        self.total_epochs = math.ceil(self.total_steps / self.order.steps_per_epoch)
        """Epochs this run trains in (fewer than --epochs when --max-steps ends it sooner)."""

        if device.type == "cuda":
            torch.backends.cudnn.benchmark = True  # shapes never change: autotune once
        self.float32_math = set_float32_math(cfg.run.precision)
        self.model = build_model(o.seed).to(device)
        if cfg.run.channels_last:
            self.model.to(memory_format=torch.channels_last)
        self.bn_stats = GlobalBatchNormStats(self.model, compiled=cfg.run.compile)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr,
                                           weight_decay=o.weight_decay, **adamw_kernels(device))
        self.grad_check = GradCheck(device, self.membership)
        if env.world_size > 1 and not (env.is_distributed and o.grad_sync == "ddp"):
            for tensor in self.model.state_dict().values():
                dist.broadcast(tensor, src=0)
        self.ddp, self.net = self._wrap()
        self._retired: list[nn.Module] = []
        """Wrappers of groups left behind: gloo's threads may still wait in them."""
        self.flags = StepFlags(env.rank, env.world_size, device)
        self.compiled_sizes: set[int] = set()
        """Micro-batch sizes this process has run compiled; a new one recompiles."""
        log.info("precision %s; compile: %s", self.float32_math, self.compilation.describe())
        self.progress = Progress()
        self.window = _Window()
        """The step results since the last log line."""
        self.resumed_from: int | None = None
        self.resumed_source: str | None = None

    def _wrap(self, sync: bool = True) -> tuple[DistributedDataParallel | None, nn.Module]:
        """The model as the loop runs it: in DDP on the current group (under torchrun, even
        alone, unless the gradients are synced by hand), compiled if asked. ``sync``: DDP's
        collectives at construction (a check of the parameters' shapes, rank 0's parameters
        broadcast), which a recovery does without: its ranks took one agreed state."""
        ddp = None
        if self.env.is_distributed and self.cfg.optim.grad_sync == "ddp":
            with warnings.catch_warnings():  # its successor would sync buffers at start-up
                warnings.filterwarnings("ignore", message=".*broadcast_buffers.*deprecated")
                ddp = DistributedDataParallel(
                    self.model,
                    device_ids=[self.device.index] if self.device.type == "cuda" else None,
                    broadcast_buffers=False,  # GlobalBatchNormStats keeps buffers equal
                    bucket_cap_mb=1,  # one bucket: all gradients are 116 kB
                    gradient_as_bucket_view=True,  # no copy between gradients and bucket
                    init_sync=sync)
            ddp.register_comm_hook(self.grad_check, sum_allreduce_hook)
        self.buckets_rebuilt = ddp is None
        """DDP's one regrouping of its buckets, after its first backward, is done."""
        net: nn.Module = ddp if ddp is not None else self.model
        o = self.cfg.optim  # the micro-batches per rank change with the world size: chosen anew
        self.compilation = choose_compilation(
            self.device.type, micro_batches_per_rank(o.global_batch_size, o.micro_batch_size,
                                                     self.env.world_size), self.cfg.run.compile)
        if self.compilation.mode is not None:  # with or without CUDA graphs: fast_path.py
            net = torch.compile(net, mode=self.compilation.mode)
        return ddp, net

    # --- state ---------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Everything needed to continue exactly: the payload of a checkpoint."""
        return {
            "format": 1,
            "model": self.model.state_dict(),  # the unwrapped module, never the DDP wrapper
            "optimizer": self.optimizer.state_dict(),
            "progress": asdict(self.progress),
            "rng": rng_state(self.device),  # this device's CUDA generator, not every GPU's
            "config": self.cfg.to_dict(),
            "data": {"kind": self.dataset.kind, "num_train": len(self.dataset.train),
                     "fingerprint": self.dataset.fingerprint},
            "world_size": self.env.world_size,
            "run_id": self.run_id,
        }

    def restore(self, payload: dict[str, Any], source: str) -> None:
        """Continues from a checkpoint's payload, or says precisely why it does not fit."""
        check_compatible(payload, self.model, self.cfg, self.dataset, source)
        self.load_state(payload)
        self.resumed_from = self.progress.step
        self.resumed_source = source

    def load_state(self, payload: dict[str, Any]) -> None:
        """Takes the state of a payload (a checkpoint's, or a peer's after a change)."""
        self.model.load_state_dict(payload["model"])
        saved = payload["optimizer"]
        kernels = {key: self.optimizer.defaults[key] for key in ("fused", "foreach")}
        # This device's kernels, whatever device saved the state (set before the load, which
        # places each parameter's step count where the fused kernel wants it).
        self.optimizer.load_state_dict({**saved, "param_groups": [
            {**group, **kernels} for group in saved["param_groups"]]})
        for group in self.optimizer.param_groups:  # flags may change between launches
            group["weight_decay"] = self.cfg.optim.weight_decay
        self.progress = Progress(**payload["progress"])
        restore_rng_state(payload["rng"], self.device)

    # --- the loop ------------------------------------------------------------------------------

    def done(self) -> bool:
        return self.progress.step >= self.total_steps

    def fit(self, stop: StopRequest) -> str:
        """Trains until done or asked to stop; returns 'finished', 'preempted' (every rank
        stops) or 'left' (this rank stops, the others go on)."""
        self.window = _Window()  # start-up is no part of the first window's rate
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
                self.recover(detail=str(failure).strip().splitlines()[0])
                continue
            if result.stop_requested:
                return "preempted"
            if self.env.rank in result.leavers:
                return "left"
            if result.leavers:
                self.recover(why="left", suspects=tuple(result.leavers))

    def iteration(self, stop_requested: bool) -> StepResult:
        """One turn of the loop: the next step, then what follows it (progress, scalars every
        ``--log-every`` steps, the evaluation at an epoch's end, the checkpoint when due)."""
        batch = self.global_batch()
        self.faults.maybe_hang(self.progress.step + 1)
        with self._compiling(batch):
            result = self.train_step(batch, stop_requested)
        self.watchdog.step_done(self.progress.step + 1, result.seconds)
        if result.checkpoint_failed:
            self.stop_after_checkpoint_failure()
        epoch_ended = self.advance(len(batch))
        changed = self.change is not None
        if changed:
            self.report_change()
        # Work of this rank alone is "busy" for the watchdog (peers wait for it, not for a hung
        # rank); a collective inside the evaluation is waiting, like a step's.
        with self.watchdog.busy("logging"):
            self.count_nonfinite(result)
            if not result.nonfinite_ranks:
                self.window.add(result)
            self.display.update(self.epoch_label(), self.progress.step, self.total_steps,
                                result.loss, self.window.samples_per_s())
            if (self.should_log() or epoch_ended) and self.window.results:
                self.log_training(self.window.drain())
            elif changed:  # the world size drops at the step where it happened
                self.metrics.scalars(self.progress.step, {
                    "elastic/world_size": self.env.world_size,
                    "elastic/restart_generation": self.restart_generation})
        if epoch_ended or self.done():
            self.log_evaluation()
        if self.env.rank not in result.leavers:  # a rank 0 that leaves hands its save on
            self.maybe_checkpoint(epoch_ended, final=self.done() or result.stop_requested)
        return result

    def maybe_checkpoint(self, epoch_ended: bool, final: bool) -> None:
        with self.watchdog.busy("checkpointing"):
            if self.checkpointer.maybe_save(self.state, self.progress.step,
                                            epoch_end=epoch_ended, final=final):
                self.metrics.flush()  # what a resume keeps (steps up to this one) is on disk

    # --- a change of membership, in process ----------------------------------------------------

    def position(self) -> Position:
        return Position(step=self.progress.step, mid_step=self.mid_step,
                        evaluated_step=self.last_eval_step)

    def recover(self, why: str = "died", suspects: tuple[int, ...] = (), detail: str = "") -> None:
        """Goes on with the ranks that are left: one agreed state, a new group, rank 0's duties
        where they now belong. Raises CannotRecover when this rank cannot go on."""
        self.watchdog.close(wait=False)  # it watched the group that is gone
        self.membership.inject = partial(self.faults.maybe_strike_recovery,
                                         step=self.progress.step + 1)
        while True:
            self.rollback()
            try:
                change = self.membership.recover(self.position(), why, suspects, detail)
                self.adopt(change)
                break
            except PeerFailure as failure:  # the new group lost a member too: the next round
                why, suspects, detail = "died", (), str(failure).strip().splitlines()[0]
            except CannotRecover as e:
                self.membership.fall_back(str(e))
                raise
        log.warning("generation %d: world size %d -> %d at step %d (ranks %s %s); going on in "
                    "process", change.generation, change.old_world_size, change.env.world_size,
                    change.step, ", ".join(str(lost["rank"]) for lost in change.lost) or "none",
                    change.why)
        self.on_change(change)
        self.owed = change

    def rollback(self) -> None:
        """Undoes what a step cut short left: its BatchNorm passes' statistics, its gradients
        (garbage where a collective was given up on), evaluation mode."""
        if self.mid_step:
            self.bn_stats.restore()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)

    def adopt(self, change: Change) -> None:
        """Joins the new world: the state of the first survivor at the agreed step (the step
        everyone completed, or the one some completed: theirs is whole), then the model in a
        DDP of the new group. The old wrappers are kept, never freed: the old group's threads
        may still hold its buffers. Their hooks on the parameters go: each takes its reducer's
        lock, which a thread left waiting in that group (:meth:`_rebuild_buckets`) may hold."""
        self.env, self.restart_generation = change.env, change.generation
        self.mid_step = False
        self._partial_stop_since = None
        self._retired.append(self.net)
        if self.ddp is not None:
            self.ddp.reducer._remove_autograd_hooks()
            self.ddp = None

        group, holds = dist.group.WORLD, self.env.rank == change.holder  # the new generation's
        # In host memory: pickled GPU tensors would land on the holder's GPU index on every
        # receiver; each receiver loads the state onto its own device.
        state = snapshot(self.state()) if holds else None

        def join() -> tuple[dict[str, Any], list[object]]:
            """The new group's collectives, on the group they are given: the agreed state and
            every rank's digest of it. Nothing here changes this trainer: a round given up on
            (the membership then begins the next one, from the state agreed on) may complete
            later, and its state is never loaded."""
            payload = distributed.broadcast_object(state, change.holder, self.device, group)
            return payload, distributed.all_gather_object(state_digest(payload["model"]),
                                                          self.device, group)

        self.membership.inject("adopting the agreed state")
        payload, digests = self.membership.run("adopting the agreed state", join)
        if len(set(digests)) != 1:
            raise CannotRecover(f"the survivors hold different models after agreeing on step "
                                f"{change.step}: {sorted(set(digests))}")
        if not holds:
            self.load_state(payload)
        self.ddp, self.net = self._wrap(sync=False)  # the same state everywhere: no collective
        # The digests above are of the one payload broadcast, alike on every rank: what this
        # rank now holds is compared with them here, by itself.
        held = state_digest(self.model.state_dict())
        if held != digests[0]:
            raise CannotRecover(f"rank {self.env.rank} holds another model than the agreed one "
                                f"after adopting step {change.step}: digest {held[:16]}, agreed "
                                f"{str(digests[0])[:16]}")
        self.compiled_sizes = set()
        self.flags = StepFlags(self.env.rank, self.env.world_size, self.device)
        self.change, self._agreed_digest, self._regrouped_at = change, digests[0], time.time()

    def catch_up(self, change: Change) -> None:
        """What the agreed step still owes when the fault came after it: its evaluation (unless
        rank 0 has it) and its checkpoint."""
        ended = self.progress.cursor == 0 and self.progress.step > 0
        if (ended or self.done()) and change.evaluated_step != self.progress.step:
            self.log_evaluation()
        self.maybe_checkpoint(ended, final=self.done())
        self.owed = None

    def report_change(self) -> None:
        """Once the new group's first step is done: the ``shrink`` record."""
        change, self.change = self.change, None
        self.membership.recovered()
        seconds = time.monotonic() - change.detected
        self.events.emit("shrink", change.step, old_world_size=change.old_world_size,
                         new_world_size=self.env.world_size,
                         lost_ranks=[lost["rank"] for lost in change.lost],
                         lost_hosts=[lost["host"] for lost in change.lost], why=change.why,
                         lost=change.lost, restart_generation=change.generation,
                         detection_to_step_s=round(seconds, 3),
                         steps_redone=change.steps_redone,
                         detected_time=utc_time(change.detected_at),
                         regrouped_time=utc_time(self._regrouped_at),
                         model_digest=self._agreed_digest)
        log.info("first step after the change: %.2f s after it was detected", seconds)

    def leavers(self, stopping: list[int], voted: bool) -> list[int]:
        """The ranks that go while the others go on without them: some asked to stop, the others
        can go on in process, and the request stood alone for LEAVE_GRACE_S (a vote of the
        step, so that every rank decides alike)."""
        if not (self.membership.in_process and 0 < len(stopping) < self.env.world_size):
            self._partial_stop_since = None
            return []
        if self._partial_stop_since is None:
            self._partial_stop_since = time.monotonic()
        return stopping if voted else []

    def leave_vote(self) -> bool:
        return (self._partial_stop_since is not None
                and time.monotonic() - self._partial_stop_since >= LEAVE_GRACE_S)

    def count_nonfinite(self, result: StepResult) -> None:
        """Counts a skipped step; TrainingDiverged after ``--max-nonfinite-steps`` in a row."""
        p = self.progress
        if not result.nonfinite_ranks:
            p.nonfinite_in_a_row = 0
            return
        p.nonfinite_steps += 1
        p.nonfinite_in_a_row += 1
        ranks = result.nonfinite_ranks
        log.warning("step %d skipped: non-finite loss or gradients on rank(s) %s (%d in a row)",
                    p.step, ", ".join(map(str, ranks)), p.nonfinite_in_a_row)
        self.events.emit("nonfinite", p.step, rank=ranks[0], ranks=ranks,
                         in_a_row=p.nonfinite_in_a_row)
        self.metrics.scalars(p.step, {"train/nonfinite_steps": p.nonfinite_steps})
        limit = self.cfg.run.max_nonfinite_steps
        if p.nonfinite_in_a_row < limit:
            return
        message = (f"{limit} steps in a row (to step {p.step}) had non-finite loss or gradients "
                   f"(rank(s) {', '.join(map(str, ranks))} at the last); none was applied, and "
                   f"no checkpoint was written after them (--max-nonfinite-steps {limit}): "
                   f"lower --lr, or check the data")
        if not self.env.is_main:  # rank 0 says it, once
            raise PeerStopped(message, exit_code=EXIT_DIVERGED)
        self.metrics.flush()
        raise TrainingDiverged(message)

    def stop_after_checkpoint_failure(self) -> None:
        """Rank 0 could not save: it says why (the writer's error), every rank stops."""
        self.checkpointer.wait()  # raises the writer's error on rank 0
        raise PeerStopped("rank 0 could not write a checkpoint", exit_code=EXIT_CANNOT_SAVE)

    def global_batch(self) -> torch.Tensor:
        """The next step's sample indices, on the data's device."""
        return self.order.global_batch(self.progress.epoch, self.progress.cursor,
                                       self.train_data.labels.device)

    def train_step(self, batch: torch.Tensor, stop_requested: bool) -> StepResult:
        """One optimizer step over a global batch; all ranks learn whether any wants to stop."""
        step_start = time.perf_counter()
        lr = lr_at(self.progress.step, self.cfg.optim.lr, self.cfg.optim.warmup_steps,
                   self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        micro_batches = self.order.micro_batches(batch)
        mine = share(micro_batches, self.env.rank, self.env.world_size)
        counts = bool(mine)
        if not counts:  # more ranks than micro-batches: join the sync with a pass worth nothing
            mine = micro_batches[:1]
        scale = 1.0 / len(batch) if counts else 0.0
        if self.faults.fires("nan-grad", self.progress.step + 1):
            scale = math.nan  # this rank's gradients, poisoned for a test

        audited = self.audit.indices(mine if counts else [])  # read before any collective
        self.bn_stats.begin_step()
        self.mid_step = True
        if not self.buckets_rebuilt:
            self._rebuild_buckets()
        self.optimizer.zero_grad(set_to_none=True)
        self.grad_check.nonfinite.zero_()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        correct = torch.zeros((), dtype=torch.float64, device=self.device)
        data_wait = 0.0
        for i, indices in enumerate(mine):
            fetch_start = time.perf_counter()
            images, labels = self.train_data.batch(indices)
            data_wait += time.perf_counter() - fetch_start
            syncs = i == len(mine) - 1
            with self.bn_stats.record(counts), self._sync_gradients(syncs):
                with self._autocast():
                    logits = self.net(images)
                    loss = F.cross_entropy(logits, labels, reduction="sum")
                with self._waiting_if(syncs and self.ddp is not None):  # DDP's sum waits here
                    (loss * scale).backward()
            if counts:
                loss_sum += loss.detach().double()
                correct += (logits.detach().argmax(1) == labels).sum()
        nonfinite = ~torch.isfinite(loss_sum)
        self._own_work_done()
        if self.ddp is not None:  # DDP's hook looked at this rank's gradients before the sum
            nonfinite |= self.grad_check.nonfinite
        else:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            nonfinite |= ~torch.isfinite(torch.nn.utils.get_total_norm(grads))
            if self.env.world_size > 1:
                self._all_reduce_gradients()

        # Recorded before the step's last collective: once any rank has finished the step (and
        # may checkpoint it), every rank's record is written, even if its node dies right after.
        self.audit.record(self.progress.step + 1, self.progress.epoch, self.env.rank,
                          self.env.world_size, audited)
        # One collective for the step: loss, accuracy, the flags of every rank, the BatchNorm
        # statistics; its head read back to the host once (the step's one sync), a wait for the
        # peers as long as the collective's own (marks nest: NCCL blocks in the read).
        flags = self.flags.write(checkpoint_failed=self.checkpointer.failed,
                                 leave_vote=self.leave_vote(), stop=stop_requested,
                                 nonfinite=nonfinite)
        packed = torch.cat([loss_sum.view(1), correct.view(1), flags,
                            self.bn_stats.local_sums(self.device)])
        head = 2 + flags.numel()
        with self.watchdog.waiting():
            loss_total, correct_total, *summed = self._all_reduce_(packed)[:head].tolist()
        checkpoint_failed, leave_voted, stopping, nonfinite_ranks = self.flags.read(summed)
        if nonfinite_ranks:  # skipped on every rank alike: no update, statistics as they were
            self.bn_stats.restore()
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.bn_stats.apply(packed[head:])
            self.optimizer.step()

        leavers = self.leavers(stopping, leave_voted)
        everyone_stops = bool(stopping) and (len(stopping) == self.env.world_size
                                             or not self.membership.in_process)
        return StepResult(loss=loss_total / len(batch), accuracy=correct_total / len(batch),
                          samples=len(batch), stop_requested=everyone_stops,
                          seconds=time.perf_counter() - step_start, data_wait_s=data_wait,
                          nonfinite_ranks=nonfinite_ranks, checkpoint_failed=checkpoint_failed,
                          leavers=leavers)

    def _compiling(self, batch: torch.Tensor) -> contextlib.AbstractContextManager:
        """Under --compile, a step that gives this rank a micro-batch size it has not run yet (an
        epoch's short last micro-batch) recompiles the model: seconds of work of its own, which
        the watchdog must not take for a hang."""
        if self.compilation.mode is None:
            return contextlib.nullcontext()
        micro_batches = self.order.micro_batches(batch)
        sizes = {len(m) for m in share(micro_batches, self.env.rank, self.env.world_size)
                 or micro_batches[:1]}
        if sizes <= self.compiled_sizes:
            return contextlib.nullcontext()
        self.compiled_sizes |= sizes
        return self.watchdog.busy("compiling")

    def _autocast(self) -> torch.autocast:
        """The forward pass in bf16 under ``--precision bf16``, else as it is."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16,
                              enabled=self.cfg.run.precision == "bf16")

    def _sync_gradients(self, last_micro_batch: bool):
        """DDP syncs gradients on a rank's last micro-batch only (accumulating before it)."""
        if self.ddp is None or last_micro_batch:
            return contextlib.nullcontext()
        return self.ddp.no_sync()

    def _rebuild_buckets(self) -> None:
        """DDP regroups its buckets once, in the order its first backward made the gradients
        ready, at the next forward, by a broadcast from rank 0 that blocks and that nothing can
        give up on: a peer lost meanwhile ends this rank (gloo: "Connection reset by peer"), a
        frozen one holds it until the group's timeout. Done here instead, as DDP's own join hook
        does it, in a thread of its own, waited on through the membership like the step's other
        collectives (the thread of a group given up on is left to gloo's timeout)."""
        ddp, done = self.ddp, torch.futures.Future()

        def rebuild() -> None:
            try:
                done.set_result(ddp.reducer._rebuild_buckets())
            except Exception as e:  # noqa: BLE001 - the backend's error, handed to the waiter
                done.set_exception(e)

        threading.Thread(target=rebuild, daemon=True, name="ddp-rebuild-buckets").start()
        with self.watchdog.waiting():
            rebuilt = self.membership.guard(done).wait()
        if rebuilt:  # False before the first backward: nothing to regroup yet
            self.buckets_rebuilt = ddp._has_rebuilt_buckets = True

    def _own_work_done(self) -> None:
        """On a GPU, waits for this rank's own kernels of the step before the waits for its peers
        (marked by the watchdog): a device that never finishes its own share blocks here,
        unmarked, and is named, not taken for one waiting. Under DDP the sum was launched in the
        backward already, after an event the hook recorded: only the work before it is waited
        for. Else nothing of the peers is queued yet."""
        if self.device.type != "cuda" or self.env.world_size == 1:
            return
        if self.ddp is not None:
            self.grad_check.computed.synchronize()
        else:
            torch.cuda.synchronize(self.device)

    def _waiting_if(self, waits: bool):
        return self.watchdog.waiting() if waits else contextlib.nullcontext()

    def _all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums ``tensor`` over the ranks in place, waited on through the membership: the wait
        ends when the group loses a rank, even if the collective never returns. In a world of
        more than one, a group that is gone fails it too: never this rank's values as the sum."""
        if self.env.world_size > 1:
            require_group()
            work = dist.all_reduce(tensor, async_op=True)
            with self.watchdog.waiting():
                self.membership.guard(work.get_future()).wait()
        return tensor

    def _all_reduce_gradients(self) -> None:
        """The seeds' hand-written gradient sync (``--grad-sync allreduce``), summing."""
        for param in self.model.parameters():
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            self._all_reduce_(param.grad)

    def advance(self, samples: int) -> bool:
        """Moves the cursor past a completed step; True if that step ended the epoch."""
        p = self.progress
        self.mid_step = False
        p.step += 1
        p.samples_seen += samples
        p.cursor += samples
        if p.cursor >= self.order.num_samples:
            p.epoch, p.cursor = p.epoch + 1, 0
            return True
        return False

    # --- reporting -----------------------------------------------------------------------------

    def should_log(self) -> bool:
        return self.progress.step % self.cfg.run.log_every == 0 or self.done()

    def log_training(self, window: dict[str, float]) -> None:
        p = self.progress
        lr = self.optimizer.param_groups[0]["lr"]
        self.metrics.scalars(p.step, {
            "train/loss": window["loss"], "train/accuracy": window["accuracy"],
            "opt/lr": lr, "perf/samples_per_s": window["samples_per_s"],
            "perf/step_ms": window["step_ms"], "perf/data_wait_pct": window["data_wait_pct"],
            "elastic/world_size": self.env.world_size,
            "elastic/restart_generation": self.restart_generation,
            "train/nonfinite_steps": p.nonfinite_steps, "train/epoch": p.epoch_number(),
        })
        log.info("epoch %s step %d/%d loss %.4f acc %.2f%% lr %.2e %.0f samples/s",
                 self.epoch_label(), p.step, self.total_steps, window["loss"],
                 100 * window["accuracy"], lr, window["samples_per_s"])

    def log_evaluation(self) -> tuple[float, float]:
        step = self.progress.step
        loss, accuracy = evaluate(self.model, self.test_data, self.device, self.env,
                                  computing=self.watchdog.busy("evaluating"),
                                  waiting=self.watchdog.waiting(), all_reduce_=self._all_reduce_)
        with self.watchdog.busy("logging"):
            self.metrics.scalars(step, {"test/loss": loss, "test/accuracy": accuracy})
            if self.env.is_main:
                self.metrics.image("test/predictions", self.prediction_grid(), step)
            self.metrics.flush()
            epoch_done = self.progress.cursor == 0
            self.events.emit("eval", step, accuracy=accuracy, loss=loss,
                             epoch=self.progress.epoch_number(), epoch_done=epoch_done)
        self.last_eval, self.last_eval_step = (loss, accuracy), step
        steps_in = step - (self.progress.epoch_number() - 1) * self.order.steps_per_epoch
        where = ("done" if epoch_done else
                 f"ends after {steps_in} of its {self.order.steps_per_epoch} steps")
        log.info("epoch %s %s at step %d: test loss %.4f, test accuracy %.2f%%",
                 self.epoch_label(), where, step, loss, 100 * accuracy)
        return loss, accuracy

    def epoch_label(self) -> str:
        """``N/E``: the epoch of the last completed step (from 1) of the epochs this run trains
        in, as logs and the progress bar show it."""
        return f"{self.progress.epoch_number()}/{self.total_epochs}"

    def whereabouts(self) -> str:
        """Where a resumed run continues: the step, and how far into which epoch."""
        p = self.progress
        if self.done():
            return f"step {p.step}, the end of epoch {self.epoch_label()}: nothing left to train"
        return (f"step {p.step}, {p.cursor} of {self.order.num_samples} samples into epoch "
                f"{p.epoch + 1}/{self.total_epochs}")

    @torch.no_grad()
    def prediction_grid(self, count: int = 16) -> torch.Tensor:
        """The first test digits with the model's predictions, as an RGB image."""
        test = self.dataset.test  # the host's copy, for the picture
        count = min(count, len(test))
        images, _ = self.test_data.batch(torch.arange(count, device=self.test_data.labels.device))
        self.model.eval()
        predicted = self.model(images).argmax(1).cpu()
        self.model.train()
        return prediction_grid(test.images[:count], predicted, test.labels[:count])


class _Window:
    """Means of the step results since the last log line."""

    def __init__(self) -> None:
        self.results: list[StepResult] = []
        self.start = time.perf_counter()

    def add(self, result: StepResult) -> None:
        self.results.append(result)

    def samples_per_s(self) -> float:
        elapsed = time.perf_counter() - self.start
        return sum(r.samples for r in self.results) / elapsed if elapsed > 0 else 0.0

    def drain(self) -> dict[str, float]:
        elapsed = time.perf_counter() - self.start
        samples = sum(r.samples for r in self.results)
        summary = {
            "loss": sum(r.loss * r.samples for r in self.results) / samples,
            "accuracy": sum(r.accuracy * r.samples for r in self.results) / samples,
            "samples_per_s": samples / elapsed,
            "step_ms": 1e3 * elapsed / len(self.results),
            "data_wait_pct": 100 * sum(r.data_wait_s for r in self.results) / elapsed,
        }
        self.results, self.start = [], time.perf_counter()
        return summary


def check_compatible(payload: dict[str, Any], model: nn.Module, cfg: TrainConfig,
                     dataset: Dataset, source: str) -> None:
    """Raises CheckpointError naming the first mismatch between a checkpoint and this run."""
    theirs, ours = payload["model"], model.state_dict()
    if set(theirs) != set(ours):
        missing, extra = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
        raise CheckpointError(f"{source} is from a different model: missing {missing[:3]}, "
                              f"unexpected {extra[:3]}")
    for key, tensor in ours.items():
        if tuple(theirs[key].shape) != tuple(tensor.shape):
            raise CheckpointError(f"{source} is from a different model: {key} has shape "
                                  f"{tuple(theirs[key].shape)}, this model {tuple(tensor.shape)}")
    for section, name in RESUME_INVARIANTS:
        was = payload["config"][section][name]
        now = getattr(getattr(cfg, section), name)
        if was != now:
            raise CheckpointError(f"{source} was written with --{name.replace('_', '-')}={was}, "
                                  f"this run has {now}; use another --checkpoint-dir")
    data = payload["data"]
    if (data["kind"], data["num_train"]) != (dataset.kind, len(dataset.train)):
        raise CheckpointError(f"{source} was trained on {data['num_train']} {data['kind']} "
                              f"samples, this run has {len(dataset.train)} {dataset.kind}")
    # Checkpoints written before fingerprints existed lack one: nothing to compare.
    if data.get("fingerprint", dataset.fingerprint) != dataset.fingerprint:
        raise CheckpointError(f"{source} was trained on other digits (fingerprint "
                              f"{data['fingerprint'][:SHORT]}, this run's data "
                              f"{dataset.fingerprint[:SHORT]} in {dataset.root}); use the same "
                              f"data or another --checkpoint-dir")
