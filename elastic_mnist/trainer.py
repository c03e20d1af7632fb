"""The training loop: global batches cut into micro-batches, shared by however many ranks there are.

The applied gradient is the mean over the global batch whatever the world size: each micro-batch's
summed loss is divided by the global batch's size, and gradients are *summed* across ranks. A rank
left without a micro-batch (more ranks than micro-batches) still joins the gradient sync with a pass
that counts for nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from elastic_mnist import distributed
from elastic_mnist.batchnorm import GlobalBatchNormStats
from elastic_mnist.checkpoint import CheckpointError, NullCheckpointer
from elastic_mnist.config import TrainConfig
from elastic_mnist.data.datasets import Dataset, Digits
from elastic_mnist.data.fingerprint import SHORT
from elastic_mnist.data.order import SampleOrder, epoch_number, share
from elastic_mnist.env import DistEnv
from elastic_mnist.events import NullEventLog
from elastic_mnist.faults import Faults
from elastic_mnist.metrics import NullMetrics
from elastic_mnist.model import build_model
from elastic_mnist.preemption import StopRequest
from elastic_mnist.progress import LogLines
from elastic_mnist.render import prediction_grid
from elastic_mnist.watchdog import NullWatchdog

log = logging.getLogger(__name__)

# Config fields that fix which samples each step sees: a checkpoint written under other values
# cannot be continued exactly.
RESUME_INVARIANTS = (("optim", "seed"), ("optim", "global_batch_size"),
                     ("optim", "micro_batch_size"))


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
    seconds: float = 0.0
    data_wait_s: float = 0.0
    nonfinite_ranks: list[int] = field(default_factory=list)
    """Ranks whose loss or own gradients were NaN or infinite: the step was skipped."""
    checkpoint_failed: bool = False
    """Rank 0 could not write a checkpoint: every rank stops."""


class TrainingDiverged(RuntimeError):
    """Too many steps in a row with non-finite loss or gradients: said in one line."""


class PeerStopped(Exception):
    """Another rank reported why the job stops; this one leaves with the same exit code."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class GradCheck:
    """The DDP hook's state: whether this rank's own gradients (before the sum) are finite."""

    def __init__(self, device: torch.device):
        self.group = None  # the default process group
        self.nonfinite = torch.zeros((), dtype=torch.bool, device=device)


def sum_allreduce_hook(state, bucket):
    """DDP communication hook that sums gradients (the loss is already divided by the batch),
    noting first whether this rank's own gradients hold NaN or infinity (without a sync).

    A group of one has nothing to sum: its bucket comes back as it is, without a round trip
    through the backend's threads (which costs whole milliseconds on a busy machine).

    Unannotated on purpose: DDP checks the annotations' runtime values, which postponed
    annotations turn into strings.
    """
    state.nonfinite |= ~torch.isfinite(bucket.buffer()).all()
    if dist.get_world_size(state.group) == 1:
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done
    work = dist.all_reduce(bucket.buffer(), group=state.group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def lr_at(step: int, peak: float, warmup: int, total: int) -> float:
    """Linear warm-up to ``peak`` over ``warmup`` steps, then cosine decay to zero at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


class AuditLog:
    """``--audit-samples``: one JSON line per step with the sample indices this rank used,
    written as the rank reaches the step's last collective (scripts/check_audit.py takes, for each
    step, the newest generation's records, so a step cut short and redone counts once)."""

    def __init__(self, path: Path | None):
        self.file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a", buffering=1)  # noqa: SIM115 - closed by close()

    def record(self, step: int, epoch: int, rank: int, world_size: int,
               micro_batches: list[torch.Tensor]) -> None:
        if self.file is not None:  # the indices leave the device only for the audit
            indices = torch.cat(micro_batches).tolist() if micro_batches else []
            self.file.write(json.dumps({"step": step, "epoch": epoch, "rank": rank,
                                        "world_size": world_size, "time": time.time(),
                                        "indices": indices}) + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


@torch.no_grad()
def evaluate(model: nn.Module, digits: Digits, device: torch.device, env: DistEnv,
             batch_size: int = 1000,
             computing: contextlib.AbstractContextManager | None = None) -> tuple[float, float]:
    """(mean loss, accuracy) over the whole split; each rank computes a share, then all reduce.

    ``computing`` is entered around this rank's share (the watchdog's "busy": not the wait).
    """
    was_training = model.training
    model.eval()
    mine = torch.arange(env.rank, len(digits), env.world_size)
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    with computing or contextlib.nullcontext():
        for indices in torch.split(mine, batch_size):
            images, labels = digits.batch(indices.to(digits.labels.device))
            logits = model(images.to(device, non_blocking=True))
            labels = labels.to(device, non_blocking=True)
            totals[0] += F.cross_entropy(logits, labels, reduction="sum").double()
            totals[1] += (logits.argmax(1) == labels).sum()
            totals[2] += labels.numel()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the share is computed before the wait begins
    distributed.all_reduce_(totals)
    model.train(was_training)
    loss_sum, correct, count = totals.tolist()
    return loss_sum / max(count, 1), correct / max(count, 1)


class Trainer:
    """Owns the model, optimizer and progress of one worker, and runs the loop."""

    def __init__(self, cfg: TrainConfig, env: DistEnv, device: torch.device, dataset: Dataset, *,
                 run_id: str, restart_generation: int,
                 metrics: NullMetrics | None = None,
                 checkpointer: NullCheckpointer | None = None,
                 audit: AuditLog | None = None):
        self.cfg, self.env, self.device = cfg, env, device
        self.run_id, self.restart_generation = run_id, restart_generation
        self.dataset = dataset
        self.train_data = dataset.train.to(device)
        self.metrics = metrics or NullMetrics()
        self.checkpointer = checkpointer or NullCheckpointer()
        self.audit = audit or AuditLog(None)
        self.events: NullEventLog = NullEventLog()
        self.watchdog: NullWatchdog = NullWatchdog()
        self.faults = Faults()
        self.display: LogLines = LogLines()
        self.last_eval: tuple[float, float] | None = None
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
        self.model = build_model(o.seed).to(device)
        if cfg.run.channels_last:
            self.model.to(memory_format=torch.channels_last)
        self.bn_stats = GlobalBatchNormStats(self.model, compiled=cfg.run.compile)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr,
                                           weight_decay=o.weight_decay,
                                           fused=device.type == "cuda")  # one kernel, not dozens
        self.ddp: DistributedDataParallel | None = None
        self.grad_check = GradCheck(device)
        if env.is_distributed and o.grad_sync == "ddp":  # under torchrun, even alone
            with warnings.catch_warnings():  # its successor would sync buffers at start-up
                warnings.filterwarnings("ignore", message=".*broadcast_buffers.*deprecated")
                self.ddp = DistributedDataParallel(
                    self.model, device_ids=[device.index] if device.type == "cuda" else None,
                    broadcast_buffers=False,  # GlobalBatchNormStats keeps buffers equal
                    bucket_cap_mb=1,  # one bucket: all gradients are 116 kB
                    gradient_as_bucket_view=True)  # no copy between gradients and bucket
            self.ddp.register_comm_hook(self.grad_check, sum_allreduce_hook)
        elif env.world_size > 1:
            for tensor in self.model.state_dict().values():
                dist.broadcast(tensor, src=0)
        self.net: nn.Module = self.ddp if self.ddp is not None else self.model
        if cfg.run.compile:  # on a GPU, CUDA graphs launch a whole pass at once
            self.net = torch.compile(self.net,
                                     mode="reduce-overhead" if device.type == "cuda" else None)
        self.progress = Progress()
        self.window = _Window()
        """The step results since the last log line."""
        self.resumed_from: int | None = None
        self.resumed_source: str | None = None

    # --- state ---------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Everything needed to continue exactly: the payload of a checkpoint."""
        return {
            "format": 1,
            "model": self.model.state_dict(),  # the unwrapped module, never the DDP wrapper
            "optimizer": self.optimizer.state_dict(),
            "progress": asdict(self.progress),
            "rng": {"torch": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state_all() if self.device.type == "cuda" else [],
                    "python": list(random.getstate()[1])},
            "config": self.cfg.to_dict(),
            "data": {"kind": self.dataset.kind, "num_train": len(self.dataset.train),
                     "fingerprint": self.dataset.fingerprint},
            "world_size": self.env.world_size,
            "run_id": self.run_id,
        }

    def restore(self, payload: dict[str, Any], source: str) -> None:
        """Continues from a checkpoint's payload, or says precisely why it does not fit."""
        check_compatible(payload, self.model, self.cfg, self.dataset, source)
        self.model.load_state_dict(payload["model"])
        self.optimizer.load_state_dict(payload["optimizer"])
        for group in self.optimizer.param_groups:  # flags may change between launches
            group["weight_decay"] = self.cfg.optim.weight_decay
        self.progress = Progress(**payload["progress"])
        rng = payload["rng"]
        torch.set_rng_state(rng["torch"])
        if self.device.type == "cuda" and rng["cuda"]:
            torch.cuda.set_rng_state_all(rng["cuda"])
        state = random.getstate()
        random.setstate((state[0], tuple(rng["python"]), state[2]))
        self.resumed_from = self.progress.step
        self.resumed_source = source

    # --- the loop ------------------------------------------------------------------------------

    def done(self) -> bool:
        return self.progress.step >= self.total_steps

    def fit(self, stop: StopRequest) -> str:
        """Trains until done or asked to stop; returns 'finished' or 'preempted'."""
        self.window = _Window()  # start-up is no part of the first window's rate
        while not self.done():
            if self.iteration(stop.requested).stop_requested:
                return "preempted"
        return "finished"

    def iteration(self, stop_requested: bool) -> StepResult:
        """One turn of the loop: the next step, then what follows it (progress, scalars every
        ``--log-every`` steps, the evaluation at an epoch's end, the checkpoint when due)."""
        batch = self.global_batch()
        self.faults.maybe_hang(self.progress.step + 1)
        result = self.train_step(batch, stop_requested)
        self.watchdog.step_done(self.progress.step + 1, result.seconds)
        if result.checkpoint_failed:
            self.stop_after_checkpoint_failure()
        epoch_ended = self.advance(len(batch))
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
        if epoch_ended or self.done():
            self.log_evaluation()
        with self.watchdog.busy("checkpointing"):
            if self.checkpointer.maybe_save(self.state, self.progress.step,
                                            epoch_end=epoch_ended,
                                            final=self.done() or result.stop_requested):
                self.metrics.flush()  # what a resume keeps (steps up to this one) is on disk
        return result

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
            raise PeerStopped(message, exit_code=2)
        self.metrics.flush()
        raise TrainingDiverged(message)

    def stop_after_checkpoint_failure(self) -> None:
        """Rank 0 could not save: it says why (the writer's error), every rank stops."""
        self.checkpointer.wait()  # raises the writer's error on rank 0
        raise PeerStopped("rank 0 could not write a checkpoint", exit_code=2)

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

        self.bn_stats.begin_step()
        self.optimizer.zero_grad(set_to_none=True)
        self.grad_check.nonfinite.zero_()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        correct = torch.zeros((), dtype=torch.float64, device=self.device)
        data_wait = 0.0
        for i, indices in enumerate(mine):
            fetch_start = time.perf_counter()
            images, labels = self.train_data.batch(indices)
            data_wait += time.perf_counter() - fetch_start
            with self.bn_stats.record(counts), self._sync_gradients(i == len(mine) - 1):
                with self._autocast():
                    logits = self.net(images)
                    loss = F.cross_entropy(logits, labels, reduction="sum")
                (loss * scale).backward()
            if counts:
                loss_sum += loss.detach().double()
                correct += (logits.detach().argmax(1) == labels).sum()
        nonfinite = ~torch.isfinite(loss_sum)
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
                          self.env.world_size, mine if counts else [])
        # One collective for the step: loss, accuracy, the stop and checkpoint-failure flags,
        # which ranks saw non-finite values, and the BatchNorm statistics.
        flags = torch.tensor([stop_requested, self.checkpointer.failed], dtype=torch.float64,
                             device=self.device)
        ranks_nonfinite = torch.zeros(self.env.world_size, dtype=torch.float64,
                                      device=self.device)
        ranks_nonfinite[self.env.rank] = nonfinite.double()
        packed = torch.cat([loss_sum.view(1), correct.view(1), flags, ranks_nonfinite,
                            self.bn_stats.local_sums(self.device)])
        distributed.all_reduce_(packed)
        head = 4 + self.env.world_size
        loss_total, correct_total, stops, checkpoint_failed, *per_rank = packed[:head].tolist()
        nonfinite_ranks = [rank for rank, count in enumerate(per_rank) if count > 0]
        if nonfinite_ranks:  # skipped on every rank alike: no update, statistics as they were
            self.bn_stats.restore()
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.bn_stats.apply(packed[head:])
            self.optimizer.step()

        return StepResult(loss=loss_total / len(batch), accuracy=correct_total / len(batch),
                          samples=len(batch), stop_requested=stops > 0,
                          seconds=time.perf_counter() - step_start, data_wait_s=data_wait,
                          nonfinite_ranks=nonfinite_ranks, checkpoint_failed=checkpoint_failed > 0)

    def _autocast(self) -> torch.autocast:
        """The forward pass in bf16 under ``--precision bf16``, else as it is."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16,
                              enabled=self.cfg.run.precision == "bf16")

    def _sync_gradients(self, last_micro_batch: bool):
        """DDP syncs gradients on a rank's last micro-batch only (accumulating before it)."""
        if self.ddp is None or last_micro_batch:
            return contextlib.nullcontext()
        return self.ddp.no_sync()

    def _all_reduce_gradients(self) -> None:
        """The seeds' hand-written gradient sync (``--grad-sync allreduce``), summing."""
        for param in self.model.parameters():
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)

    def advance(self, samples: int) -> bool:
        """Moves the cursor past a completed step; True if that step ended the epoch."""
        p = self.progress
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
        loss, accuracy = evaluate(self.model, self.dataset.test, self.device, self.env,
                                  computing=self.watchdog.busy("evaluating"))
        with self.watchdog.busy("logging"):
            self.metrics.scalars(step, {"test/loss": loss, "test/accuracy": accuracy})
            if self.env.is_main:
                self.metrics.image("test/predictions", self.prediction_grid(), step)
            self.metrics.flush()
            epoch_done = self.progress.cursor == 0
            self.events.emit("eval", step, accuracy=accuracy, loss=loss,
                             epoch=self.progress.epoch_number(), epoch_done=epoch_done)
        self.last_eval = (loss, accuracy)
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

    def position(self) -> str:
        """Where a resumed run continues: the step, and how far into which epoch."""
        p = self.progress
        if self.done():
            return f"step {p.step}, the end of epoch {self.epoch_label()}: nothing left to train"
        return (f"step {p.step}, {p.cursor} of {self.order.num_samples} samples into epoch "
                f"{p.epoch + 1}/{self.total_epochs}")


    @torch.no_grad()
    def prediction_grid(self, count: int = 16) -> torch.Tensor:
        """The first test digits with the model's predictions, as an RGB image."""
        test = self.dataset.test
        indices = torch.arange(min(count, len(test)))
        images, labels = test.batch(indices)
        self.model.eval()
        predicted = self.model(images.to(self.device)).argmax(1).cpu()
        self.model.train()
        return prediction_grid(test.images[indices], predicted, labels)


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
