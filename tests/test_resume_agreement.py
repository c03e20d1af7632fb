"""All ranks agree on one checkpoint, also when checkpoint folders are node-local."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elastic_mnist.checkpoint import write_checkpoint
from elastic_mnist.env import DistEnv
from elastic_mnist.job import find_resume_payload
from elastic_mnist.model import build_model, state_digest

pytestmark = pytest.mark.slow


def payload(step: int, seed: int) -> dict:
    return {"format": 1, "model": build_model(seed).state_dict(), "optimizer": {},
            "progress": {"step": step, "epoch": 0, "cursor": 0, "samples_seen": 0},
            "rng": {}, "config": {}, "data": {}, "world_size": 2, "run_id": "r"}


def agree(rank: int, world: int, store_file: str, cases: list[list[str]], out: str) -> None:
    """Each case's resume as rank ``rank`` finds it in its own folder ``case[rank]``, in one
    process group (one spawn for every case: each costs the ranks' start-up)."""
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        env = DistEnv(rank=rank, world_size=world, local_world_size=1, launched=True)
        results = []
        for dirs in cases:
            found = find_resume_payload(Path(dirs[rank]), env, torch.device("cpu"))
            results.append(None if found is None else (found[0]["progress"]["step"],
                                                       state_digest(found[0]["model"])))
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def run_ranks(tmp_path: Path, cases: list[list[Path]]) -> list[list]:
    """Every case's result, case by case, rank by rank."""
    out, world = tmp_path / "result", len(cases[0])
    mp.spawn(agree, args=(world, str(tmp_path / "store"),
                          [[str(d) for d in dirs] for dirs in cases], str(out)),
             nprocs=world, join=True)
    by_rank = [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(world)]
    return [list(results) for results in zip(*by_rank, strict=True)]


def test_the_rank_holding_the_newest_checkpoint_shares_it_and_none_anywhere_is_a_fresh_start(
        tmp_path):
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    write_checkpoint(node0, payload(5, seed=1), restart_generation=0, keep_last=3)
    write_checkpoint(node1, payload(5, seed=1), restart_generation=0, keep_last=3)
    write_checkpoint(node1, payload(9, seed=2), restart_generation=1, keep_last=3)
    shared, fresh = run_ranks(tmp_path, [[node0, node1], [tmp_path / "a", tmp_path / "b"]])
    expected = (9, state_digest(build_model(2).state_dict()))
    assert shared == [expected, expected]
    assert fresh == [None, None]
