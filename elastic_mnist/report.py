"""What the loop tells people: the logging window, training and test scalars, the records of
skipped steps, the evaluation and the prediction grid (every rank's audit of the samples it used
is audit.py's).

Everything here writes through the generation's writers (writers.py), which :meth:`Report.enter`
hands over whole: ranks that must not write hold writers that do nothing, so no line here asks
which rank it runs on to decide whether to write.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from elastic_mnist.comm import PlainComm
from elastic_mnist.config import TrainConfig
from elastic_mnist.data.datasets import Dataset, Digits
from elastic_mnist.data.order import SampleOrder
from elastic_mnist.env import DistEnv
from elastic_mnist.pace import pace_scalars
from elastic_mnist.render import prediction_grid
from elastic_mnist.state import Progress

if TYPE_CHECKING:
    from elastic_mnist.step_result import StepResult
    from elastic_mnist.writers import Writers

log = logging.getLogger("elastic_mnist.trainer")  # the loop's lines, under the loop's name


@torch.no_grad()
def evaluate(model: nn.Module, digits: Digits, device: torch.device, env: DistEnv,
             batch_size: int = 1000, comm: PlainComm | None = None) -> tuple[float, float]:
    """(mean loss, accuracy) over the whole split; each rank computes a share, then all reduce.

    ``digits`` on ``device`` (the Trainer keeps both splits there) means no batch is copied.
    ``comm`` sums the ranks' totals; the loop's (comm.py) marks this rank's share as busy for
    the watchdog (not the wait), and the sum and its read, where NCCL blocks, as waiting.
    """
    comm = comm or PlainComm()
    was_training = model.training
    model.eval()
    try:
        mine = torch.arange(env.rank, len(digits), env.world_size, device=digits.labels.device)
        totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
        with comm.busy("evaluating"):
            for indices in torch.split(mine, batch_size):
                images, labels = digits.batch(indices)  # where the split lives: on the device
                logits = model(images.to(device, non_blocking=True))
                labels = labels.to(device, non_blocking=True)
                totals[0] += F.cross_entropy(logits, labels, reduction="sum").double()
                totals[1] += (logits.argmax(1) == labels).sum()
                totals[2] += labels.numel()
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the share is computed before the wait begins
        with comm.waiting():
            loss_sum, correct, count = comm.all_reduce_(totals).tolist()
    finally:
        model.train(was_training)
    return loss_sum / max(count, 1), correct / max(count, 1)


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
            **pace_scalars(self.results),  # pace/*: the ranks' own compute times (pace.py)
        }
        self.results, self.start = [], time.perf_counter()
        return summary


class Report:
    """What a turn of the loop logs and records, for one worker: the window, the scalars, the
    evaluation and its picture, the records of skipped steps. Handed the model, optimizer,
    progress and data once; each generation's world, writers and collectives by :meth:`enter`."""

    def __init__(self, cfg: TrainConfig, progress: Progress, order: SampleOrder, total_steps: int,
                 model: nn.Module, optimizer: torch.optim.Optimizer, dataset: Dataset,
                 test_data: Digits, device: torch.device):
        self.cfg, self.progress, self.order, self.total_steps = cfg, progress, order, total_steps
        self.total_epochs = math.ceil(total_steps / order.steps_per_epoch)
        """Epochs this run trains in (fewer than --epochs when --max-steps ends it sooner)."""
        self.model, self.optimizer, self.device = model, optimizer, device
        self.dataset, self.test_data = dataset, test_data
        self.window = _Window()
        """The step results since the last log line."""
        self.last_eval: tuple[float, float] | None = None
        self.last_eval_step = -1
        self.env, self.generation = DistEnv(), 0
        self.writers: Writers | None = None
        self.comm = PlainComm()

    def enter(self, env: DistEnv, generation: int, writers: Writers, comm: PlainComm) -> None:
        """A generation's world, its writers and its collectives (at the start, after a change)."""
        self.env, self.generation, self.writers, self.comm = env, generation, writers, comm

    def new_window(self) -> None:
        """Starts the rate's window afresh (start-up is no part of the first window's rate)."""
        self.window = _Window()

    def done(self) -> bool:
        return self.progress.step >= self.total_steps

    def should_log(self) -> bool:
        return self.progress.step % self.cfg.run.log_every == 0 or self.done()

    def step(self, result: StepResult, epoch_ended: bool, changed: bool) -> None:
        """The window, the progress display, and the scalars every ``--log-every`` steps (or at
        an epoch's end; at a change of world size, at least its new size)."""
        if not result.nonfinite_ranks:
            self.window.add(result)
        w = self.writers
        w.display.update(self.epoch_label(), self.progress.step, self.total_steps,
                         result.loss, self.window.samples_per_s())
        if (self.should_log() or epoch_ended) and self.window.results:
            self.log_training(self.window.drain())
        elif changed:  # the world size drops at the step where it happened
            w.metrics.scalars(self.progress.step, {
                "elastic/world_size": self.env.world_size,
                "elastic/restart_generation": self.generation})

    def log_training(self, window: dict[str, float]) -> None:
        p = self.progress
        lr = self.optimizer.param_groups[0]["lr"]
        self.writers.metrics.scalars(p.step, {
            "train/loss": window["loss"], "train/accuracy": window["accuracy"],
            "opt/lr": lr, "perf/samples_per_s": window["samples_per_s"],
            "perf/step_ms": window["step_ms"], "perf/data_wait_pct": window["data_wait_pct"],
            "elastic/world_size": self.env.world_size,
            "elastic/restart_generation": self.generation,
            "train/nonfinite_steps": p.nonfinite_steps, "train/epoch": p.epoch_number(),
            **{tag: value for tag, value in window.items() if tag.startswith("pace/")},
        })
        log.info("epoch %s step %d/%d loss %.4f acc %.2f%% lr %.2e %.0f samples/s",
                 self.epoch_label(), p.step, self.total_steps, window["loss"],
                 100 * window["accuracy"], lr, window["samples_per_s"])

    def evaluation(self) -> tuple[float, float]:
        """The test split's loss and accuracy at this step: scalars, the picture, an event."""
        step, w = self.progress.step, self.writers
        loss, accuracy = evaluate(self.model, self.test_data, self.device, self.env,
                                  comm=self.comm)
        with self.comm.busy("logging"):
            w.metrics.scalars(step, {"test/loss": loss, "test/accuracy": accuracy})
            if self.env.is_main:
                w.metrics.image("test/predictions", self.prediction_grid(), step)
            w.metrics.flush()
            epoch_done = self.progress.cursor == 0
            w.events.emit("eval", step, accuracy=accuracy, loss=loss,
                          epoch=self.progress.epoch_number(), epoch_done=epoch_done)
        self.last_eval, self.last_eval_step = (loss, accuracy), step
        steps_in = step - (self.progress.epoch_number() - 1) * self.order.steps_per_epoch
        where = ("done" if epoch_done else
                 f"ends after {steps_in} of its {self.order.steps_per_epoch} steps")
        log.info("epoch %s %s at step %d: test loss %.4f, test accuracy %.2f%%",
                 self.epoch_label(), where, step, loss, 100 * accuracy)
        return loss, accuracy

    def nonfinite(self, ranks: list[int]) -> None:
        """A skipped step: one line, an event, the count on the dashboards."""
        p = self.progress
        log.warning("step %d skipped: non-finite loss or gradients on rank(s) %s (%d in a row)",
                    p.step, ", ".join(map(str, ranks)), p.nonfinite_in_a_row)
        self.writers.events.emit("nonfinite", p.step, rank=ranks[0], ranks=ranks,
                                 in_a_row=p.nonfinite_in_a_row)
        self.writers.metrics.scalars(p.step, {"train/nonfinite_steps": p.nonfinite_steps})

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
