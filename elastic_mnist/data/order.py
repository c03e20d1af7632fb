"""Which samples each step uses: a global order per epoch and a cursor into it.

An epoch's order is a permutation fixed by (seed, epoch). A step takes the next global batch of it
and cuts that into fixed-size micro-batches, which the ranks share round-robin. Since the cursor
counts samples of the *global* order, a job restarted at any world size carries on where it
stopped: every sample is used exactly once per epoch, none dropped, none repeated.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

CPU = torch.device("cpu")


def epoch_permutation(seed: int, epoch: int, n: int) -> torch.Tensor:
    """The global sample order of one epoch (int64 [n]), the same on every rank and machine."""
    mixed = int(np.random.SeedSequence([seed, epoch]).generate_state(1, np.uint64)[0] >> 1)
    return torch.randperm(n, generator=torch.Generator().manual_seed(mixed))


@functools.lru_cache(maxsize=2)
def _cached_permutation(seed: int, epoch: int, n: int, device: torch.device) -> torch.Tensor:
    """One epoch's order, moved to ``device`` once: no step copies indices from the host."""
    return epoch_permutation(seed, epoch, n).to(device)


@dataclass(frozen=True)
class SampleOrder:
    """Global batches of a dataset of ``num_samples``, cut into micro-batches."""

    num_samples: int
    global_batch_size: int
    micro_batch_size: int
    seed: int

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.num_samples / self.global_batch_size)

    def permutation(self, epoch: int, device: torch.device = CPU) -> torch.Tensor:
        return _cached_permutation(self.seed, epoch, self.num_samples, device)

    def global_batch(self, epoch: int, cursor: int, device: torch.device = CPU) -> torch.Tensor:
        """Sample indices of the step that starts at ``cursor`` samples into ``epoch``, on
        ``device``."""
        if not 0 <= cursor < self.num_samples:
            raise ValueError(f"cursor {cursor} outside an epoch of {self.num_samples} samples")
        return self.permutation(epoch, device)[cursor:cursor + self.global_batch_size]

    def micro_batches(self, batch: torch.Tensor) -> list[torch.Tensor]:
        """A global batch cut into micro-batches; only the last may be shorter."""
        return list(torch.split(batch, self.micro_batch_size))


def epoch_number(step: int, epoch: int, cursor: int) -> int:
    """The epoch of ``step``, counted from 1, as everything said about progress counts it (logs,
    the progress bar, events.jsonl, TensorBoard): a step belongs to the epoch whose samples it
    used. ``epoch`` and ``cursor`` are where the data stands after that step: the 0-based index of
    the epoch the next step trains in (as the sample order and checkpoints count), and how many
    of its samples are used. Before any step: the first epoch."""
    return epoch + (cursor > 0) if step else 1


def share(micro_batches: list[torch.Tensor], rank: int, world_size: int) -> list[torch.Tensor]:
    """The micro-batches that ``rank`` computes: every ``world_size``-th, starting at ``rank``."""
    return micro_batches[rank::world_size]


@dataclass(frozen=True)
class Shares:
    """How ``world_size`` ranks share a step's micro-batches: each runs ``least`` or ``most``."""

    global_batch_size: int
    micro_batch_size: int
    world_size: int

    @property
    def per_step(self) -> int:
        return math.ceil(self.global_batch_size / self.micro_batch_size)

    @property
    def least(self) -> int:
        return self.per_step // self.world_size

    @property
    def most(self) -> int:
        return math.ceil(self.per_step / self.world_size)

    def describe(self) -> str:
        """One line: the step's micro-batches and every rank's share of them."""
        each = (f"{self.most} per rank" if self.least == self.most
                else f"{self.least} or {self.most} per rank")
        return (f"each step: {self.per_step} micro-batches of {self.micro_batch_size} "
                f"(--global-batch-size {self.global_batch_size}), {each} at world size "
                f"{self.world_size}")

    def idle_warning(self) -> str | None:
        """One line where some ranks have no micro-batch, with the numbers and the flags that
        give every rank work; None where each has one."""
        if self.least > 0:
            return None
        g, m, w = self.global_batch_size, self.micro_batch_size, self.world_size
        fits = [d for d in range(1, g // w + 1) if g % d == 0]
        fix = (f"--micro-batch-size {fits[-1]} or " if fits else "") + \
            f"--global-batch-size {w * m}"
        return (f"only {self.per_step} of {w} ranks have work: --global-batch-size {g} in "
                f"micro-batches of {m} is {self.per_step} per step, and the other "
                f"{w - self.per_step} run a pass that counts for nothing; {fix} gives every "
                f"rank one (either changes the optimisation)")
