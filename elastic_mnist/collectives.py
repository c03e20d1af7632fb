"""Runs and checks the primitives of PyTorch's "Writing Distributed Applications" tutorial.

Launch with::

    torchrun --standalone --nproc_per_node=3 -m elastic_mnist.collectives

Every rank runs each demo, compares what it holds with the value expected from its rank and
the world size, and logs it. Exit status: 0 when every check passed on every rank, 1 when any
failed (the log names the primitive), 2 when not launched by torchrun with >= 2 processes.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from elastic_mnist.env import DistEnv
from elastic_mnist.errors import EnvError

log = logging.getLogger(__name__)

PROG = "elastic_mnist.collectives"
LAUNCH_HINT = f"torchrun --standalone --nproc_per_node=3 -m {PROG}"

EXCHANGE_VALUE = 10.0
"""What rank 0 sends to ranks 1 and 2 in the exchange demo."""

Result = tuple[str, bool]
Demo = Callable[[DistEnv, frozenset[str]], Result]


def _check(name: str, held: torch.Tensor, expected: torch.Tensor) -> bool:
    """Logs what this rank holds after ``name`` and whether it is the expected value."""
    ok = torch.equal(held, expected)
    verdict = "ok" if ok else "FAILED"
    log.info("%s: holds %s (expected %s) %s", name, held.tolist(), expected.tolist(), verdict)
    return ok


def _inject(faults: frozenset[str], name: str, env: DistEnv, on_rank: int,
            tensor: torch.Tensor) -> None:
    """Test hook: spoils ``tensor`` on ``on_rank`` when ``name`` is in ``faults``."""
    if name in faults and env.rank == on_rank:
        log.warning("%s: injecting a fault (adding 100 to the result)", name)
        tensor += 100


def demo_send_recv(env: DistEnv, faults: frozenset[str]) -> Result:
    """Blocking point-to-point: rank 0 sends 1.0 to rank 1."""
    name = "send_recv"
    tensor = torch.zeros(1)
    if env.rank == 0:
        tensor += 1
        dist.send(tensor, dst=1)
    elif env.rank == 1:
        dist.recv(tensor, src=0)
    _inject(faults, name, env, 1, tensor)
    expected = torch.ones(1) if env.rank in (0, 1) else torch.zeros(1)
    return name, _check(name, tensor, expected)


def demo_isend_irecv(env: DistEnv, faults: frozenset[str]) -> Result:
    """Non-blocking point-to-point: rank 0 sends 2.0 to the last rank, then waits."""
    name = "isend_irecv"
    last = env.world_size - 1
    tensor = torch.zeros(1)
    if env.rank == 0:
        tensor += 2
        dist.isend(tensor, dst=last).wait()
    elif env.rank == last:
        dist.irecv(tensor, src=0).wait()
    _inject(faults, name, env, last, tensor)
    expected = torch.full((1,), 2.0) if env.rank in (0, last) else torch.zeros(1)
    return name, _check(name, tensor, expected)


def demo_exchange(env: DistEnv, faults: frozenset[str]) -> Result:
    """Rank 0 sends a value to ranks 1 and 2; each sends back value - 1; rank 0 sums them."""
    name = "exchange"
    if env.rank == 0:
        dist.send(torch.tensor([EXCHANGE_VALUE]), dst=1)
        dist.send(torch.tensor([EXCHANGE_VALUE]), dst=2)
        total = torch.zeros(1)
        for peer in (1, 2):
            reply = torch.zeros(1)
            dist.recv(reply, src=peer)
            total += reply
        _inject(faults, name, env, 0, total)
        return name, _check(name, total, torch.tensor([2 * (EXCHANGE_VALUE - 1)]))
    if env.rank in (1, 2):
        tensor = torch.zeros(1)
        dist.recv(tensor, src=0)
        tensor -= 1
        dist.send(tensor, dst=0)
        return name, _check(name, tensor, torch.tensor([EXCHANGE_VALUE - 1]))
    log.info("%s: not taking part (only ranks 0, 1 and 2 do)", name)
    return name, True


def demo_gather(env: DistEnv, faults: frozenset[str]) -> Result:
    """Every rank contributes rank + 1; rank 0 gathers them all."""
    name = "gather"
    tensor = torch.tensor([env.rank + 1.0])
    if env.rank == 0:
        gathered = [torch.zeros(1) for _ in range(env.world_size)]
        dist.gather(tensor, gather_list=gathered, dst=0)
        held = torch.cat(gathered)
        _inject(faults, name, env, 0, held)
        return name, _check(name, held, torch.arange(1.0, env.world_size + 1))
    dist.gather(tensor, dst=0)
    log.info("%s: sent %s to rank 0", name, tensor.tolist())
    return name, True


def demo_reduce(env: DistEnv, faults: frozenset[str]) -> Result:
    """Every rank contributes rank + 1; rank 0 receives the sum."""
    name = "reduce"
    contribution = env.rank + 1.0
    tensor = torch.tensor([contribution])
    dist.reduce(tensor, dst=0, op=dist.ReduceOp.SUM)
    if env.rank == 0:
        _inject(faults, name, env, 0, tensor)
        expected = env.world_size * (env.world_size + 1) / 2
        return name, _check(name, tensor, torch.tensor([expected]))
    # Off rank 0 the tensor's content after reduce is unspecified; nothing to check.
    log.info("%s: sent [%s] to rank 0", name, contribution)
    return name, True


def demo_all_reduce(env: DistEnv, faults: frozenset[str]) -> Result:
    """Every rank contributes rank + 1; every rank receives the sum."""
    name = "all_reduce"
    tensor = torch.tensor([env.rank + 1.0])
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    _inject(faults, name, env, env.world_size - 1, tensor)
    expected = env.world_size * (env.world_size + 1) / 2
    return name, _check(name, tensor, torch.tensor([expected]))


DEMOS: dict[str, Demo] = {
    "send_recv": demo_send_recv,
    "isend_irecv": demo_isend_irecv,
    "exchange": demo_exchange,
    "gather": demo_gather,
    "reduce": demo_reduce,
    "all_reduce": demo_all_reduce,
}
"""The demos in the order they run, by the name each reports."""


def run_demos(env: DistEnv, faults: frozenset[str]) -> list[Result]:
    """Runs every demo the world size allows, in order; same list on every rank."""
    results = []
    for name, demo in DEMOS.items():
        if name == "exchange" and env.world_size < 3:
            log.info("exchange: skipped (needs >= 3 ranks, world size is %d)", env.world_size)
            continue
        results.append(demo(env, faults))
    return results


def agree(results: list[Result]) -> list[tuple[str, int]]:
    """Counts, for each demo, on how many ranks it failed (an all-reduce of failure flags)."""
    failures = torch.tensor([0 if ok else 1 for _, ok in results], dtype=torch.int64)
    dist.all_reduce(failures, op=dist.ReduceOp.SUM)
    return [(name, int(n)) for (name, _), n in zip(results, failures.tolist())]


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m {PROG}",
        description=f"Runs and checks point-to-point and collective primitives. "
                    f"Launch with: {LAUNCH_HINT}",
    )
    # Hidden test hook: spoil one primitive's result to prove failures are caught.
    parser.add_argument("--inject-fault", action="append", default=[], choices=list(DEMOS),
                        metavar="NAME", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


@record
def main(argv: Sequence[str] | None = None) -> int:
    """Sets up the gloo process group, runs the demos, tears the group down."""
    args = _parse_args(argv)
    try:
        env = DistEnv.from_environ()
    except EnvError as exc:
        print(f"{PROG}: bad torchrun environment: {exc}", file=sys.stderr)
        return 2
    if not env.launched or env.world_size < 2:
        print(f"{PROG}: needs at least 2 processes; launch with {LAUNCH_HINT}", file=sys.stderr)
        return 2

    logging.basicConfig(level=logging.INFO, stream=sys.stdout, force=True,
                        format=f"[rank {env.rank}] %(message)s")
    faults = frozenset(args.inject_fault)

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        log.info("joined: %s", env.describe())
        counts = agree(run_demos(env, faults))
    finally:
        dist.destroy_process_group()

    failed = [(name, n) for name, n in counts if n]
    for name, n in failed:
        log.error("CHECK FAILED: %s gave a wrong result on %d of %d ranks",
                  name, n, env.world_size)
    if failed:
        return 1
    log.info("all %d checks passed on all %d ranks", len(counts), env.world_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
