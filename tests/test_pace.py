"""Who sets the pace (pace.py): the straggler detector on synthetic per-rank times, what it says,
and the ranks' own compute times travelling in the step's one collective (in process, gloo)."""

from __future__ import annotations

import platform
import random

import pytest
import torch
import torch.distributed as dist

from elastic_mnist import pace as pace_module
from elastic_mnist.config import TrainConfig
from elastic_mnist.data.datasets import load
from elastic_mnist.env import DistEnv
from elastic_mnist.events import EventLog, read_events
from elastic_mnist.pace import PERSIST, WARM_UP, Pace, StragglerDetector, pace_scalars
from elastic_mnist.resilience.faces import NullMembership
from elastic_mnist.step_result import StepResult
from elastic_mnist.trainer import Trainer
from elastic_mnist.writers import Writers

STEP_S = 0.012
"""A step's own compute seconds here, on CPU (tiny batches): jitter is large beside it."""


def jittery(rng: random.Random, world_size: int, slow: dict[int, float] | None = None,
            sigma: float = 0.2, spike: float = 0.05) -> list[float]:
    """One step's times: every rank log-normal around STEP_S, and now and then (``spike``) a
    rank stalled 2-4x for that step, as a busy scheduler does; ``slow``: rank -> factor."""
    slow = slow or {}
    times = []
    for rank in range(world_size):
        t = STEP_S * rng.lognormvariate(0, sigma) * slow.get(rank, 1.0)
        if rng.random() < spike:
            t *= rng.uniform(2, 4)
        times.append(t)
    return times


def run(detector: StragglerDetector, steps: range, rng: random.Random, world_size: int,
        slow: dict[int, float] | None = None, **jitter) -> list:
    return [v for step in steps
            for v in detector.observe(step, jittery(rng, world_size, slow, **jitter))]


@pytest.mark.parametrize("world_size", [2, 6])
def test_a_rank_slowed_twice_is_named_within_20_steps(world_size):
    for seed in range(20):
        rng, detector = random.Random(seed), StragglerDetector()
        assert run(detector, range(1, 101), rng, world_size) == []
        verdicts = run(detector, range(101, 141), rng, world_size, slow={1: 2.0})
        assert verdicts, seed
        named = verdicts[0]
        assert not named.recovered and named.ranks == [1], (seed, named)
        assert named.step - 100 <= 20, (seed, named.step)
        assert 1.6 < named.factors[0] < 2.6 and 101 <= named.since <= named.step


def test_heavy_jitter_on_every_rank_names_no_one():
    """Log-normal jitter of 30 %, a stall of 2-4x on 8 % of each rank's steps, bursts of 3 slow
    steps in a row, and slow first steps (compilation): a run of 5000 steps names no one."""
    for world_size in (2, 3, 6):
        rng, detector = random.Random(world_size), StragglerDetector()
        for step in range(1, 5001):
            times = jittery(rng, world_size, sigma=0.3, spike=0.08)
            if step <= WARM_UP:
                times[rng.randrange(world_size)] *= 50  # compiling
            if step % 97 < 3:  # a squeeze of 3 steps on one rank
                times[(step // 97) % world_size] *= 2
            assert detector.observe(step, times) == [], (world_size, step)


def test_a_named_rank_fast_again_is_recovered_and_not_named_twice():
    rng, detector = random.Random(7), StragglerDetector()
    run(detector, range(1, 51), rng, 4)
    slow = run(detector, range(51, 151), rng, 4, slow={3: 3.0})
    assert [(v.ranks, v.recovered) for v in slow] == [([3], False)]  # named once, still slow
    fast = run(detector, range(151, 191), rng, 4)
    assert [(v.ranks, v.recovered) for v in fast] == [([3], True)]
    recovered = fast[0]
    assert recovered.step - 150 <= 30 and recovered.factors[0] < pace_module.FAST
    assert run(detector, range(191, 300), rng, 4) == []


def test_a_new_world_size_starts_afresh():
    rng, detector = random.Random(3), StragglerDetector()
    run(detector, range(1, 41), rng, 4, slow={2: 2.0})
    assert detector.named
    # One rank fewer (a shrink): the times of the old world are gone, no one is named, and
    # nothing is judged before a new window fills.
    assert detector.observe(41, jittery(rng, 3)) == []
    assert detector.world_size == 3 and not detector.named and not any(detector.times[0])
    assert run(detector, range(42, 42 + WARM_UP + pace_module.WINDOW - 2), rng, 3,
               slow={0: 5.0}) == []


def test_one_rank_is_judged_by_nobody():
    detector = StragglerDetector()
    assert [detector.observe(s, [s * 1.0]) for s in range(1, 60)] == [[]] * 59


def result(compute_s: list[float], seconds: float) -> StepResult:
    return StepResult(loss=0.0, accuracy=0.0, samples=1, stop_requested=False, seconds=seconds,
                      compute_s=compute_s)


def test_the_named_and_the_recovered_are_said_in_a_line_and_a_record(tmp_path, caplog):
    events = EventLog(tmp_path / "events.jsonl")
    pace = Pace(torch.device("cpu"))
    pace.enter(DistEnv(rank=0, world_size=3, local_world_size=3), Writers(events=events),
               NullMembership())
    steps = [[0.01, 0.01, 0.02]] * 40 + [[0.01, 0.01, 0.01]] * 40
    with caplog.at_level("WARNING", logger="elastic_mnist.pace"):
        for step, times in enumerate(steps, start=1):
            pace.observe(step, result(times, 0.03))
    events.close()
    named, recovered = read_events(tmp_path / "events.jsonl")
    assert named["event"] == "straggler" and recovered["event"] == "straggler_recovered"
    assert named["ranks"] == recovered["ranks"] == [2]
    assert named["hosts"] == [platform.node()] and named["factor"] == 2.0
    first = WARM_UP + pace_module.WINDOW  # the first step judged: a window full
    assert named["step"] == first + PERSIST - 1 and named["since"] == first
    assert named["compute_s"] == [0.02] and named["median_s"] == 0.01
    assert recovered["step"] > 40 and recovered["factor"] == 1.0
    lines = [r.getMessage() for r in caplog.records]
    assert any("straggler: rank 2" in line and "2.00x" in line for line in lines), lines
    assert any("no longer slower" in line for line in lines), lines


def test_hosts_come_from_the_membership_where_it_knows_them():
    class Known(dict):
        ready = True

    class Host:
        def __init__(self, host):
            self.host = host

    class InProcess(NullMembership):
        in_process = True
        known = Known({0: Host("a"), 1: Host("a"), 2: Host("b"), 3: Host("b")})

    env = DistEnv(rank=0, world_size=4, local_world_size=2)
    assert pace_module.host_names(env, InProcess())([2, 3]) == ["b", "b"]
    assert pace_module.host_names(env, NullMembership())([1, 3]) == ["node 0", "node 1"]


def test_the_scalars_are_the_slowest_the_median_and_the_wait_for_the_slowest():
    scalars = pace_scalars([result([0.01, 0.02, 0.04], 0.05), result([0.01, 0.01, 0.01], 0.02),
                            result([], 0.02)])  # a step without times counts for nothing
    assert scalars == pytest.approx({"pace/slowest_compute_s": 0.025,
                                     "pace/median_compute_s": 0.015,
                                     "pace/wait_share": 0.02 / 0.07})
    assert pace_scalars([result([], 0.1)]) == {}


# --- in process: the times travel in the step's collective ----------------------------------


def stepped(trainer: Trainer, steps: int) -> tuple[list[StepResult], list[torch.Tensor]]:
    """The results of ``steps`` steps, and what each summed in its collective."""
    summed, all_reduce = [], trainer.comm.all_reduce_

    def recording(tensor, *args, **kwargs):
        out = all_reduce(tensor, *args, **kwargs)
        summed.append(out.clone())
        return out

    trainer.comm.all_reduce_ = recording
    results = []
    for _ in range(steps):
        batch = trainer.global_batch()
        results.append(trainer.train_step(batch, stop_requested=False))
        trainer.advance(len(batch))
    return results, summed


@pytest.mark.parametrize("grad_sync", ["ddp", "allreduce"])
def test_own_compute_time_travels_in_the_steps_one_collective(tiny_digits, tmp_path, grad_sync):
    cfg = TrainConfig()
    cfg.optim.global_batch_size, cfg.optim.micro_batch_size = 64, 32
    cfg.optim.grad_sync = grad_sync
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        trainer = Trainer(cfg, DistEnv(launched=True), torch.device("cpu"),
                          load(tiny_digits, "synthetic"), run_id="pace", restart_generation=0)
        assert (trainer.engine.ddp is not None) == (grad_sync == "ddp")
        results, summed = stepped(trainer, 3)
    finally:
        dist.destroy_process_group()
    slot = 2 + trainer.flags.tensor.numel()  # after loss, accuracy and the flags: W slots
    for r, packed in zip(results, summed, strict=True):  # one collective per step
        assert len(r.compute_s) == 1 and 0 < r.compute_s[0] < r.seconds
        assert packed[slot].item() == r.compute_s[0]
