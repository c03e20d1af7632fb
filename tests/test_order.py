import torch

from elastic_mnist.config import TrainConfig
from elastic_mnist.data.order import SampleOrder, Shares, epoch_permutation, share


def test_permutation_is_fixed_by_seed_and_epoch():
    assert torch.equal(epoch_permutation(0, 1, 100), epoch_permutation(0, 1, 100))
    assert not torch.equal(epoch_permutation(0, 1, 100), epoch_permutation(0, 2, 100))
    assert not torch.equal(epoch_permutation(0, 1, 100), epoch_permutation(1, 1, 100))
    assert sorted(epoch_permutation(5, 3, 100).tolist()) == list(range(100))


def test_an_epoch_uses_every_sample_once_at_any_world_size():
    order = SampleOrder(num_samples=1000, global_batch_size=96, micro_batch_size=32, seed=0)
    assert order.steps_per_epoch == 11
    for world_size in (1, 2, 3, 4, 7):
        seen = []
        for cursor in range(0, 1000, 96):
            micro = order.micro_batches(order.global_batch(0, cursor))
            for rank in range(world_size):
                seen += torch.cat(share(micro, rank, world_size) or [torch.empty(0,
                                  dtype=torch.long)]).tolist()
        assert sorted(seen) == list(range(1000)), world_size


def test_micro_batches_do_not_depend_on_the_world_size():
    order = SampleOrder(num_samples=200, global_batch_size=64, micro_batch_size=16, seed=1)
    micro = order.micro_batches(order.global_batch(2, 128))
    assert [len(m) for m in micro] == [16, 16, 16, 16]
    assert share(micro, 1, 3) == [micro[1]] and len(share(micro, 0, 3)) == 2
    last = order.micro_batches(order.global_batch(2, 192))
    assert [len(m) for m in last] == [8]


def test_the_default_flags_give_every_rank_of_the_cards_shape_an_equal_share():
    """No batch flags: 96 micro-batches of 8, the same at every world size, so that 4 nodes of 8
    ranks each run 3 and the 24 left after a node's loss each run 4, with no rank idle."""
    o = TrainConfig().optim
    order = SampleOrder(60_000, o.global_batch_size, o.micro_batch_size, o.seed)
    micro = order.micro_batches(order.global_batch(0, 0))
    assert [len(m) for m in micro] == [8] * 96
    for world_size, each in ((32, 3), (24, 4), (16, 6), (8, 12), (2, 48), (1, 96)):
        shares = [share(micro, rank, world_size) for rank in range(world_size)]
        assert {len(s) for s in shares} == {each}, world_size
        assert Shares(o.global_batch_size, o.micro_batch_size, world_size).idle_warning() is None
        assert sorted(torch.cat([torch.cat(s) for s in shares]).tolist()) == \
            sorted(torch.cat(micro).tolist())


def test_flags_that_leave_ranks_idle_are_said_with_the_numbers_and_the_flags_to_change():
    shares = Shares(128, 32, 32)
    assert shares.idle_warning() == (
        "only 4 of 32 ranks have work: --global-batch-size 128 in micro-batches of 32 is 4 per "
        "step, and the other 28 run a pass that counts for nothing; --micro-batch-size 4 or "
        "--global-batch-size 1024 gives every rank one (either changes the optimisation)")
    assert Shares(100, 30, 8).idle_warning().endswith(
        "--micro-batch-size 10 or --global-batch-size 240 gives every rank one (either changes "
        "the optimisation)")
    assert Shares(7, 7, 2).idle_warning().startswith("only 1 of 2 ranks have work")
    assert Shares(7, 7, 2).idle_warning().endswith("--global-batch-size 14 gives every rank one "
                                                   "(either changes the optimisation)")
    assert Shares(768, 8, 24).describe() == ("each step: 96 micro-batches of 8 "
                                             "(--global-batch-size 768), 4 per rank at world "
                                             "size 24")
    assert Shares(100, 8, 4).describe().endswith("3 or 4 per rank at world size 4")


def test_the_audit_names_the_steps_in_which_a_rank_had_no_sample(tmp_path, capsys):
    """make chaos32 runs the card's shape with the default flags and fails where a rank of a
    completed step ran a pass that counts for nothing (scripts/check_audit.py
    --every-rank-busy)."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from check_audit import main as check_audit

    audit = tmp_path / "audit"
    audit.mkdir()
    for rank, steps in ((0, ([0, 1], [2])), (1, ([3], []))):
        (audit / f"g0-r{rank}.jsonl").write_text("".join(
            json.dumps({"step": step, "epoch": 0, "rank": rank, "world_size": 2,
                        "indices": indices}) + "\n" for step, indices in enumerate(steps, 1)))
    assert check_audit([str(tmp_path), "--num-samples", "4"]) == 0
    assert check_audit([str(tmp_path), "--num-samples", "4", "--every-rank-busy"]) == 1
    assert "FAIL step 2: ranks [1] of 2 had no sample" in capsys.readouterr().out
