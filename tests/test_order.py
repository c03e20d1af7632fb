import torch

from elastic_mnist.data.order import SampleOrder, epoch_permutation, share


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
