"""The job's configuration: dataclasses with a docstring per field, and one argparse over them.

The docstring under each field is its ``--help`` text, so ``--help`` is the documentation.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import itertools
import math
import textwrap
import typing
from dataclasses import dataclass, field
from typing import Literal

from elastic_mnist.errors import ConfigError

MICRO_BATCH = 8
"""The default micro-batch's largest size: small enough that the default global batch is 96 of
them, large enough that the CPU loop's samples/s stay at 0.8x those of micro-batches of 32
(at 4, 0.58x)."""


@dataclass
class DataConfig:
    """Where the digits come from."""

    data_dir: str = "data"
    """Folder in torchvision's MNIST layout (<data-dir>/MNIST/raw/...)."""
    dataset: Literal["mnist", "synthetic"] = "mnist"
    """Real MNIST, or rendered synthetic digits (generated into --data-dir when absent)."""
    download: bool = True
    """Download MNIST when its files are missing (LOCAL_RANK 0 of each node, the others wait)."""
    synthetic_fallback: bool = False
    """When MNIST cannot be had, train on synthetic digits instead (with a loud warning)."""


@dataclass
class OptimConfig:
    """How the model learns."""

    epochs: int = 2
    """Passes over the training set."""
    max_steps: int = 0
    """Stop after this many optimizer steps in total (0: no limit beyond --epochs)."""
    global_batch_size: int = 768
    """Samples per optimizer step, summed over all ranks, whatever the world size (768: 96
    micro-batches of 8, an equal share for every rank at 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48 or
    96 ranks: the card's 32 and the 24 left after a node's loss among them)."""
    micro_batch_size: int = 0
    """Samples per forward pass; a global batch is cut into such micro-batches, shared by ranks,
    and BatchNorm normalises each by its own statistics, so it is part of the optimisation
    (0: the largest divisor of --global-batch-size not above 8)."""
    lr: float = 5e-3
    """Peak learning rate of AdamW (for the default global batch)."""
    warmup_steps: int = 10
    """Steps of linear learning-rate warm-up before the cosine decay."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW)."""
    seed: int = 0
    """Seed of the model's initialisation and of every epoch's sample order."""
    grad_sync: Literal["ddp", "allreduce"] = "ddp"
    """Gradient averaging: DistributedDataParallel, or a hand-written all-reduce (as the seeds)."""

    def __post_init__(self) -> None:
        if self.micro_batch_size == 0:
            self.micro_batch_size = default_micro_batch_size(self.global_batch_size)


def default_micro_batch_size(global_batch_size: int, largest: int = MICRO_BATCH) -> int:
    """The largest divisor of the global batch not above ``largest``: no short micro-batch."""
    return next((d for d in range(min(largest, global_batch_size), 0, -1)
                 if global_batch_size % d == 0), 0)


@dataclass
class CheckpointConfig:
    """What survives a restart."""

    checkpoint_dir: str = "checkpoints"
    """Folder of this run's checkpoints; a restarted job resumes from the newest valid one."""
    checkpoint_every: int = 0
    """Also save every N optimizer steps (0: no step count; see --checkpoint-every-seconds)."""
    checkpoint_every_seconds: float = 10.0
    """Also save at the first step that ends this many seconds after the last save began, so a
    restart redoes about that much training whatever the step time (0: off; saves are also made
    at every epoch end and at the end)."""
    keep_last: int = 3
    """Checkpoints kept on disk; older ones are pruned after a new one is committed."""
    lease_timeout: float = 15.0
    """Seconds the folder stays this job's after its lease was last renewed (5 times as often),
    for launches on machines that cannot see whether its processes still run
    (docs/operations.md's "One live job per checkpoint folder")."""
    take_over: bool = False
    """Take the folder from the job that holds its lease without waiting for the lease to lapse:
    only when that job is known to be gone (if it is not, it stops at its next renewal)."""


@dataclass
class RunConfig:
    """Where the run reports, and on what it runs."""

    logdir: str = "runs"
    """TensorBoard root; rank 0 writes under <logdir>/<run id>."""
    run_id: str = ""
    """Name of the run (default: torchrun's --rdzv_id where the user named it, else the one kept
    beside the checkpoints, else a new one)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: cuda:LOCAL_RANK with NCCL when a GPU is visible, else CPU with gloo."""
    precision: Literal["fp32", "tf32", "bf16"] = "fp32"
    """Arithmetic of convolutions and matmuls on a GPU: fp32 is IEEE fp32 (TF32 off, which torch
    leaves on for convolutions), tf32 uses TF32 tensor cores (Ampere and newer), bf16 is bf16
    autocast; weights and optimizer stay fp32 (on CPU tf32 is fp32)."""
    channels_last: bool = True
    """Keep weights and activations channels-last (NHWC): a third faster on CPU (oneDNN), and
    the layout of fast GPU convolutions."""
    compile: bool = False
    """torch.compile the model (compiling adds to the start-up); on a GPU with CUDA graphs where
    each rank runs one micro-batch per step, without them where it accumulates several."""
    log_every: int = 20
    """Log training scalars every N optimizer steps."""
    pg_timeout: float = 120.0
    """Seconds a collective may wait for a peer before the job fails (instead of hanging)."""
    hang_timeout: float = 10.0
    """Least seconds without a completed step before a rank counts as hung and the group goes
    on without it; the deadline grows to 10x the slowest recent step (0: no watchdog)."""
    recovery: Literal["auto", "in-process", "restart"] = "auto"
    """When a node dies, leaves or freezes: the survivors go on in their own processes
    (in-process; gloo only: refused on NCCL until it has run on GPUs), or torchrun restarts every
    worker from the last checkpoint (restart). auto: in process on gloo under a multi-node
    rendezvous (ours or torch's c10d), by restart on NCCL and on one node."""
    balance: bool = False
    """While pace.py names a rank a straggler, share each step's micro-batches among the ranks in
    proportion to their measured speed, with hysteresis; even shares otherwise, and the update the
    same up to the order of its sums (docs/performance.md). Off by default: it wins nothing where
    no node is slow, and a rank named on a machine whose cores its ranks share (a laptop, a CI
    runner) would cost the run its bitwise reproducibility; on for nodes that are machines of
    their own (make stragglers: nine tenths of what a 2x-slow node costs won back)."""
    evict_slower_than: float = 0.0
    """Let a node go, in process, once a rank of it has been named a straggler this many times
    slower than its peers' median for --evict-after seconds; it comes back by the join path once
    it is fast again (eviction.py). 0: never (at least pace.SLOW, 1.5, where given)."""
    evict_after: float = 60.0
    """Seconds a straggler must stay --evict-slower-than times slower before it is let go."""
    max_nonfinite_steps: int = 3
    """Stop the job after this many steps in a row whose loss or gradients are NaN or infinite
    (each is skipped: no update)."""
    resume_command: str = ""
    """The command that continues this run, said in the line that a stop on Ctrl-C ends with
    (jobs/local.sh and make train give theirs; default: this command line, without torchrun)."""
    audit_samples: bool = False
    """Every rank appends the sample indices of each step to <run dir>/audit/g<G>-r<R>.jsonl."""


@dataclass
class TrainConfig:
    """Everything ``elastic-mnist train`` takes."""

    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def validate(self) -> None:
        """Raises ConfigError with a one-line message naming the bad flag."""
        o = self.optim
        for section in (self.data, o, self.checkpoint, self.run):
            for f in dataclasses.fields(section):
                value = getattr(section, f.name)
                if isinstance(value, float) and not math.isfinite(value):
                    raise ConfigError(f"{flag_name(f.name)} must be a finite number, got {value}")
        _positive("--epochs", o.epochs)
        _positive("--global-batch-size", o.global_batch_size)
        _positive("--micro-batch-size", o.micro_batch_size)
        _positive("--log-every", self.run.log_every)
        _positive("--keep-last", self.checkpoint.keep_last)
        _positive("--pg-timeout", self.run.pg_timeout)
        _positive("--max-nonfinite-steps", self.run.max_nonfinite_steps)
        _positive("--lease-timeout", self.checkpoint.lease_timeout)
        _positive("--lr", o.lr)
        for flag, value in (("--max-steps", o.max_steps), ("--warmup-steps", o.warmup_steps),
                            ("--checkpoint-every", self.checkpoint.checkpoint_every),
                            ("--checkpoint-every-seconds",
                             self.checkpoint.checkpoint_every_seconds),
                            ("--weight-decay", o.weight_decay),
                            ("--hang-timeout", self.run.hang_timeout)):
            if value < 0:
                raise ConfigError(f"{flag} must not be negative, got {value}")
        if self.run.recovery == "in-process" and self.run.hang_timeout <= 0:
            raise ConfigError("--recovery in-process needs the watchdog to bound every wait: "
                              "give --hang-timeout a positive value")
        from elastic_mnist.pace import SLOW  # torch's: only where a run is validated

        evict = self.run.evict_slower_than
        if evict and evict < SLOW:
            raise ConfigError(f"--evict-slower-than must be 0 (never) or at least {SLOW:g}, the "
                              f"factor at which a rank is named a straggler; got {evict:g}")
        if evict and self.run.recovery == "restart":
            raise ConfigError("--evict-slower-than lets a node go in process: not with "
                              "--recovery restart")
        if self.run.evict_after < 0:
            raise ConfigError(f"--evict-after must not be negative, got {self.run.evict_after}")
        if o.micro_batch_size > o.global_batch_size:
            raise ConfigError(
                f"--micro-batch-size ({o.micro_batch_size}) exceeds --global-batch-size "
                f"({o.global_batch_size})"
            )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _positive(flag: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{flag} must be positive, got {value}")


# --- argparse over the dataclasses -------------------------------------------------------------


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, read from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)):
            docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def flag_name(name: str) -> str:
    """``max_steps`` becomes ``--max-steps``."""
    return "--" + name.replace("_", "-")


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type,
                            only: tuple[str, ...] | None = None) -> None:
    """Adds one flag per field of ``cls`` (or of the fields in ``only``) to ``parser``."""
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__, (cls.__doc__ or "").strip())
    for f in dataclasses.fields(cls):
        if only is not None and f.name not in only:
            continue
        kind, default = hints[f.name], f.default
        help_text = docs.get(f.name, "")
        if kind is bool:  # --download and --no-download, whichever the default
            group.add_argument(flag_name(f.name), dest=f.name, default=default,
                               action=argparse.BooleanOptionalAction,
                               help=f"{help_text} (default: {'on' if default else 'off'})")
        elif typing.get_origin(kind) is Literal:
            group.add_argument(flag_name(f.name), dest=f.name, default=default,
                               choices=typing.get_args(kind),
                               help=f"{help_text} (default: {default})")
        else:
            group.add_argument(flag_name(f.name), dest=f.name, default=default,
                               type=kind, metavar=f.name.upper(),
                               help=f"{help_text} (default: {default!r})")


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    for f in dataclasses.fields(TrainConfig):
        add_dataclass_arguments(parser, f.default_factory)


def train_config_from_args(args: argparse.Namespace) -> TrainConfig:
    sections = {}
    for f in dataclasses.fields(TrainConfig):
        cls = f.default_factory
        sections[f.name] = cls(**{g.name: getattr(args, g.name) for g in dataclasses.fields(cls)})
    return TrainConfig(**sections)
