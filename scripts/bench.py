#!/usr/bin/env python
"""`make bench`: the seeds' loop, our worker and the compute floor, on one machine, in one run.

    scripts/bench.py [--quick] [--real-data DIR] [--data-dir DIR] [--device D] [--out FILE]
    scripts/bench.py --update-readme [--out FILE]

Method. Every contender runs in a fresh process of its own, with the same number of intra-op
threads (``--threads``, default 1, set as OMP_NUM_THREADS: on a small shared machine two threads in
one process collapse whenever another process is busy). The repetitions alternate the contenders,
A B C ... A B C ..., so that whatever else the machine does hits them alike. Comparisons are ratios
within one repetition; every figure is reported as the median of the repetitions (at least 3), with
their min and max.

Throughput is samples per second over the optimizer steps after a warm-up, each contender timing
its own steps: the seed loop and the compute floor with a clock around their loops (waiting for the
GPU at both ends), our worker through what it logs itself (``perf/step_ms`` per log window in
TensorBoard, which covers its whole loop: data, bookkeeping, logging and checkpoints). Start-up and
the final evaluation are outside every figure. The contenders:

  seed        the seeds' single-process loop as written (torchvision MNIST with ToTensor through a
              DataLoader, batch 100, their ConvNet with conv biases, SGD), copied below
  worker      ``elastic-mnist train`` in one plain process, same data, batch and device, with the
              device's tuned flags (TUNED_FLAGS: on CPU the defaults); its peak resident memory
              (wait4's ru_maxrss)
  floor       the same model, flags and digits, forward, backward and optimizer step on batches
              made in advance, nothing else: the limit our loop can approach here
  paired      our worker's loop (the real Trainer's: step, TensorBoard scalars, checkpoints),
              the same with DDP at world size 1, and the floor, in one process, taking turns
              step by step: the few-percent comparisons, which separate runs on a shared machine
              cannot resolve (they differ by ±15% here), are medians over blocks of steps of the
              time ratio in each block (paired_steps)
  defaults    our worker with the default flags (on a GPU, where they are not the tuned ones)
  ddp         our worker under ``torchrun --nproc_per_node=1``: DistributedDataParallel at world
              size 1 (the plain process has no process group, hence no DDP)
  checkpoint  our worker saving a checkpoint every 2 s by the clock (--checkpoint-every-seconds,
              5 times as often as the default), logging every step: what a save costs the loop,
              the steps it touched against the steps around them in the same run (separate
              runs differ by far more than 1% here), and that cost over the default cadence's
              interval; the blocking ms per save it logs
  recovery_shipped, recovery_defaults   two workers under torchrun (one under --quick), rank 0
              SIGKILLed after a checkpoint: seconds from the kill to the first step completed
              after the restart (its TensorBoard wall time), jobs/node.sh's launch line against plain
              ``torchrun --standalone`` (torch's defaults, jobs/local.sh's line)
  real        5 epochs of the default flags on the real 8,000/2,000 split (``--real-data``): wall
              time, training time and test accuracy
  startup     one worker process from exec to its first completed step (its audit record),
              beside a bare ``import torch`` and ``import torch._dynamo`` after it, which torch's
              optimizers and DDP import: the rest is ours
  micro       the default global batch's training step (768 digits) in micro-batches of 4, 8
              (the default) and 32, three real Trainers in one process taking turns step by
              step: what the micro-batch's size costs a rank that runs them all, as the median
              ratio of step times (micro_batch_steps)
  fast, fast_floor   on a GPU: the worker and the floor with bf16, channels-last and torch.compile
              (CUDA graphs) at a batch that fills the GPU; its epoch time and start-up time
  fast_accumulating   the same worker with that batch cut into FAST_MICRO_BATCHES micro-batches,
              which it accumulates: compiled without CUDA graphs (elastic_mnist/fast_path.py)

CPU runs paired, worker, seed, checkpoint, both recoveries, real, startup and micro (ddp and floor in
processes of their own add little beside paired, and cost a minute); a GPU seed, defaults, fast,
fast_accumulating and real (``--only`` picks others). Without ``--data-dir`` the throughput
contenders train on 60,000 synthetic digits generated once into bench/data (MNIST cannot be
downloaded everywhere); results.json says which data was used.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import logging
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import markers
from processes import job_env, kill_tree

from elastic_mnist.checkpoint import newest_committed_step
from elastic_mnist.config import CheckpointConfig
from elastic_mnist.events import event_time, read_events

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "bench" / "results.json"

BATCH = 100
"""The seeds' batch size, and every contender's but the GPU fast path's."""
GPU_FAST_BATCH = 1000
"""Batch of the GPU fast path (it divides 60,000: no short last batch to recompile for)."""
FAST_MICRO_BATCHES = 4
"""Micro-batches per step of the accumulating fast path (a rank that accumulates, as every rank
does under the default flags below 96 ranks)."""
MICRO_SIZES = (4, 8, 32)
"""Micro-batch sizes of the micro contender: the default (8), half and four times it."""
DEFAULT_CHECKPOINT_S = CheckpointConfig().checkpoint_every_seconds
"""The default cadence of saves, by the clock."""
FAST_FLAGS = ["--precision", "bf16", "--channels-last", "--compile"]
TUNED_FLAGS = {"cpu": [], "cuda": FAST_FLAGS}
"""Our worker's flags per device. On CPU the defaults are the fast ones (channels-last, on by
default, is a third faster there than NCHW); on a GPU they add bf16 and torch.compile."""
NEIGHBOURS = 20
"""Steps on each side of a save whose median is the step time a save is compared with."""


@dataclass(frozen=True)
class Sizes:
    """How much each contender runs."""

    reps: int
    steps: int
    """Optimizer steps of a throughput run."""
    warmup: int
    """Steps left out of every throughput figure (also the worker's log interval)."""
    checkpoint_interval_s: float
    """Time between the checkpoint contender's saves."""
    checkpoint_saves: int
    paired_rounds: int
    """Steps of each of the paired contender's sides after its warm-up."""
    paired_block: int
    """The paired contender's warm-up, log interval, checkpoint interval and unit of comparison,
    in steps."""
    recovery_kill_at: int
    """The kill follows the first checkpoint at or after this step."""
    recovery_steps: int
    recovery_workers: int = 2
    """Workers of the recovery contenders' one node (rank 0 is the one killed)."""
    real_epochs: int = 5
    micro_rounds: int = 12
    """Steps of the default global batch at each micro-batch size, taking turns."""
    timeout_s: float = 900.0


FULL = Sizes(reps=3, steps=120, warmup=20, checkpoint_interval_s=2.0, checkpoint_saves=2,
             paired_rounds=200, paired_block=20, recovery_kill_at=6, recovery_steps=20)
QUICK = Sizes(reps=1, steps=8, warmup=4, checkpoint_interval_s=0.2, checkpoint_saves=2,
              paired_rounds=8, paired_block=4, recovery_kill_at=4, recovery_steps=8,
              recovery_workers=1, real_epochs=1, micro_rounds=2, timeout_s=300.0)


# --- the contenders that run inside this script's own child processes --------------------------


def seed_convnet():
    """The seeds' ConvNet, as they wrote it (conv biases included)."""
    from torch import nn

    class ConvNet(nn.Module):
        def __init__(self, num_classes=10):
            super(ConvNet, self).__init__()  # noqa: UP008 - as written
            self.layer1 = nn.Sequential(
                nn.Conv2d(1, 16, kernel_size=5, stride=1, padding=2),
                nn.BatchNorm2d(16),
                nn.ReLU(),
                nn.MaxPool2d(kernel_size=2, stride=2))
            self.layer2 = nn.Sequential(
                nn.Conv2d(16, 32, kernel_size=5, stride=1, padding=2),
                nn.BatchNorm2d(32),
                nn.ReLU(),
                nn.MaxPool2d(kernel_size=2, stride=2))
            self.fc = nn.Linear(7 * 7 * 32, num_classes)

        def forward(self, x):
            out = self.layer1(x)
            out = self.layer2(out)
            out = out.reshape(out.size(0), -1)
            out = self.fc(out)
            return out

    return ConvNet()


class StepClock:
    """Times the steps after the first ``warmup``, waiting for the device at both ends."""

    def __init__(self, device, warmup: int, steps: int):
        self.device, self.warmup, self.steps = device, warmup, steps
        self.start = self.stop = 0.0

    def tick(self, step: int) -> None:
        if step in (self.warmup, self.steps):
            import torch

            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            if step == self.warmup:
                self.start = time.perf_counter()
            else:
                self.stop = time.perf_counter()

    def samples_per_s(self, batch: int) -> float:
        return (self.steps - self.warmup) * batch / (self.stop - self.start)


def seed_loop(data_dir: str, device_name: str, steps: int, warmup: int) -> dict:
    """The seeds' training loop as written, with ``.to(device)`` for ``.cuda(gpu)``."""
    import torch
    import torchvision
    from torch import nn
    from torchvision import transforms

    device = torch.device(device_name)
    torch.manual_seed(0)
    model = seed_convnet()
    model.to(device)
    batch_size = BATCH
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(model.parameters(), 1e-4)
    train_dataset = torchvision.datasets.MNIST(root=data_dir, train=True,
                                               transform=transforms.ToTensor(), download=False)
    train_loader = torch.utils.data.DataLoader(dataset=train_dataset, batch_size=batch_size,
                                               shuffle=True, num_workers=0, pin_memory=True)
    clock = StepClock(device, warmup, steps)
    total_step = len(train_loader)
    step, epoch = 0, 0
    while step < steps:
        for i, (images, labels) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            outputs = model(images)
            loss = criterion(outputs, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if (i + 1) % 100 == 0:
                print(f"Epoch [{epoch + 1}], Step [{i + 1}/{total_step}], "
                      f"Loss: {loss.item():.4f}")
            step += 1
            clock.tick(step)
            if step == steps:
                break
        epoch += 1
    return {"samples_per_s": clock.samples_per_s(batch_size)}


class FloorStep:
    """Our model's forward, backward and AdamW step on the same digits, normalised and put on the
    device in advance, nothing else; with the worker's ``flags`` (precision, channels-last,
    compile). Each call is one step, on the next of ``count`` batches."""

    def __init__(self, data_dir: str, kind: str, device, batch: int, flags: list[str],
                 count: int):
        import torch

        from elastic_mnist.cli import build_parser
        from elastic_mnist.config import train_config_from_args
        from elastic_mnist.data.datasets import load
        from elastic_mnist.fast_path import adamw_kernels, choose_compilation, set_float32_math
        from elastic_mnist.model import build_model

        opts = train_config_from_args(build_parser().parse_args(["train", *flags])).run
        self.device, self.batch, self.bf16 = device, batch, opts.precision == "bf16"
        set_float32_math(opts.precision)  # as the worker sets it
        self.model = build_model(0).to(device)
        if opts.channels_last:  # as the worker's flags and defaults have it
            self.model.to(memory_format=torch.channels_last)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3,
                                           **adamw_kernels(device))  # as the worker's
        self.net = self.model
        self.compilation = choose_compilation(device.type, 1, opts.compile)  # a batch per step
        if self.compilation.mode is not None:
            self.net = torch.compile(self.model, mode=self.compilation.mode)
        train = load(Path(data_dir), kind).train
        generator = torch.Generator().manual_seed(0)
        order = torch.randperm(count * batch, generator=generator) % len(train)
        self.batches = [tuple(t.to(device) for t in train.batch(indices))
                        for indices in torch.split(order, batch)]
        self.calls = 0

    def __call__(self) -> None:
        import torch
        import torch.nn.functional as F

        images, labels = self.batches[self.calls % len(self.batches)]
        self.calls += 1
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            loss = F.cross_entropy(self.net(images), labels, reduction="sum")
        (loss / self.batch).backward()
        self.optimizer.step()


def compute_floor(data_dir: str, kind: str, device_name: str, steps: int, warmup: int,
                  batch: int, flags: list[str]) -> dict:
    """The floor alone, timed over its steps after the warm-up."""
    import torch

    device = torch.device(device_name)
    floor = FloorStep(data_dir, kind, device, batch, flags, count=steps)
    clock = StepClock(device, warmup, steps)
    for step in range(1, steps + 1):
        floor()
        clock.tick(step)
    return {"samples_per_s": clock.samples_per_s(batch)}


def paired_steps(data_dir: str, kind: str, device_name: str, batch: int, flags: list[str],
                 rounds: int, block: int, work: str) -> dict:
    """Our worker's loop (the real Trainer's, without and with DDP at world size 1) and the
    floor, in one process, taking turns step by step: each round runs one step of each, in an
    order that rotates, so that all three see the same machine, whose load changes from one
    second to the next. The worker's turn is a whole turn of its loop (``Trainer.iteration``):
    the step, its TensorBoard scalars every ``block`` steps and a checkpoint every ``block``
    steps, written by the real writers into ``work``. After a warm-up of ``block`` rounds, the
    comparisons are the medians over blocks of ``block`` rounds (each holding one log write and
    one save) of the ratio of the time each side spent in the block. Returns each one's samples/s
    over all rounds and those medians."""
    import torch
    import torch.distributed as dist

    from elastic_mnist.checkpointer import Checkpointer
    from elastic_mnist.cli import build_parser
    from elastic_mnist.config import train_config_from_args
    from elastic_mnist.data.datasets import load
    from elastic_mnist.env import DistEnv
    from elastic_mnist.metrics import TensorBoardMetrics
    from elastic_mnist.trainer import Trainer
    from elastic_mnist.writers import Writers

    device = torch.device(device_name)
    cfg = train_config_from_args(build_parser().parse_args(
        ["train", "--global-batch-size", str(batch), "--micro-batch-size", str(batch),
         "--epochs", "1000", "--log-every", str(block), *flags]))
    dataset = load(Path(data_dir), kind)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(),
                            rank=0, world_size=1)
    trainers = {}
    for name, env in (("worker", DistEnv()), ("ddp", DistEnv(launched=True))):
        writers = Writers(
            checkpointer=Checkpointer(Path(work) / name / "ckpt", every=block, keep_last=3,
                                      restart_generation=0),
            metrics=TensorBoardMetrics(Path(work) / name / "runs", purge_step=1))
        trainer = Trainer(cfg, env, device, dataset, run_id="bench", restart_generation=0,
                          writers=writers)
        trainers[name] = trainer

    def turn(trainer: Trainer) -> Callable[[], None]:
        return lambda: trainer.iteration(stop_requested=False)

    floor = FloorStep(data_dir, kind, device, batch, flags, count=rounds + block)
    steps = [("floor", floor), *((name, turn(trainer)) for name, trainer in trainers.items())]
    seconds: dict[str, list[float]] = {name: [] for name, _ in steps}
    for round_ in range(block + rounds):  # the first block warms up
        shift = round_ % len(steps)
        for name, step in steps[shift:] + steps[:shift]:  # each goes first as often
            began = time.perf_counter()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if round_ >= block:
                seconds[name].append(time.perf_counter() - began)
    for trainer in trainers.values():
        trainer.writers.checkpointer.close()
        trainer.writers.metrics.close()
    dist.destroy_process_group()

    def blocks(name: str) -> list[float]:
        times = seconds[name]
        return [sum(times[i:i + block]) for i in range(0, len(times) - block + 1, block)]

    worker = blocks("worker")
    return {**{name: len(times) * batch / sum(times) for name, times in seconds.items()},
            "worker_vs_floor": statistics.median(f / w for f, w in zip(blocks("floor"), worker)),
            "ddp_vs_worker": statistics.median(d / w for d, w in zip(blocks("ddp"), worker))}


def micro_batch_steps(data_dir: str, kind: str, device_name: str, sizes: list[int],
                      rounds: int) -> dict:
    """The training step of the default global batch in micro-batches of each of ``sizes``, one
    real Trainer each, in one process, taking turns step by step in an order that rotates (as
    paired_steps): what the micro-batch's size costs a rank that runs them all. Returns each
    size's samples/s and, per size, the median over rounds of the largest size's step time over
    its own."""
    import torch

    from elastic_mnist.config import TrainConfig
    from elastic_mnist.data.datasets import load
    from elastic_mnist.env import DistEnv
    from elastic_mnist.trainer import Trainer

    device = torch.device(device_name)
    dataset = load(Path(data_dir), kind)
    trainers = {}
    for size in sizes:
        cfg = TrainConfig()
        cfg.optim.micro_batch_size, cfg.optim.epochs = size, 1000
        trainers[size] = Trainer(cfg, DistEnv(), device, dataset, run_id="bench",
                                 restart_generation=0)
    seconds: dict[int, list[float]] = {size: [] for size in sizes}
    order = list(sizes)
    for round_ in range(rounds + 1):  # the first round warms up
        shift = round_ % len(order)
        for size in order[shift:] + order[:shift]:
            trainer = trainers[size]
            batch = trainer.global_batch()
            began = time.perf_counter()
            trainer.train_step(batch, stop_requested=False)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if round_:
                seconds[size].append(time.perf_counter() - began)
            trainer.advance(len(batch))
    largest = max(sizes)
    batch = TrainConfig().optim.global_batch_size
    return {"samples_per_s": {size: len(times) * batch / sum(times)
                              for size, times in seconds.items()},
            "vs_largest": {size: statistics.median(big / own for big, own in
                                                   zip(seconds[largest], seconds[size]))
                           for size in sizes}}


# --- running the contenders' processes --------------------------------------------------------


class ContenderFailed(RuntimeError):
    """A contender's process failed; the message ends with its log's tail."""


@dataclass
class Finished:
    wall_s: float
    peak_rss_mb: float
    """The process's own peak resident memory (its children not included), in MB."""


def child_env(threads: int) -> dict[str, str]:
    """This environment without any launcher's variables, with ``threads`` intra-op threads."""
    return job_env(threads, MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")


def start(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def failure(log: Path, what: str) -> ContenderFailed:
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:]) if log.exists() else ""
    return ContenderFailed(f"{what}; the end of {log}:\n{tail}")


def run(cmd: list[str], log: Path, env: dict[str, str], timeout_s: float) -> Finished:
    """Runs ``cmd`` to its end, its output in ``log``; raises ContenderFailed unless it exits 0."""
    began = time.perf_counter()
    proc = start(cmd, log, env)
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            break
        if time.perf_counter() - began > timeout_s:
            kill_tree(proc.pid)
            raise failure(log, f"timed out after {timeout_s:.0f} s")
        time.sleep(0.02)
    if proc.returncode != 0:
        raise failure(log, f"exited with status {proc.returncode}")
    return Finished(wall_s=time.perf_counter() - began, peak_rss_mb=usage.ru_maxrss * 1024 / 1e6)


# --- what a worker leaves behind --------------------------------------------------------------


def scalars(run_dir: Path, tag: str) -> list:
    """TensorBoard scalar events of ``tag`` (wall_time, step, value), after purges on restart."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logging.getLogger("tensorboard").setLevel(logging.ERROR)  # purges are expected after kills
    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return accumulator.Scalars(tag)


def step_windows(run_dir: Path) -> list[tuple[int, float]]:
    """(last step, seconds) of each of the worker's log windows: its own timing of its loop."""
    windows, previous = [], 0
    for event in scalars(run_dir, "perf/step_ms"):
        windows.append((event.step, event.value * (event.step - previous) / 1e3))
        previous = event.step
    return windows


def worker_samples_per_s(run_dir: Path, batch: int, warmup: int) -> float:
    """Samples per second of the worker's steps after ``warmup``, from its log windows."""
    measured = [(step, seconds) for step, seconds in step_windows(run_dir) if step > warmup]
    if not measured:
        raise ContenderFailed(f"{run_dir} logged no step after {warmup}")
    return (measured[-1][0] - warmup) * batch / sum(seconds for _, seconds in measured)


def events(run_dir: Path) -> list[dict]:
    return read_events(run_dir / "events.jsonl")


# --- the benchmark ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Data:
    root: Path
    kind: str
    """'mnist' or 'synthetic'."""

    @property
    def flags(self) -> list[str]:
        return ["--data-dir", str(self.root), "--dataset", self.kind, "--no-download"]


@dataclass
class Bench:
    """What every contender needs, and the scratch folders of their runs."""

    data: Data
    device: str
    threads: int
    sizes: Sizes
    work: Path
    real_split: Path | None = None
    worker_step_s: float | None = None
    """The latest step time of our worker, which sets the checkpoint interval in steps."""
    runs: int = 0

    @property
    def tuned_flags(self) -> list[str]:
        return TUNED_FLAGS[self.device]

    def scratch(self, name: str) -> Path:
        self.runs += 1
        path = self.work / f"{self.runs:03d}-{name}"
        path.mkdir(parents=True)
        return path

    @property
    def env(self) -> dict[str, str]:
        return child_env(self.threads)

    def train_args(self, work: Path, *flags: str, data: Data | None = None) -> list[str]:
        """``elastic-mnist train``'s flags for a run in ``work``."""
        return [*(data or self.data).flags, "--checkpoint-dir", str(work / "ckpt"),
                "--logdir", str(work / "runs"), "--run-id", "bench", "--device", self.device,
                *flags]

    def steps_flags(self, batch: int, steps: int, log_every: int,
                    micro_batch: int | None = None) -> list[str]:
        """``steps`` steps (of one micro-batch each by default), however many epochs that is."""
        return ["--global-batch-size", str(batch), "--micro-batch-size", str(micro_batch or batch),
                "--max-steps", str(steps), "--epochs", str(steps), "--log-every", str(log_every)]

    def child(self, name: str, *args: str) -> tuple[dict, Finished]:
        """Runs this script's ``name`` command in a fresh process: its result, and the process."""
        work = self.scratch(name)
        result = work / "result.json"
        finished = run([sys.executable, __file__, name, "--result", str(result), *args],
                       work / "log.txt", self.env, self.sizes.timeout_s)
        return json.loads(result.read_text()), finished

    def worker(self, name: str, flags: list[str], launcher: list[str] | None = None,
               batch: int = BATCH, micro_batch: int | None = None) -> tuple[Path, Finished]:
        """Our worker (in one process, or under ``launcher``): its run folder and process."""
        work = self.scratch(name)
        cmd = [*(launcher or [sys.executable, "-m", "elastic_mnist", "train"]),
               *self.train_args(work, *self.steps_flags(batch, self.sizes.steps,
                                                        self.sizes.warmup, micro_batch), *flags)]
        finished = run(cmd, work / "log.txt", self.env, self.sizes.timeout_s)
        return work / "runs" / "bench", finished

    def floor(self, batch: int, flags: list[str]) -> float:
        s = self.sizes
        result, _ = self.child("floor", "--data-dir", str(self.data.root), "--dataset",
                               self.data.kind, "--device", self.device, "--steps", str(s.steps),
                               "--warmup", str(s.warmup), "--batch", str(batch),
                               f"--flags={' '.join(flags)}")
        return result["samples_per_s"]


def measure_seed(b: Bench) -> dict[str, float]:
    s = b.sizes
    result, finished = b.child("seed-loop", "--data-dir", str(b.data.root), "--device", b.device,
                               "--steps", str(s.steps), "--warmup", str(s.warmup))
    return {"seed_samples_per_s": result["samples_per_s"], "seed_peak_rss_mb": finished.peak_rss_mb}


def measure_worker(b: Bench) -> dict[str, float]:
    run_dir, finished = b.worker("worker", b.tuned_flags)
    samples_per_s = worker_samples_per_s(run_dir, BATCH, b.sizes.warmup)
    b.worker_step_s = BATCH / samples_per_s
    return {"worker_samples_per_s": samples_per_s, "worker_peak_rss_mb": finished.peak_rss_mb}


def measure_defaults(b: Bench) -> dict[str, float]:
    run_dir, _ = b.worker("defaults", [])
    return {"defaults_samples_per_s": worker_samples_per_s(run_dir, BATCH, b.sizes.warmup)}


def measure_floor(b: Bench) -> dict[str, float]:
    return {"floor_samples_per_s": b.floor(BATCH, b.tuned_flags)}


def measure_paired(b: Bench) -> dict[str, float]:
    """Our worker's step, with and without DDP, and the floor, alternating in one process: the
    comparisons that separate processes cannot resolve on a shared machine (paired_steps)."""
    s = b.sizes
    result, _ = b.child("paired", "--data-dir", str(b.data.root), "--dataset", b.data.kind,
                        "--device", b.device, "--batch", str(BATCH), "--rounds",
                        str(s.paired_rounds), "--block", str(s.paired_block),
                        f"--flags={' '.join(b.tuned_flags)}")
    return {"paired_floor_samples_per_s": result["floor"],
            "paired_worker_samples_per_s": result["worker"],
            "paired_ddp_samples_per_s": result["ddp"],
            "paired_worker_vs_floor_pct": 100 * result["worker_vs_floor"],
            "paired_ddp_overhead_pct": 100 * (result["ddp_vs_worker"] - 1)}


def measure_micro(b: Bench) -> dict[str, float]:
    """The default global batch's step in micro-batches of 4, 8 (the default) and 32, taking
    turns in one process (micro_batch_steps)."""
    result, _ = b.child("micro", "--data-dir", str(b.data.root), "--dataset", b.data.kind,
                        "--device", b.device, "--rounds", str(b.sizes.micro_rounds),
                        f"--flags={' '.join(str(size) for size in MICRO_SIZES)}")
    return {f"micro{size}_vs_{max(MICRO_SIZES)}": result["vs_largest"][str(size)]
            for size in MICRO_SIZES if size != max(MICRO_SIZES)}


def measure_ddp(b: Bench) -> dict[str, float]:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node=1", "-m", "elastic_mnist", "train"]
    run_dir, _ = b.worker("ddp", b.tuned_flags, launcher=torchrun)
    return {"ddp_samples_per_s": worker_samples_per_s(run_dir, BATCH, b.sizes.warmup)}


def save_costs(step_seconds: dict[int, float], saves: list[tuple[int, float]]) -> list[float]:
    """What each save cost the loop, in seconds: the steps it touched (the one it follows, whose
    window holds the save's blocking part, and those its background write overlapped) against
    the median step among the NEIGHBOURS around them. ``saves``: (step, seconds from the end of
    that step to the write's commit). A save whose write outlasted the run's remaining steps (a
    loaded machine) has no steps after it to compare with: it is left out."""
    costs = []
    for step, commit_s in saves:
        around = [step_seconds[j] for j in range(step - NEIGHBOURS + 1, step + 1)]
        typical = statistics.median(around)
        touched = range(step + 1, step + 2 + int(commit_s / typical))
        after = range(touched[-1] + 1, touched[-1] + 1 + NEIGHBOURS)
        if after[-1] not in step_seconds:
            continue
        typical = statistics.median(around + [step_seconds[j] for j in after])
        costs.append(sum(step_seconds[j] - typical for j in touched))
    return costs


def measure_checkpoint(b: Bench) -> dict[str, float]:
    """Our worker saving a checkpoint every 2 s by the clock and logging every step: what a save
    costs, here and at the default cadence (``--checkpoint-every-seconds``'s default).

    Separate runs differ by far more than 1% on a shared machine, so the comparison is made within
    one run, between the steps a save touched and the steps around them (save_costs)."""
    if b.worker_step_s is None:
        raise ContenderFailed("the checkpoint contender needs the worker's step time: run both")
    s = b.sizes
    every = max(1, round(s.checkpoint_interval_s / b.worker_step_s))
    steps = max(every, NEIGHBOURS) * (s.checkpoint_saves + 1) + NEIGHBOURS
    work = b.scratch("checkpoint")
    run([sys.executable, "-m", "elastic_mnist", "train",
         *b.train_args(work, *b.steps_flags(BATCH, steps, log_every=1),
                       "--checkpoint-every-seconds", str(s.checkpoint_interval_s),
                       *b.tuned_flags)], work / "log.txt", b.env, s.timeout_s)
    run_dir = work / "runs" / "bench"
    step_seconds = dict(step_windows(run_dir))  # every step is a log window of its own
    ended = {event.step: event.wall_time for event in scalars(run_dir, "perf/step_ms")}
    saves = [e for e in events(run_dir)
             if e["event"] == "checkpoint" and NEIGHBOURS <= e["step"] <= steps - 2 * NEIGHBOURS]
    if not saves:
        raise ContenderFailed(f"no checkpoint to measure in {run_dir}")
    costs = save_costs(step_seconds, [(e["step"], event_time(e) - ended[e["step"]])
                                      for e in saves])
    if not costs:
        raise ContenderFailed(f"every save in {run_dir} outlasted the steps after it")
    saved_at = sorted(event_time(e) for e in saves)
    interval_s = statistics.median(b - a for a, b in itertools.pairwise(saved_at)) \
        if len(saved_at) > 1 else s.checkpoint_interval_s
    cost_s = statistics.median(costs)
    return {"ckpt_blocking_ms": statistics.median(e["blocking_ms"] for e in saves),
            "ckpt_cost_ms": 1e3 * cost_s, "ckpt_interval_s": interval_s,
            "ckpt_overhead_pct": 100 * cost_s / interval_s,
            "ckpt_default_overhead_pct": 100 * cost_s / DEFAULT_CHECKPOINT_S}


def shipped_launcher(b: Bench, args: list[str]) -> list[str]:
    """jobs/node.sh's launch line for one node (it prints it with DRY_RUN=1)."""
    env = {**b.env, "DRY_RUN": "1", "NNODES": "1", "NPROC_PER_NODE": str(b.sizes.recovery_workers),
           "MAX_RESTARTS": "1",
           "RUN_ID": "bench", "TORCHRUN": f"{sys.executable} -m torch.distributed.run"}
    printed = subprocess.run(["bash", str(REPO / "jobs" / "node.sh"), *args], env=env, cwd=REPO,
                             capture_output=True, text=True, check=True)
    return printed.stdout.splitlines()


def default_launcher(b: Bench, args: list[str]) -> list[str]:
    """Plain ``torchrun --standalone`` (jobs/local.sh's line): torch's rendezvous defaults."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={b.sizes.recovery_workers}", "--max_restarts=1", "-m",
            "elastic_mnist", "train", *args]


def worker_of_rank(launcher_pid: int, rank: int):
    import psutil

    for proc in psutil.Process(launcher_pid).children(recursive=True):
        try:
            if proc.environ().get("RANK") == str(rank):
                return proc
        except psutil.Error:
            continue
    return None


def wait_for(predicate: Callable[[], bool], proc: subprocess.Popen, log: Path,
             timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc.poll() is not None:
            raise failure(log, f"the run ended (status {proc.returncode}) too early")
        if time.monotonic() > deadline:
            kill_tree(proc.pid)
            raise failure(log, "the run timed out")
        time.sleep(0.02)


def recovery(b: Bench, name: str, launcher: Callable[[Bench, list[str]], list[str]]
             ) -> dict[str, float]:
    """Kills rank 0 of the node's workers after a checkpoint; times the first step after the
    restart."""
    s = b.sizes
    work = b.scratch(name)
    log = work / "log.txt"
    every = max(1, s.recovery_kill_at // 2)
    args = b.train_args(work, *b.steps_flags(BATCH, s.recovery_steps, log_every=1,
                                             micro_batch=BATCH // 2),
                        "--checkpoint-every", str(every))
    proc = start(launcher(b, args), log, b.env)
    try:
        wait_for(lambda: newest_committed_step(work / "ckpt") >= s.recovery_kill_at, proc, log,
                 s.timeout_s)
        rank0 = worker_of_rank(proc.pid, 0)  # it has just committed the checkpoint
        if rank0 is None:
            raise failure(log, "no worker of rank 0 found")
        rank0.send_signal(signal.SIGKILL)
        killed_at = time.time()
        returncode = proc.wait(timeout=s.timeout_s)
    finally:
        kill_tree(proc.pid)
    if returncode != 0:
        raise failure(log, f"the run exited with status {returncode}")
    run_dir = work / "runs" / "bench"
    after = [e.wall_time for e in scalars(run_dir, "train/loss") if e.wall_time > killed_at]
    restarts = [event_time(e) for e in events(run_dir) if e["event"] == "start"]
    if not after or len(restarts) < 2:
        raise failure(log, "the run shows no restart")
    return {f"{name}_s": min(after) - killed_at, f"{name}_start_s": restarts[-1] - killed_at}


def measure_recovery_shipped(b: Bench) -> dict[str, float]:
    return recovery(b, "recovery_shipped", shipped_launcher)


def measure_recovery_defaults(b: Bench) -> dict[str, float]:
    return recovery(b, "recovery_defaults", default_launcher)


def measure_real(b: Bench) -> dict[str, float]:
    """docs/performance.md's accuracy run: default flags, 5 epochs on the real 8,000/2,000 split."""
    assert b.real_split is not None
    work = b.scratch("real")
    args = b.train_args(work, "--epochs", str(b.sizes.real_epochs),
                        data=Data(b.real_split, "mnist"))
    finished = run([sys.executable, "-m", "elastic_mnist", "train", *args], work / "log.txt", b.env,
                   b.sizes.timeout_s)
    run_dir = work / "runs" / "bench"
    finish = [e for e in events(run_dir) if e["event"] == "finish"][-1]
    return {"real_wall_s": finished.wall_s,
            "real_train_s": sum(seconds for _, seconds in step_windows(run_dir)),
            "real_accuracy_pct": 100 * finish["test_accuracy"]}


IMPORT_PROBE = """
import json, sys, time
import torch
imported = time.time()
import torch._dynamo
print(json.dumps({"torch": imported - float(sys.argv[1]), "dynamo": time.time() - imported}))
"""


def measure_startup(b: Bench) -> dict[str, float]:
    """Seconds from exec to the first completed step of one worker process, beside the seconds
    from exec to a bare ``import torch`` done and to ``import torch._dynamo`` after it, which
    torch's optimizers and DDP import, in another process of the same repetition."""
    work = b.scratch("startup")
    began = time.time()
    run([sys.executable, "-m", "elastic_mnist", "train",
         *b.train_args(work, *b.steps_flags(BATCH, 1, 1), "--audit-samples")],
        work / "log.txt", b.env, b.sizes.timeout_s)
    audit = work / "runs" / "bench" / "audit" / "g0-r0.jsonl"
    first_step = json.loads(audit.read_text().splitlines()[0])["time"] - began
    probe = b.scratch("import")
    run([sys.executable, "-c", IMPORT_PROBE, repr(time.time())], probe / "log.txt", b.env,
        b.sizes.timeout_s)
    imports = json.loads((probe / "log.txt").read_text().splitlines()[-1])
    return {"startup_first_step_s": first_step, "startup_import_torch_s": imports["torch"],
            "startup_import_dynamo_s": imports["dynamo"],
            "startup_ours_s": first_step - imports["torch"] - imports["dynamo"]}


def measure_fast(b: Bench) -> dict[str, float]:
    """The GPU fast path at a batch that fills the GPU; its epoch time and start-up."""
    began = time.time()
    run_dir, _ = b.worker("fast", FAST_FLAGS, batch=GPU_FAST_BATCH)
    samples_per_s = worker_samples_per_s(run_dir, GPU_FAST_BATCH, b.sizes.warmup)
    first_window = scalars(run_dir, "perf/step_ms")[0].wall_time
    return {"fast_samples_per_s": samples_per_s, "fast_epoch_s": 60_000 / samples_per_s,
            "fast_startup_s": first_window - began}


def measure_fast_accumulating(b: Bench) -> dict[str, float]:
    """The fast path with gradient accumulation, which compiles without CUDA graphs."""
    run_dir, _ = b.worker("fast-accumulating", FAST_FLAGS, batch=GPU_FAST_BATCH,
                          micro_batch=GPU_FAST_BATCH // FAST_MICRO_BATCHES)
    return {"fast_accumulating_samples_per_s":
            worker_samples_per_s(run_dir, GPU_FAST_BATCH, b.sizes.warmup)}


def measure_fast_floor(b: Bench) -> dict[str, float]:
    return {"fast_floor_samples_per_s": b.floor(GPU_FAST_BATCH, FAST_FLAGS)}


CONTENDERS: dict[str, Callable[[Bench], dict[str, float]]] = {
    "seed": measure_seed, "worker": measure_worker, "checkpoint": measure_checkpoint,
    "floor": measure_floor, "paired": measure_paired, "defaults": measure_defaults,
    "ddp": measure_ddp,
    "recovery_shipped": measure_recovery_shipped, "recovery_defaults": measure_recovery_defaults,
    "real": measure_real, "fast": measure_fast, "fast_floor": measure_fast_floor,
    "fast_accumulating": measure_fast_accumulating,
    "startup": measure_startup, "micro": measure_micro,
}
CPU_SET = ["paired", "worker", "seed", "checkpoint", "recovery_shipped",
           "recovery_defaults", "real", "startup", "micro"]
GPU_SET = ["seed", "defaults", "fast", "fast_accumulating", "real"]
"""On a GPU the tuned flags compile, which takes time: they run once, at the fast path's batch."""


def ratios(figures: dict[str, float]) -> dict[str, float]:
    """Comparisons within one repetition."""
    derived = {}

    def ratio(name: str, ours: str, theirs: str, fn: Callable[[float, float], float]) -> None:
        if ours in figures and theirs in figures:
            derived[name] = fn(figures[ours], figures[theirs])

    def times(x: float, y: float) -> float:
        return x / y

    def percent(x: float, y: float) -> float:
        return 100 * x / y

    def overhead_pct(x: float, y: float) -> float:
        """How much longer the same steps took, as a share of the wall time without."""
        return 100 * (x / y - 1)

    ratio("worker_vs_seed", "worker_samples_per_s", "seed_samples_per_s", times)
    ratio("defaults_vs_seed", "defaults_samples_per_s", "seed_samples_per_s", times)
    ratio("worker_vs_floor_pct", "worker_samples_per_s", "floor_samples_per_s", percent)
    ratio("ddp_run_overhead_pct", "worker_samples_per_s", "ddp_samples_per_s", overhead_pct)
    ratio("fast_vs_seed", "fast_samples_per_s", "seed_samples_per_s", times)
    ratio("fast_vs_floor_pct", "fast_samples_per_s", "fast_floor_samples_per_s", percent)
    return derived


@dataclass
class Outcome:
    """Every repetition's figures, and the contenders that failed."""

    reps: list[dict[str, float]] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)


def run_contenders(b: Bench, names: list[str], say: Callable[[str], None]) -> Outcome:
    """A B C ... A B C ...: each repetition runs every contender once, in the same order."""
    outcome = Outcome()
    for rep in range(b.sizes.reps):
        figures: dict[str, float] = {}
        for name in names:
            if name in outcome.errors:
                continue
            began = time.perf_counter()
            try:
                measured = CONTENDERS[name](b)
            except ContenderFailed as e:
                outcome.errors[name] = str(e)
                say(f"  {name}: FAILED: {str(e).splitlines()[0]}")
                continue
            figures.update(measured)
            shown = ", ".join(f"{k} {v:,.4g}" for k, v in measured.items())
            say(f"  rep {rep + 1}/{b.sizes.reps} {name} ({time.perf_counter() - began:.0f} s): "
                f"{shown}")
        figures.update(ratios(figures))
        outcome.reps.append(figures)
    return outcome


def summarize(reps: list[dict[str, float]]) -> dict[str, dict]:
    """Each figure's min, median and max over the repetitions, and every value."""
    names = sorted({name for rep in reps for name in rep})
    summary = {}
    for name in names:
        values = [rep[name] for rep in reps if name in rep]
        summary[name] = {"min": min(values), "median": statistics.median(values),
                         "max": max(values), "runs": values}
    return summary


# --- the report -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    figure: str
    label: str
    unit: str
    target: tuple[str, float] | None = None
    """("≥" or "≤", threshold), judged on the median."""

    def met(self, value: float) -> bool | None:
        if self.target is None:
            return None
        op, threshold = self.target
        return value >= threshold if op == "≥" else value <= threshold


ROWS = [
    Row("seed_samples_per_s", "Seed loop (DataLoader with ToTensor, SGD)", "samples/s"),
    Row("worker_samples_per_s", "Our worker, one process, {tuned}", "samples/s"),
    Row("worker_vs_seed", "Our worker ÷ seed loop", "×", ("≥", 1.5)),
    Row("defaults_samples_per_s", "Our worker, one process, default flags", "samples/s"),
    Row("defaults_vs_seed", "Our worker with default flags ÷ seed loop", "×"),
    Row("paired_floor_samples_per_s", "Compute floor: forward, backward, step, {tuned}",
        "samples/s"),
    Row("paired_worker_samples_per_s",
        "Our worker's loop (step, scalars, a checkpoint every {block} steps), beside the floor",
        "samples/s"),
    Row("paired_worker_vs_floor_pct", "Our worker's loop ÷ compute floor, paired", "%",
        ("≥", 95.0)),
    Row("paired_ddp_samples_per_s", "Our worker's loop with DDP at world size 1, beside it",
        "samples/s"),
    Row("paired_ddp_overhead_pct", "DDP overhead at world size 1, paired", "% of wall time",
        ("≤", 3.0)),
    Row("floor_samples_per_s", "Compute floor in a process of its own", "samples/s"),
    Row("worker_vs_floor_pct", "Our worker ÷ compute floor, separate runs", "%"),
    Row("ddp_samples_per_s", "Our worker under torchrun: DDP at world size 1", "samples/s"),
    Row("ddp_run_overhead_pct", "DDP under torchrun against one process, separate runs",
        "% of wall time"),
    Row("micro8_vs_32", "Default global batch's step, micro-batches of 8 (the default) ÷ of "
        "32, paired", "×"),
    Row("micro4_vs_32", "… micro-batches of 4 ÷ of 32, paired", "×"),
    Row("ckpt_interval_s", "Checkpoints: time between saves", "s"),
    Row("ckpt_cost_ms", "Checkpoints: what a save costs the loop", "ms"),
    Row("ckpt_overhead_pct", "Checkpoint overhead", "% of wall time", ("≤", 1.0)),
    Row("ckpt_default_overhead_pct",
        "Checkpoint overhead at the default cadence (a save every {default_checkpoint_s:g} s)",
        "% of wall time", ("≤", 1.0)),
    Row("ckpt_blocking_ms", "Blocking time per save", "ms", ("≤", 5.0)),
    Row("recovery_shipped_s", "Recovery after SIGKILL, jobs/node.sh settings", "s", ("≤", 10.0)),
    Row("recovery_shipped_start_s", "… of which until the new workers' start", "s"),
    Row("recovery_defaults_s", "Recovery after SIGKILL, torchrun defaults", "s"),
    Row("recovery_defaults_start_s", "… of which until the new workers' start", "s"),
    Row("fast_samples_per_s", "GPU fast path, batch {fast_batch}: {fast}", "samples/s"),
    Row("fast_floor_samples_per_s", "GPU fast path's compute floor", "samples/s"),
    Row("fast_accumulating_samples_per_s",
        "GPU fast path, {fast_micro} micro-batches per step (compiled without CUDA graphs)",
        "samples/s"),
    Row("fast_vs_seed", "GPU fast path ÷ seed loop", "×", ("≥", 20.0)),
    Row("fast_vs_floor_pct", "GPU fast path ÷ its compute floor", "%"),
    Row("fast_epoch_s", "One 60,000-sample epoch, training time", "s", ("≤", 1.0)),
    Row("fast_startup_s", "GPU fast path: start-up, compilation and warm-up steps", "s"),
    Row("real_accuracy_pct", "Real digits, {epochs} epochs, default flags: test accuracy", "%"),
    Row("real_wall_s", "Real digits, {epochs} epochs: wall time of the command", "s"),
    Row("real_train_s", "Real digits, {epochs} epochs: training loop, evaluations included",
        "s"),
    Row("startup_first_step_s", "Start-up: exec to the first completed step, one worker", "s"),
    Row("startup_import_torch_s", "… a bare `import torch`, beside it", "s"),
    Row("startup_import_dynamo_s", "… `torch._dynamo`, which torch's optimizers and DDP import",
        "s"),
    Row("startup_ours_s", "… the rest: our imports, data, model, first step", "s"),
    Row("worker_peak_rss_mb", "Peak resident memory, one worker", "MB", ("≤", 1500.0)),
    Row("seed_peak_rss_mb", "Peak resident memory, seed loop", "MB"),
]


def fmt(value: float) -> str:
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}" if abs(value) >= 1 else f"{value:.2g}"


def judged(results: dict) -> list[tuple[Row, dict, bool | None]]:
    figures = results["figures"]
    return [(row, figures[row.figure], row.met(figures[row.figure]["median"]))
            for row in ROWS if row.figure in figures]


def table(results: dict) -> str:
    m = results["method"]
    names = {"tuned": f"`{' '.join(m['tuned_flags'])}`" if m["tuned_flags"] else "default flags",
             "fast": f"`{' '.join(FAST_FLAGS)}`",
             "fast_batch": m["gpu_fast_batch"], "epochs": m["real_epochs"],
             "fast_micro": m.get("fast_micro_batches", FAST_MICRO_BATCHES),
             "block": m.get("paired_block", "N"),
             "default_checkpoint_s": m.get("default_checkpoint_s", DEFAULT_CHECKPOINT_S)}
    lines = ["| | median | min | max | unit | target |", "|---|---:|---:|---:|---|---|"]
    for row, figure, met in judged(results):
        target = "" if row.target is None else \
            f"{row.target[0]} {fmt(row.target[1])}: **{'met' if met else 'NOT MET'}**"
        lines.append(f"| {row.label.format(**names)} | {fmt(figure['median'])} | "
                     f"{fmt(figure['min'])} | {fmt(figure['max'])} | {row.unit} | {target} |")
    return "\n".join(lines)


def describe_machine(device: str) -> dict:
    import psutil
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else None
    return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(),
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1), "gpu": gpu,
            "os": platform.platform(), "python": platform.python_version()}


def shown_path(path: Path | None) -> str | None:
    """A path as results.json keeps it: relative to the repository, or just its name."""
    if path is None:
        return None
    path = Path(path).resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else f".../{path.name}"


def results_record(b: Bench, names: list[str], outcome: Outcome, argv: list[str]) -> dict:
    import torch
    import torchvision

    # A path outside the repository, absolute or relative (a data folder beside the clone),
    # is this machine's own: kept by its name only.
    shown = [shown_path(Path(arg)) if arg.startswith("/") or Path(arg).exists() else arg
             for arg in argv]
    results = {
        "generated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["scripts/bench.py", *shown]),
        "machine": describe_machine(b.device),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "device": b.device,
        "threads": {"per_process": b.threads,
                    "how": f"OMP_NUM_THREADS={b.threads} in every contender's environment"},
        "data": {"kind": b.data.kind, "root": shown_path(b.data.root),
                 "note": ("synthetic digits rendered by `elastic-mnist synth` (MNIST is not "
                          "downloadable here)") if b.data.kind == "synthetic" else "MNIST",
                 "real_split": shown_path(b.real_split)},
        "method": {"repetitions": b.sizes.reps, "order": "contenders alternate within each "
                   "repetition; ratios are taken within a repetition",
                   "contenders": names,
                   "batch": BATCH, "steps": b.sizes.steps, "warmup_steps": b.sizes.warmup,
                   "tuned_flags": b.tuned_flags, "gpu_fast_batch": GPU_FAST_BATCH,
                   "fast_micro_batches": FAST_MICRO_BATCHES,
                   "real_epochs": b.sizes.real_epochs, "paired_block": b.sizes.paired_block,
                   "default_checkpoint_s": DEFAULT_CHECKPOINT_S},
        "figures": summarize(outcome.reps),
        "errors": outcome.errors,
    }
    results["targets"] = {row.figure: {"target": f"{row.target[0]} {row.target[1]}",
                                       "median": figure["median"], "met": met}
                          for row, figure, met in judged(results) if row.target is not None}
    return results


def readme_section(results: dict) -> str:
    m = results["machine"]
    where = f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB"
    where += f", GPU {m['gpu']}" if m["gpu"] else ", no GPU"
    method, data = results["method"], results["data"]
    threads = results["threads"]["per_process"]
    tuned = f"`{' '.join(method['tuned_flags'])}`"
    lines = [
        (f"`make bench` (`scripts/bench.py`, whose docstring gives the method) on {where}; "
         f"torch {results['torch']} on {results['device']}, {threads} intra-op "
         f"thread{'s' if threads > 1 else ''} per process; {data['kind']} digits for the "
         f"throughput rows; batch {method['batch']}; {results['generated']}. Medians of "
         f"{method['repetitions']} repetitions that alternate the contenders; min and max show "
         f"how much they varied (this machine is shared with other jobs)."),
        "",
        (f"Our worker runs with {tuned}." if method["tuned_flags"] else
         "Our worker runs with its default flags (channels-last on; fp32; not compiled).")
        if results["device"] == "cpu" else
        f"The fast path runs with {tuned} at batch {method['gpu_fast_batch']}.",
        "",
        table(results),
        "",
        ("Reproduce with `make bench` (`make bench BENCH_ARGS=\"--real-data DIR\"` adds the "
         "real-digit rows, DIR holding the MNIST test files); every number above is read from "
         "`bench/results.json`."),
    ]
    if results["errors"]:
        lines += ["", "Failed contenders: " + ", ".join(sorted(results["errors"])) + "."]
    return "\n".join(lines)


def update_readme(results_path: Path, root: Path = REPO) -> Path:
    """Replaces the bench block (docs/performance.md's table) with the latest results."""
    return markers.rewrite("bench", readme_section(json.loads(results_path.read_text())), root)


# --- data -------------------------------------------------------------------------------------


def prepare_data(data_dir: Path | None, say: Callable[[str], None]) -> Data:
    """The throughput contenders' digits: ``data_dir``, or 60,000 synthetic ones in bench/data."""
    from elastic_mnist.data.datasets import is_synthetic_dir, prepare

    if data_dir is None:
        data_dir = REPO / "bench" / "data"
        if not is_synthetic_dir(data_dir):
            say(f"generating 60,000 + 10,000 synthetic digits into {data_dir} (once)")
            subprocess.run([sys.executable, "-m", "elastic_mnist", "synth", "--out",
                            str(data_dir), "--train", "60000", "--test", "10000"], check=True,
                           stdout=subprocess.DEVNULL)
    kind = "synthetic" if is_synthetic_dir(data_dir) else "mnist"
    prepare(data_dir, kind, download=False, synthetic_fallback=False)  # extracts .gz files
    return Data(Path(data_dir).resolve(), kind)


def prepare_real_split(folder: Path, work: Path) -> Path:
    """``folder`` itself when it holds MNIST/raw; from a folder of the MNIST test files
    (t10k-*.gz), their first 8,000 digits for training and last 2,000 for testing."""
    from elastic_mnist.data.datasets import has_split_files, prepare, raw_dir
    from elastic_mnist.data.idx import IMAGES_MAGIC, LABELS_MAGIC, gunzip, read_idx, write_idx

    if has_split_files(folder):
        prepare(folder, "mnist", download=False, synthetic_fallback=False)
        return folder.resolve()
    names = ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
    if not all((folder / f"{name}.gz").exists() for name in names):
        raise SystemExit(f"--real-data {folder}: neither MNIST/raw nor {names[0]}.gz is there")
    split = work / "real-split"
    for name in names:
        gunzip(folder / f"{name}.gz", split / name)
    images = read_idx(split / names[0], IMAGES_MAGIC)
    labels = read_idx(split / names[1], LABELS_MAGIC)
    for prefix, part in (("train", slice(0, 8000)), ("t10k", slice(8000, 10000))):
        write_idx(raw_dir(split) / f"{prefix}-images-idx3-ubyte", images[part])
        write_idx(raw_dir(split) / f"{prefix}-labels-idx1-ubyte", labels[part])
    return split


# --- command line -----------------------------------------------------------------------------


def resolve_device(choice: str) -> str:
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return choice


def benchmark(args: argparse.Namespace, argv: list[str]) -> int:
    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    from elastic_mnist.errors import DataError

    sizes = QUICK if args.quick else FULL
    if args.reps:
        sizes = dataclasses.replace(sizes, reps=args.reps)
    device = resolve_device(args.device)
    names = args.only or (CPU_SET if device == "cpu" else GPU_SET)
    if args.real_data is None:
        if args.only and "real" in args.only:
            raise SystemExit("bench: the real contender needs --real-data DIR")
        names = [name for name in names if name != "real"]
    work = args.work or args.out.parent / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        b = Bench(data=prepare_data(args.data_dir, say), device=device, threads=args.threads,
                  sizes=sizes, work=work)
        if args.real_data is not None:
            b.real_split = prepare_real_split(args.real_data, work)
    except DataError as e:
        raise SystemExit(f"bench: {e}") from None
    say(f"bench on {device}: {', '.join(names)}; {sizes.reps} repetition(s), "
        f"{b.threads} thread(s) per process")
    outcome = run_contenders(b, names, say)
    results = results_record(b, names, outcome, argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    say(f"wrote {args.out}")
    return 1 if outcome.errors else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes and one repetition: a smoke test, not a measurement")
    parser.add_argument("--reps", type=int, default=0, help="repetitions (default: 3; quick: 1)")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="digits in torchvision's layout (default: synthetic, in bench/data)")
    parser.add_argument("--real-data", type=Path, default=None,
                        help="the real 8,000/2,000 split (DIR/MNIST/raw), or a folder of the MNIST "
                             "test files t10k-*.gz to make it from; without it no real-data row")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads of every contender's process (default: 1)")
    parser.add_argument("--only", type=lambda s: s.split(","), default=None,
                        help=f"comma-separated contenders, of: {', '.join(CONTENDERS)}")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results file to write")
    parser.add_argument("--work", type=Path, default=None,
                        help="scratch folder of the runs, emptied first (default: work/ beside "
                             "--out)")
    parser.add_argument("--update-readme", action="store_true",
                        help="only rewrite docs/performance.md's table from --out")
    return parser


CHILD_COMMANDS = ("seed-loop", "floor", "paired", "micro")


def child_main(argv: list[str]) -> int:
    """The commands this script runs in child processes of its own."""
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=CHILD_COMMANDS)
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=0)
    parser.add_argument("--block", type=int, default=0)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--flags", default="",
                        help="the worker's flags that the floor copies (micro: the sizes)")
    args = parser.parse_args(argv)
    if args.command == "seed-loop":
        result = seed_loop(args.data_dir, args.device, args.steps, args.warmup)
    elif args.command == "floor":
        result = compute_floor(args.data_dir, args.dataset, args.device, args.steps, args.warmup,
                               args.batch, args.flags.split())
    elif args.command == "micro":
        result = micro_batch_steps(args.data_dir, args.dataset, args.device,
                                   [int(size) for size in args.flags.split()], args.rounds)
    else:
        result = paired_steps(args.data_dir, args.dataset, args.device, args.batch,
                              args.flags.split(), args.rounds, args.block,
                              str(args.result.parent))
    args.result.write_text(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in CHILD_COMMANDS:  # a process of its own, which may run a group
        from elastic_mnist.distributed import end_process

        end_process(child_main(argv))
    args = build_parser().parse_args(argv)
    if args.update_readme:
        print(f"updated {update_readme(args.out)} from {args.out}", file=sys.stderr)
        return 0
    unknown = set(args.only or ()) - set(CONTENDERS)
    if unknown:
        raise SystemExit(f"--only: unknown contenders {sorted(unknown)}")
    return benchmark(args, argv)


if __name__ == "__main__":
    sys.exit(main())
