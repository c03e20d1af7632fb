"""Who computes which micro-batch (balance.py): even shares as before, shares by speed under
--balance while a straggler is named, their hysteresis, what is said, and a balanced step's
update against the even one (two ranks in threads of one process, their sums by hand)."""

from __future__ import annotations

import random
import threading

import pytest
import torch
import torch.distributed as dist

from elastic_mnist.balance import (
    HOLD,
    Balance,
    EvenShares,
    apportion,
    deal,
    even,
    proportional,
    step_shares,
)
from elastic_mnist.config import TrainConfig
from elastic_mnist.data.datasets import load
from elastic_mnist.data.order import share
from elastic_mnist.env import DistEnv
from elastic_mnist.events import EventLog, read_events
from elastic_mnist.pace import StragglerDetector
from elastic_mnist.step_result import StepResult
from elastic_mnist.trainer import Trainer
from elastic_mnist.writers import Writers


def config(global_batch: int = 768, micro: int = 8, balance: bool = True) -> TrainConfig:
    cfg = TrainConfig()
    cfg.optim.global_batch_size, cfg.optim.micro_batch_size = global_batch, micro
    cfg.run.balance = balance
    return cfg


def entered(shares: EvenShares, rank: int, world_size: int, writers: Writers | None = None):
    shares.enter(DistEnv(rank=rank, world_size=world_size), writers or Writers())
    return shares


def numbered(n: int) -> list[torch.Tensor]:
    return [torch.tensor([i]) for i in range(n)]


def ids(micro_batches: list[torch.Tensor]) -> list[int]:
    return [int(m) for m in micro_batches]


def test_even_shares_deal_what_share_gives():
    for n in (1, 4, 5, 12, 96):
        for world_size in (1, 2, 3, 5, 7):
            micro = numbered(n)
            hands = deal(micro, even(n, world_size))
            for rank in range(world_size):
                expected = ids(share(micro, rank, world_size))
                assert ids(hands[rank]) == expected, (n, world_size, rank)
                for shares in (EvenShares(config()), Balance(config())):
                    assert ids(entered(shares, rank, world_size).mine(micro)) == expected


def test_shares_are_proportional_to_speed_and_sum_to_the_step():
    assert apportion(96, proportional(96, [2.0, 1.0, 1.0])) == [19, 39, 38]  # ties: lower rank
    assert apportion(96, proportional(96, [1.0, 1.0])) == [48, 48]
    assert apportion(4, proportional(4, [100.0, 1.0, 1.0])) == [1, 1, 2]  # one each at least
    assert apportion(2, [1.0, 5.0, 1.0]) == [0, 2, 0]  # fewer than the ranks: none for some
    rng = random.Random(0)
    for _ in range(500):
        world_size = rng.randint(1, 9)
        n = rng.randint(1, 100)
        counts = apportion(n, proportional(n, [rng.uniform(0.01, 1) for _ in range(world_size)]))
        assert sum(counts) == n and min(counts) >= (1 if n >= world_size else 0)
        dealt = deal(numbered(n), counts)
        assert [len(h) for h in dealt] == counts
        assert sorted(i for hand in dealt for i in ids(hand)) == list(range(n))  # once each


def test_an_epochs_short_last_step_keeps_the_shares_proportions():
    shares = entered(Balance(config()), 0, 3)
    shares.counts = [16, 40, 40]
    assert shares.counts_for(96) == [16, 40, 40]
    assert shares.counts_for(12) == [2, 5, 5] and sum(shares.counts_for(7)) == 7
    assert shares.counts_for(2) == [1, 1, 0]  # fewer than the ranks: even


def test_times_are_judged_per_micro_batch_at_the_average_share():
    shares = entered(EvenShares(config(global_batch=32, micro=8)), 0, 3)  # 4: shares 2, 1, 1
    step = StepResult(loss=0, accuracy=0, samples=32, stop_requested=False,
                      compute_s=[0.02, 0.01, 0.01])
    assert shares.at_equal_shares(step).compute_s == pytest.approx([0.04 / 3] * 3)
    even_step = entered(EvenShares(config()), 0, 3)  # 96: 32 each, times as they are
    times = [0.0123, 0.0456, 0.0789]
    same = StepResult(loss=0, accuracy=0, samples=768, stop_requested=False, compute_s=times)
    assert even_step.at_equal_shares(same).compute_s == times


def simulate(world_size: int, steps: range, slow: dict[int, float], balances: list[Balance],
             detectors: list[StragglerDetector], rng: random.Random, sigma: float = 0.15,
             stalls: float = 0.0):
    """Steps whose every rank's time is its micro-batches times its cost, with log-normal
    jitter and now and then (``stalls``) a stall of 2-4x; every rank's Balance and detector see
    the same summed times, as in the step's collective."""
    history = []
    for step in steps:
        counts = balances[0].counts_for(balances[0].per_step)
        times = [c * 0.0004 * slow.get(r, 1.0) * rng.lognormvariate(0, sigma)
                 * (rng.uniform(2, 4) if rng.random() < stalls else 1.0)
                 for r, c in enumerate(counts)]
        result = StepResult(loss=0, accuracy=0, samples=768, stop_requested=False,
                            compute_s=times)
        for balance, detector in zip(balances, detectors, strict=True):
            detector.observe(step, balance.at_equal_shares(result).compute_s)
            balance.follow(step, detector)
        assert len({tuple(b.counts_for(96)) for b in balances}) == 1  # identical on every rank
        if len(balances) == world_size:
            mine = sorted(i for b in balances for i in ids(b.mine(numbered(96))))
            assert mine == list(range(96))  # every micro-batch once, by one rank
        history.append(counts)
    return history


def test_a_named_straggler_gets_fewer_without_flapping_and_even_again_when_fast(tmp_path):
    events = EventLog(tmp_path / "events.jsonl")
    balances = [entered(Balance(config()), r, 3, Writers(events=events) if r == 0 else None)
                for r in range(3)]
    detectors = [StragglerDetector() for _ in range(3)]
    for d in detectors:
        d.reset(3)
    rng = random.Random(1)
    clean = simulate(3, range(1, 61), {}, balances, detectors, rng)
    assert all(c == [32, 32, 32] for c in clean)  # nobody named: even
    slowed = simulate(3, range(61, 261), {2: 2.0}, balances, detectors, rng)
    balanced = slowed[-1]
    assert balanced[2] in range(17, 22) and sum(balanced) == 96  # about 96 * 0.5 / 2.5
    fast = simulate(3, range(261, 361), {}, balances, detectors, rng)
    assert fast[-1] == [32, 32, 32]
    events.close()
    records = [r for r in read_events(tmp_path / "events.jsonl") if r["event"] == "shares"]
    assert len(records) <= 3, records  # named, maybe one change of speeds, even again
    first, last = records[0], records[-1]
    assert not first["even"] and first["from_step"] == first["step"] + 1
    assert sum(first["shares"]) == 96 and "rank(s) 2" in first["reason"]
    assert last["even"] and last["shares"] == [32, 32, 32]


def test_heavy_jitter_moves_the_shares_seldom(tmp_path):
    """Jitter of 30 %, stalls on 5 % of the steps, 6 ranks, one 2x slow for 350 steps: the
    shares change once every 40 steps at most (named and even again included)."""
    for seed in range(3):
        path = tmp_path / f"events-{seed}.jsonl"
        events = EventLog(path)
        balance = entered(Balance(config()), 0, 6, Writers(events=events))
        detector = StragglerDetector()
        detector.reset(6)
        rng = random.Random(seed)
        simulate(6, range(1, 101), {}, [balance], [detector], rng, sigma=0.3, stalls=0.05)
        simulate(6, range(101, 451), {1: 2.0}, [balance], [detector], rng, sigma=0.3,
                 stalls=0.05)
        simulate(6, range(451, 550), {}, [balance], [detector], rng, sigma=0.3, stalls=0.05)
        events.close()
        records = read_events(path)
        assert 2 <= len(records) <= 450 // 40, (seed, [r["step"] for r in records])
        assert records[-1]["even"], seed


class Detector:
    """A detector's face with paces set by hand."""

    def __init__(self, paces: list[float]):
        self.named, self.paces = {1: 1}, paces

    def factors(self):
        return [], self.paces, []


def test_shares_move_only_for_a_gain_held_for_hold_steps():
    balance = entered(Balance(config(global_batch=80, micro=8)), 0, 2)  # 10 micro-batches
    balance.follow(1, Detector([1.0, 1.5]))  # named: at once, 6 and 4
    assert balance.counts == [6, 4]
    for step in range(2, 100):  # wanted wavers from 5.6 to 6.5: 7 and 3 win under GAIN
        balance.follow(step, Detector([1.0, 1.86 if step % 2 else 1.27]))
        assert balance.counts == [6, 4]
    for step in range(100, 100 + HOLD - 1):  # 8 and 2 win a third, not yet held
        balance.follow(step, Detector([1.0, 3.0]))
        assert balance.counts == [6, 4]
    balance.follow(100 + HOLD, Detector([1.0, 3.0]))
    assert balance.counts == [8, 2]
    nobody = Detector([1.0, 3.0])
    nobody.named = {}
    balance.follow(200, nobody)
    assert balance.counts is None


def test_balance_is_off_by_default():
    assert type(step_shares(TrainConfig())) is EvenShares
    assert type(step_shares(config())) is Balance


# --- a balanced step's update is the even one's, up to the order of its sums -----------------


class Exchange:
    """An all-reduce of two ranks running in threads of one process: rank 0's tensor plus rank
    1's, in that order, for both."""

    def __init__(self):
        self.barrier, self.slots = threading.Barrier(2, timeout=30), [None, None]

    def all_reduce_for(self, rank: int):
        def all_reduce_(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            self.slots[rank] = tensor.clone()
            self.barrier.wait()
            total = self.slots[0] + self.slots[1]
            self.barrier.wait()
            return tensor.copy_(total)
        return all_reduce_


def two_ranks(cfg: TrainConfig, digits, counts: list[int] | None, steps: int):
    """Two trainers of one world of 2 in threads; ``counts``: the shares put in force."""
    trainers = [Trainer(cfg, DistEnv(rank=r, world_size=2), torch.device("cpu"), digits,
                        run_id="balance", restart_generation=0) for r in range(2)]
    exchange, losses, computed = Exchange(), [[], []], [0, 0]
    for rank, trainer in enumerate(trainers):
        trainer.comm.all_reduce_ = exchange.all_reduce_for(rank)
        trainer.balance.counts = counts

    def run(rank: int) -> None:
        trainer = trainers[rank]
        for _ in range(steps):
            batch = trainer.global_batch()
            computed[rank] += len(trainer.balance.mine(trainer.order.micro_batches(batch)))
            losses[rank].append(trainer.train_step(batch, stop_requested=False).loss)
            trainer.advance(len(batch))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert losses[0] == losses[1] and len(losses[0]) == steps
    return losses[0], trainers[0].model.state_dict(), computed


def test_a_balanced_step_updates_as_the_even_one_up_to_the_order_of_sums(tiny_digits,
                                                                          tmp_path):
    cfg = config(global_batch=64, micro=16)  # 4 micro-batches a step: 2 and 2, or 3 and 1
    cfg.optim.grad_sync = "allreduce"
    digits = load(tiny_digits, "synthetic")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)  # the wrap's broadcast of rank 0's parameters
    try:
        even_losses, even_state, even_computed = two_ranks(cfg, digits, None, 4)
        losses, state, computed = two_ranks(cfg, digits, [3, 1], 4)
    finally:
        dist.destroy_process_group()
    assert even_computed == [8, 8] and computed == [12, 4]
    assert losses == pytest.approx(even_losses, rel=1e-5)
    for key, tensor in even_state.items():
        assert torch.allclose(state[key].double(), tensor.double(), rtol=1e-4, atol=1e-6), key
