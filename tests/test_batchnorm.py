"""Running statistics do not depend on how a global batch is shared among ranks."""

import torch

from elastic_mnist.batchnorm import GlobalBatchNormStats
from elastic_mnist.model import build_model


def step_stats(micro_batches, ranks):
    """Simulates ``ranks`` ranks sharing the micro-batches; returns the BN buffers after apply."""
    replicas = [build_model(0) for _ in range(ranks)]
    trackers = [GlobalBatchNormStats(m) for m in replicas]
    total = None
    for rank, (model, stats) in enumerate(zip(replicas, trackers)):
        stats.begin_step()
        for x in micro_batches[rank::ranks]:
            with stats.record():
                model(x)
        local = stats.local_sums(torch.device("cpu"))
        total = local if total is None else total + local
    for stats in trackers:
        stats.apply(total)
    return [{k: v for k, v in m.state_dict().items() if "running" in k or "tracked" in k}
            for m in replicas]


def test_running_stats_are_the_same_at_every_world_size():
    torch.manual_seed(0)
    micro = [torch.randn(8, 1, 28, 28) * 2 + 1 for _ in range(4)]
    reference = step_stats(micro, 1)[0]
    assert reference["layer1.1.num_batches_tracked"].item() == 1
    assert not torch.allclose(reference["layer1.1.running_mean"], torch.zeros(16))
    for ranks in (2, 3, 4):
        for buffers in step_stats(micro, ranks):
            for key, value in reference.items():
                torch.testing.assert_close(buffers[key], value, rtol=1e-6, atol=1e-7)


def test_passes_outside_record_change_nothing():
    model = build_model(0)
    stats = GlobalBatchNormStats(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stats.begin_step()
    model(torch.randn(4, 1, 28, 28))  # e.g. a rank without micro-batches joining the sync
    stats.apply(stats.local_sums(torch.device("cpu")))
    for key, value in model.state_dict().items():
        if "num_batches_tracked" not in key:
            assert torch.equal(value, before[key]), key
