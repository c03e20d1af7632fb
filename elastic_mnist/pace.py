"""Who sets the pace: every rank's own compute time of each step, and the rank that holds the
others back.

In synchronous data parallelism every step waits for the slowest rank. Each rank's own compute
time of a step (its forward and backward passes, up to where it would wait for its peers: the
engine's :meth:`~elastic_mnist.engine.Engine.own_work_done`) travels in the step's one collective,
in W slots of its own (:class:`PaceSlots`: rank r writes its seconds at slot r, zeros elsewhere,
so the sum gives every rank every peer's time with no extra round trip).

:class:`StragglerDetector` judges those times, the same on every rank (every rank sums the same
values), robustly to a busy machine's jitter: each rank's pace is the mean of the middle half of
its last :data:`WINDOW` times (a quarter of the slowest and of the fastest dropped: a stall of
a few steps counts for nothing, a slowdown of every other step counts at its mean), against the
median of its peers' paces. A rank whose factor stays at :data:`SLOW` or
above for :data:`PERSIST` steps in a row is named a straggler; a named one whose factor stays
under :data:`FAST` as long is recovered. The first :data:`WARM_UP` steps of a world are not
judged (compilation, DDP's buckets, cold caches), and a new world (another world size, another
generation) starts afresh: its ranks are other processes.

:class:`Pace` is the loop's face to this room: the slots before the collective, the times after
it, and what is said (a log line, ``straggler`` and ``straggler_recovered`` records in
events.jsonl through the generation's writers, which do nothing on other ranks than 0). The
TensorBoard scalars of the step times are computed here (:func:`pace_scalars`) and written with
the other scalars by report.py.
"""

from __future__ import annotations

import logging
import platform
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from elastic_mnist.env import DistEnv
    from elastic_mnist.resilience.faces import NullMembership
    from elastic_mnist.step_result import StepResult
    from elastic_mnist.writers import Writers

log = logging.getLogger(__name__)

WINDOW = 16
"""Steps of each rank's own times whose middle half's mean is its pace: a rank slowed 2x reaches
SLOW after 8 of them."""
SLOW = 1.5
"""A rank whose pace is this many times its peers' median pace is slow."""
FAST = 1.2
"""A named rank whose factor is under this is fast again (hysteresis: between FAST and SLOW
nothing changes)."""
PERSIST = 8
"""Steps in a row a rank must stay slow to be named, or fast to be recovered: a rank slowed 2x
is named at its 15th slow step; a scheduler's squeeze of one rank of a busy 2-core machine
(measured: 3 steps in a row at 1.5x, 9 at 1.4x) is not."""
WARM_UP = 3
"""First steps of a world that are not judged: compilation, DDP's buckets, cold caches."""
MIN_EXCESS_S = 0.001
"""Seconds a slow rank's pace must exceed its peers' by, besides the factor: on steps of a
millisecond, a factor is the scheduler's noise."""


def pace_of(times: Sequence[float]) -> float:
    """The mean of the middle half of ``times`` (their interquartile mean)."""
    ordered = sorted(times)
    cut = len(ordered) // 4
    middle = ordered[cut:len(ordered) - cut]
    return sum(middle) / len(middle)


class PaceSlots:
    """This rank's own compute time in the step's one collective: W float64 slots, allocated once
    per world and written by kernels on the device (``fill_``), never copied from the host."""

    def __init__(self, rank: int, world_size: int, device: torch.device):
        self.rank = rank
        self.tensor = torch.zeros(world_size, dtype=torch.float64, device=device)

    def write(self, seconds: float) -> torch.Tensor:
        self.tensor.zero_()
        self.tensor[self.rank].fill_(seconds)
        return self.tensor


@dataclass
class Verdict:
    """A change of what the detector says of some ranks at a step: named (``recovered`` False)
    or fast again; ``factors``: each rank's pace over its peers' median pace then; ``since``:
    the first step of the run of steps that decided it."""

    step: int
    ranks: list[int]
    factors: list[float]
    since: int
    recovered: bool = False
    compute_s: list[float] = field(default_factory=list)
    """Each rank's pace: the mean of the middle half of its own compute seconds in the window."""
    peers_s: float = 0.0
    """The median of the other ranks' paces (of the first rank's peers)."""


class StragglerDetector:
    """Names ranks persistently slower than their peers from their per-step compute times."""

    def __init__(self) -> None:
        self.reset(0)

    def reset(self, world_size: int) -> None:
        """A new world: no times, no one named."""
        self.world_size = world_size
        self.seen = 0
        self.times: list[deque[float]] = [deque(maxlen=WINDOW) for _ in range(world_size)]
        self.slow_run = [0] * world_size
        self.fast_run = [0] * world_size
        self.named: dict[int, int] = {}
        """Named ranks, and the step at which each was named."""
        self.last: tuple[list[float], list[float], list[float]] | None = None
        """The last judged step's :meth:`factors` (none before the window is full)."""

    def factors(self) -> tuple[list[float], list[float], list[float]]:
        """(each rank's pace over its peers' median pace, its pace, its peers' median pace)."""
        paces = [pace_of(t) for t in self.times]
        peers = [statistics.median(paces[:r] + paces[r + 1:]) for r in range(len(paces))]
        return [m / p if p > 0 else 1.0 for m, p in zip(paces, peers)], paces, peers

    def observe(self, step: int, times: Sequence[float]) -> list[Verdict]:
        """Takes one step's times of every rank; returns the verdicts it changes (a new world
        size starts afresh)."""
        if len(times) != self.world_size:
            self.reset(len(times))
        self.seen += 1
        if self.seen <= WARM_UP or self.world_size < 2:
            return []
        for window, seconds in zip(self.times, times):
            window.append(seconds)
        if len(self.times[0]) < WINDOW:
            return []
        factors, paces, peers = self.last = self.factors()
        named, recovered = [], []
        for r, factor in enumerate(factors):
            slow = factor >= SLOW and paces[r] - peers[r] >= MIN_EXCESS_S
            self.slow_run[r] = self.slow_run[r] + 1 if slow else 0
            self.fast_run[r] = self.fast_run[r] + 1 if factor < FAST else 0
            if r not in self.named and self.slow_run[r] >= PERSIST:
                self.named[r] = step
                named.append(r)
            elif r in self.named and self.fast_run[r] >= PERSIST:
                del self.named[r]
                recovered.append(r)
        return [Verdict(step, ranks, [factors[r] for r in ranks], step - PERSIST + 1,
                        recovered=fast, compute_s=[paces[r] for r in ranks],
                        peers_s=peers[ranks[0]])
                for ranks, fast in ((named, False), (recovered, True)) if ranks]


def host_names(env: DistEnv, membership: NullMembership) -> Callable[[list[int]], list[str]]:
    """The hosts of ranks, as cheaply as they are known: the membership's identities of the
    generation where already read (rank 0 reads them ahead as each generation begins), else this
    host for every rank of a one-node world, else ``node N`` (ranks are numbered node by node)."""
    known = membership.known if membership.in_process else None  # type: ignore[attr-defined]

    def hosts(ranks: list[int]) -> list[str]:
        if known is not None and known.ready:
            return [known[r].host for r in ranks]
        if env.local_world_size >= env.world_size:
            return [platform.node()] * len(ranks)
        return [f"node {r // max(1, env.local_world_size)}" for r in ranks]
    return hosts


class Pace:
    """The loop's face to the pace of its ranks: the slots of the step's collective, the
    detector, and what is said when a rank is named or fast again."""

    def __init__(self, device: torch.device):
        self.device = device
        self.detector = StragglerDetector()

    def enter(self, env: DistEnv, writers: Writers, membership: NullMembership) -> None:
        """A world's slots, writers and hosts (at the start, after a change): judged afresh."""
        self.slots = PaceSlots(env.rank, env.world_size, self.device)
        self.writers, self.hosts = writers, host_names(env, membership)
        self.level = logging.WARNING if env.is_main else logging.DEBUG  # said once, by rank 0
        self.detector.reset(env.world_size)

    def write(self, compute_s: float) -> torch.Tensor:
        """The slots to sum in the step's collective, with this rank's own seconds."""
        return self.slots.write(compute_s)

    def observe(self, step: int, result: StepResult) -> None:
        """Judges a completed step's times; says each verdict it changes."""
        for verdict in self.detector.observe(step, result.compute_s):
            self.say(verdict)

    def say(self, v: Verdict) -> None:
        hosts = self.hosts(v.ranks)
        who = ", ".join(f"rank {r} ({h}) {f:.2f}x" for r, h, f in zip(v.ranks, hosts, v.factors))
        if v.recovered:
            log.log(self.level, "step %d: no longer slower than its peers: %s", v.step, who)
        else:
            log.log(self.level, "step %d: straggler: %s its peers' median compute time "
                    "(%.1f ms) over the last %d steps, since step %d", v.step, who,
                    1e3 * v.peers_s, WINDOW, v.since)
        self.writers.events.emit(
            "straggler_recovered" if v.recovered else "straggler", v.step, ranks=v.ranks,
            hosts=hosts, factor=round(max(v.factors), 3),
            factors=[round(f, 3) for f in v.factors], since=v.since,
            compute_s=[round(s, 6) for s in v.compute_s], median_s=round(v.peers_s, 6),
            window=WINDOW)


def pace_scalars(results: Sequence[StepResult]) -> dict[str, float]:
    """TensorBoard's ``pace/*`` scalars over a logging window's steps: the slowest rank's and the
    median rank's own compute seconds (means over the steps), and the share of the steps' time
    that the median rank spent waiting for the slowest. Nothing where no times travelled."""
    steps = [r for r in results if r.compute_s]
    if not steps:
        return {}
    slowest = [max(r.compute_s) for r in steps]
    median = [statistics.median(r.compute_s) for r in steps]
    elapsed = sum(r.seconds for r in steps)
    waited = sum(s - m for s, m in zip(slowest, median))
    return {"pace/slowest_compute_s": sum(slowest) / len(steps),
            "pace/median_compute_s": sum(median) / len(steps),
            "pace/wait_share": min(1.0, waited / elapsed) if elapsed > 0 else 0.0}
