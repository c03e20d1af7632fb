"""Who computes which micro-batch: even shares, or shares in proportion to the ranks' speed.

A step's global batch is cut into micro-batches (data/order.py) that the ranks share. By default
the shares are even and interleaved (:func:`~elastic_mnist.data.order.share`: rank r computes
every W-th micro-batch from the r-th). Under ``--balance`` a rank that pace.py's detector names
a straggler is given fewer, and its peers more, in proportion to each rank's measured speed.
Either way every micro-batch of a step is computed once, by one rank, and scaled by the global
batch's size: the global batch, the learning-rate schedule, the data cursor and exactly-once do
not depend on the shares, and the update is the same up to the order of its sums.

The rule, the same on every rank (it reads only the detector's state, which every rank builds
from the same summed times, and the shares it set itself):

- even whenever nobody is named, and in every new world (a start, a resume, a change of
  membership: its ranks are other processes, as the detector's judgement starts afresh), so a run
  without a slow rank is bitwise what it is without ``--balance``;
- when the detector names a straggler (or names another, or one recovers while another stays
  named), at once in proportion to the ranks' speeds: the micro-batches a rank computes per
  second of its pace (largest remainders; at least one each where the step has one for every
  rank, since a rank without any still runs a pass that counts for nothing, at the same cost);
- between those, anew only when the shares by speed would shorten the step (its slowest share's
  time, at the paces judged) by :data:`GAIN` or more against the ones in force, for :data:`HOLD`
  steps in a row (hysteresis: a pace's jitter, a few per cent over the detector's window, moves
  the proportional shares of a large step by a micro-batch or two every few steps, but does not
  win so much for so long).

Each rank's compute time is judged per micro-batch it computed, scaled to the step's average
share (:meth:`EvenShares.at_equal_shares`), so a rank given fewer micro-batches is not taken for a
fast one again, nor one that holds one more than its peers for a slow one. A change is said in a
log line and a ``shares`` record of events.jsonl (rank 0).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from elastic_mnist.data.order import Shares, share
from elastic_mnist.pace import WINDOW

if TYPE_CHECKING:
    from elastic_mnist.config import TrainConfig
    from elastic_mnist.env import DistEnv
    from elastic_mnist.pace import StragglerDetector
    from elastic_mnist.step_result import StepResult
    from elastic_mnist.writers import Writers

log = logging.getLogger(__name__)

HOLD = WINDOW
"""Steps in a row the shares by speed must win GAIN before they replace the ones in force: a
whole window of the detector's times, renewed, says so."""
GAIN = 0.15
"""The least share of the step's time that new shares must win over the ones in force, above the
jitter of the paces they are judged at: log-normal jitter of 30 % a step, with 2-4x stalls on
5 % of the steps, leaves about 8 % in a window's interquartile mean, and the slowest share takes
the largest of the ranks' (on such times of 6 ranks, one of them 2x slow, shares held to 10 %
for 8 steps changed every 20 steps or so; held to this for HOLD, every 50 or more: the test
holds the rule to them)."""


def even(n: int, world_size: int) -> list[int]:
    """The even shares of ``n`` micro-batches: the first ``n % world_size`` ranks one more."""
    return [n // world_size + (r < n % world_size) for r in range(world_size)]


def apportion(n: int, weights: Sequence[float]) -> list[int]:
    """``n`` micro-batches in proportion to ``weights`` (largest remainders, ties to the lower
    rank); at least one each where ``n`` has one for every rank, taken from the largest."""
    total = sum(weights)
    exact = [n * w / total for w in weights]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda r: (counts[r] - exact[r], r))
    for r in by_remainder[:n - sum(counts)]:
        counts[r] += 1
    while n >= len(counts) and 0 in counts:
        largest = max(range(len(counts)), key=lambda r: (counts[r], -r))
        counts[largest] -= 1
        counts[counts.index(0)] += 1
    return counts


def proportional(n: int, paces: Sequence[float]) -> list[float]:
    """The shares of ``n`` micro-batches in proportion to speed (one over each rank's pace)."""
    speeds = [1.0 / p for p in paces]
    return [n * s / sum(speeds) for s in speeds]


def slowest(counts: Sequence[int], paces: Sequence[float]) -> float:
    """The time of a step shared by ``counts``, at ``paces``: its slowest rank's."""
    return max(c * p for c, p in zip(counts, paces))


def deal(micro_batches: list[torch.Tensor], counts: Sequence[int]) -> list[list[torch.Tensor]]:
    """Every rank's micro-batches: dealt round-robin, a rank skipped once it holds its count (so
    even counts deal what :func:`~elastic_mnist.data.order.share` gives)."""
    if sum(counts) != len(micro_batches):
        raise ValueError(f"shares {list(counts)} of {len(micro_batches)} micro-batches")
    hands: list[list[torch.Tensor]] = [[] for _ in counts]
    left = list(micro_batches)
    while left:
        for r, count in enumerate(counts):
            if left and len(hands[r]) < count:
                hands[r].append(left.pop(0))
    return hands


class EvenShares:
    """Even, interleaved shares (``--no-balance``): the micro-batches this rank computes, and
    its peers' times judged per micro-batch."""

    def __init__(self, cfg: TrainConfig):
        o = cfg.optim
        self.micro_batch_size = o.micro_batch_size
        self.per_step = Shares(o.global_batch_size, o.micro_batch_size, 1).per_step
        self.counts: list[int] | None = None
        """The shares of a full step's micro-batches in force; None: even."""

    def enter(self, env: DistEnv, writers: Writers) -> None:
        """A new world: even shares."""
        self.rank, self.world_size, self.writers = env.rank, env.world_size, writers
        self.level = logging.INFO if env.is_main else logging.DEBUG  # said once, by rank 0
        self.counts, self.named, self.drift = None, frozenset(), 0

    def counts_for(self, n: int) -> list[int]:
        """Every rank's share of a step of ``n`` micro-batches (an epoch's last step may have
        fewer than a full one: the shares in force, scaled)."""
        if self.counts is None or n < self.world_size:
            return even(n, self.world_size)
        return self.counts if n == self.per_step else apportion(n, self.counts)

    def mine(self, micro_batches: list[torch.Tensor]) -> list[torch.Tensor]:
        """The micro-batches of a step that this rank computes (none: it runs a pass that counts
        for nothing)."""
        if self.counts is None:
            return share(micro_batches, self.rank, self.world_size)
        return deal(micro_batches, self.counts_for(len(micro_batches)))[self.rank]

    def at_equal_shares(self, result: StepResult) -> StepResult:
        """``result`` with every rank's compute seconds scaled to the step's average share (per
        micro-batch computed, a pass worth nothing counted as one): what the detector judges.
        Unchanged where every rank computed the same number."""
        if len(result.compute_s) != self.world_size:
            return result
        n = math.ceil(result.samples / self.micro_batch_size)
        counts = self.counts_for(n)
        return dataclasses.replace(result, compute_s=[
            t * ((n / self.world_size) / max(1, c)) for t, c in zip(result.compute_s, counts)])

    def follow(self, step: int, detector: StragglerDetector) -> None:
        """Even shares follow nothing."""


class Balance(EvenShares):
    """``--balance``: shares in proportion to the ranks' speed while the detector names a
    straggler, even otherwise (the module's docstring has the rule)."""

    def follow(self, step: int, detector: StragglerDetector) -> None:
        """After a step the detector has judged: the shares of the steps that follow."""
        named = frozenset(detector.named)
        if not named or self.world_size > self.per_step:
            self.named = named
            self.adopt(step, None, "no straggler named")
            return
        paces = detector.factors()[1]
        if min(paces) <= 0:
            return
        wanted = proportional(self.per_step, paces)
        if named != self.named:
            self.named = named
            self.adopt(step, apportion(self.per_step, wanted),
                       "straggler(s) named: rank(s) " + ", ".join(map(str, sorted(named))))
            return
        better = apportion(self.per_step, wanted)
        wins = slowest(better, paces) <= (1 - GAIN) * slowest(self.counts_for(self.per_step), paces)
        self.drift = self.drift + 1 if wins else 0
        if self.drift >= HOLD:
            self.adopt(step, better, f"speeds changed: shares by speed {GAIN:.0%} faster or "
                       f"more for {HOLD} steps")

    def adopt(self, step: int, counts: list[int] | None, reason: str) -> None:
        """Puts ``counts`` in force from the next step (None, or even ones: even), said once."""
        self.drift = 0
        if counts == even(self.per_step, self.world_size):
            counts = None
        if counts == self.counts:
            return
        self.counts = counts
        shares = self.counts_for(self.per_step)
        log.log(self.level, "step %d: each step's %d micro-batches shared %s from step %d: %s",
                step, self.per_step, "evenly" if counts is None else "by speed", step + 1,
                ", ".join(map(str, shares)) + f" ({reason})")
        self.writers.events.emit("shares", step, from_step=step + 1, shares=shares,
                                 even=counts is None, reason=reason)


def step_shares(cfg: TrainConfig) -> EvenShares:
    """``--balance``'s shares, or even ones."""
    return Balance(cfg) if cfg.run.balance else EvenShares(cfg)
