"""The CUDA fast path: what of it can be checked on CPU here, and on a GPU where there is one.

On CPU: channels-last is on by default and the costlier options off, each option trains and keeps
its promises (channels-last trains like the default layout within rounding, pool-before-ReLU
changes no bit, the BatchNorm statistics read from the kernel are the batch's, a compiled model
records them too, DDP runs with one bucket); the choices made for a GPU are made as intended
(CUDA graphs only where no rank accumulates, TF32 set explicitly by --precision, a recompiling
step busy for the watchdog), and said in the launch summary.
On a GPU (tests marked ``cuda``, run by scripts/gpu_check.sh): the data stays there with no
host-to-device copy per step or evaluation batch, compiled steps give eager's gradients with and
without accumulation, fp32 is IEEE and tf32 is not, and bf16 + channels-last + torch.compile
train.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from elastic_mnist import engine as engine_module
from elastic_mnist import report as report_module
from elastic_mnist.batchnorm import GlobalBatchNormStats
from elastic_mnist.cli import build_parser
from elastic_mnist.config import TrainConfig, train_config_from_args
from elastic_mnist.data.datasets import Dataset, Digits, load
from elastic_mnist.env import DistEnv
from elastic_mnist.fast_path import (
    CUDA_GRAPHS,
    NO_CUDA_GRAPHS,
    choose_compilation,
    micro_batches_per_rank,
)
from elastic_mnist.job import launch_summary
from elastic_mnist.model import build_model
from elastic_mnist.report import evaluate
from elastic_mnist.resilience.watchdog import NullWatchdog
from elastic_mnist.trainer import Trainer
from elastic_mnist.writers import Writers

cuda = pytest.mark.cuda


def config(**run_flags) -> TrainConfig:
    cfg = TrainConfig()
    cfg.optim.global_batch_size, cfg.optim.micro_batch_size = 64, 32
    for name, value in run_flags.items():
        setattr(cfg.run, name, value)
    return cfg


def trained(digits, cfg: TrainConfig, steps: int, device: str = "cpu",
            env: DistEnv | None = None) -> Trainer:
    trainer = Trainer(cfg, env or DistEnv(), torch.device(device), load(digits, "synthetic"),
                      run_id="fast", restart_generation=0)
    for _ in range(steps):
        batch = trainer.global_batch()
        trainer.train_step(batch, stop_requested=False)
        trainer.advance(len(batch))
    return trainer


def test_channels_last_is_on_by_default_and_the_costly_options_are_off():
    cfg = train_config_from_args(build_parser().parse_args(["train"]))
    assert (cfg.run.precision, cfg.run.channels_last, cfg.run.compile) == ("fp32", True, False)
    cfg = train_config_from_args(build_parser().parse_args(
        ["train", "--precision", "bf16", "--channels-last", "--compile"]))
    assert (cfg.run.precision, cfg.run.channels_last, cfg.run.compile) == ("bf16", True, True)
    cfg = train_config_from_args(build_parser().parse_args(["train", "--no-channels-last"]))
    assert cfg.run.channels_last is False


def relu_then_pool(model: nn.Module) -> nn.Module:
    """The classic block order, conv-BN-ReLU-pool, with the same weights."""
    for block in (model.layer1, model.layer2):
        block[2], block[3] = block[3], block[2]
    assert isinstance(model.layer1[2], nn.ReLU)
    return model


def test_pooling_before_relu_changes_no_bit():
    torch.manual_seed(0)
    images = torch.randn(16, 1, 28, 28)
    images[:8, :, :14] = -0.4242  # flat background: ties inside the pooling windows
    labels = torch.randint(0, 10, (16,))
    results = []
    for model in (build_model(0), relu_then_pool(build_model(0))):
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        results.append([loss.detach(), *(p.grad for p in model.parameters())])
    for ours, classic in zip(*results):
        assert torch.equal(ours, classic)


def test_batchnorm_statistics_come_from_the_kernel():
    model = build_model(0)
    stats = GlobalBatchNormStats(model)
    images = torch.randn(8, 1, 28, 28) * 2 + 1
    seen = {}
    model.layer1[1].register_forward_pre_hook(lambda m, args: seen.update(x=args[0].detach()))
    stats.begin_step()
    with stats.record():
        model(images)
    sums = stats.local_sums(torch.device("cpu"))
    x = seen["x"]
    count = x.numel() // x.shape[1]
    torch.testing.assert_close(sums[:16] / count, x.mean((0, 2, 3)).double())
    torch.testing.assert_close(sums[16:32] / count, x.var((0, 2, 3), correction=1).double())
    assert sums[32] == count
    stats.apply(sums)
    layer = model.layer1[1]
    torch.testing.assert_close(layer.running_mean, 0.1 * x.mean((0, 2, 3)))
    torch.testing.assert_close(layer.running_var, 0.9 + 0.1 * x.var((0, 2, 3), correction=1))


def noise_like(dataset: Dataset) -> Dataset:
    """``dataset`` with uniform noise for images. A digit's flat background gives tied maxima in
    the pooling windows, which the two layouts' last-bit roundings break differently: the
    gradient then goes to another pixel, and a BatchNorm bias's summed gradient (a sum that
    nearly cancels) moves by percents."""
    generator = torch.Generator().manual_seed(0)

    def noise(split: Digits) -> Digits:
        return Digits(torch.randint(0, 256, split.images.shape, dtype=torch.uint8,
                                    generator=generator), split.labels)

    return dataclasses.replace(dataset, train=noise(dataset.train), test=noise(dataset.test))


def test_channels_last_trains_like_contiguous(tiny_digits):
    data = noise_like(load(tiny_digits, "synthetic"))
    runs = []
    for channels_last in (False, True):
        trainer = Trainer(config(channels_last=channels_last), DistEnv(), torch.device("cpu"),
                          data, run_id="fast", restart_generation=0)
        losses, first_grads = [], None
        for _ in range(3):
            batch = trainer.global_batch()
            losses.append(trainer.train_step(batch, stop_requested=False).loss)
            trainer.advance(len(batch))
            first_grads = first_grads or [p.grad.clone() for p in trainer.model.parameters()]
        runs.append((trainer, losses, first_grads))
    (_, plain_losses, plain_grads), (fast, fast_losses, fast_grads) = runs
    assert fast.model.layer2[0].weight.is_contiguous(memory_format=torch.channels_last)
    for ours, theirs in zip(fast_grads, plain_grads):  # the same weights, the same batch
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=3e-5 * theirs.abs().max().item())
    torch.testing.assert_close(fast_losses, plain_losses, rtol=1e-5, atol=0)


def test_bf16_autocast_trains_and_keeps_fp32_weights(tiny_digits):
    trainer = trained(tiny_digits, config(precision="bf16"), steps=4)
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    batch = trainer.global_batch()
    assert torch.isfinite(torch.tensor(trainer.train_step(batch, False).loss))


def test_compiled_model_records_batchnorm_statistics(tiny_digits, monkeypatch):
    """Dynamo traces the model; the statistics hook runs outside its graphs. (The eager backend
    keeps this fast on CPU; inductor and CUDA graphs are checked on a GPU.)"""
    compiled = functools.partial(torch.compile, backend="eager")
    monkeypatch.setattr(torch, "compile", lambda model, mode=None: compiled(model))
    torch._dynamo.reset()
    plain = trained(tiny_digits, config(), steps=3)
    fast = trained(tiny_digits, config(compile=True), steps=3)
    assert fast.engine.net is not fast.model
    for (key, ours), theirs in zip(fast.model.state_dict().items(),
                                   plain.model.state_dict().values()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, msg=key)


def test_ddp_at_world_size_one_uses_one_bucket(tiny_digits, tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        trainer = trained(tiny_digits, config(), steps=1, env=DistEnv(launched=True))
        assert trainer.engine.ddp is not None
        ddp = trainer.engine.ddp._get_ddp_logging_data()
    finally:
        dist.destroy_process_group()
    assert "," not in str(ddp["bucket_sizes"])  # one bucket
    assert ddp["gradient_as_bucket_view"] and not ddp["broadcast_buffers"]


def test_each_epoch_order_is_moved_once(tiny_digits):
    trainer = trained(tiny_digits, config(), steps=1)
    batch = trainer.global_batch()
    trainer.advance(len(batch))
    following = trainer.global_batch()
    assert batch.device == following.device == trainer.train_data.labels.device
    assert batch.untyped_storage().data_ptr() == following.untyped_storage().data_ptr()
    assert not torch.equal(batch, following)


@pytest.mark.parametrize("device, micro_batches, compile, mode", [
    ("cuda", 1, True, CUDA_GRAPHS),
    ("cuda", 2, True, NO_CUDA_GRAPHS),
    ("cuda", 4, True, NO_CUDA_GRAPHS),
    ("cpu", 1, True, NO_CUDA_GRAPHS),
    ("cpu", 4, True, NO_CUDA_GRAPHS),
    ("cuda", 1, False, None),
    ("cuda", 4, False, None),
])
def test_cuda_graphs_only_where_no_rank_accumulates(device, micro_batches, compile, mode):
    """A CUDA graph's replay overwrites the gradients an accumulation adds to."""
    chosen = choose_compilation(device, micro_batches, compile)
    assert chosen.mode == mode
    assert ("no CUDA graphs" in chosen.describe()) == (mode == NO_CUDA_GRAPHS)
    assert chosen.describe() == "off" or f"mode={mode!r}" in chosen.describe()


def test_micro_batches_per_rank_follow_the_world_size():
    assert [micro_batches_per_rank(128, 32, world) for world in (1, 2, 3, 4, 8)] == [4, 2, 2, 1, 1]
    assert micro_batches_per_rank(100, 30, 1) == 4  # the short last one counts
    assert micro_batches_per_rank(1000, 1000, 1) == 1


def test_the_trainer_compiles_as_chosen_for_its_launch(tiny_digits, monkeypatch):
    """The mode passed to torch.compile is the choice for this launch's world size, and the
    launch summary says it (global 64 in micro-batches of 32: 2 per rank alone, 1 at 2 ranks)."""
    modes = []
    monkeypatch.setattr(torch, "compile", lambda model, mode=None: modes.append(mode) or model)
    seen = []
    choose = engine_module.choose_compilation
    monkeypatch.setattr(engine_module, "choose_compilation",
                        lambda *args: seen.append(args) or choose(*args))
    monkeypatch.setattr(dist, "broadcast", lambda tensor, src: None)  # no group at world size 2
    data = load(tiny_digits, "synthetic")
    for env in (DistEnv(), DistEnv(rank=1, local_rank=1, world_size=2, local_world_size=2)):
        trainer = Trainer(config(compile=True), env, torch.device("cpu"), data, run_id="fast",
                          restart_generation=0)
    assert seen == [("cpu", 2, True), ("cpu", 1, True)]
    assert modes == [NO_CUDA_GRAPHS, NO_CUDA_GRAPHS]
    summary = launch_summary(trainer.cfg, trainer.env, trainer.device, data, trainer)
    assert f"compile: torch.compile mode={NO_CUDA_GRAPHS!r}" in summary
    plain = Trainer(config(), DistEnv(), torch.device("cpu"), data, run_id="fast",
                    restart_generation=0)
    assert plain.engine.compilation.mode is None and plain.engine.net is plain.model and len(modes) == 2
    assert "compile: off" in launch_summary(plain.cfg, plain.env, plain.device, data, plain)


@pytest.fixture
def tf32_switches():
    """torch's defaults are put back afterwards: convolutions in TF32, matmuls not."""
    yield torch.backends
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.matmul.allow_tf32 = False


@pytest.mark.parametrize("precision, tf32", [("fp32", False), ("tf32", True), ("bf16", False)])
def test_precision_sets_tf32_explicitly_and_the_launch_says_so(tiny_digits, tf32_switches,
                                                               precision, tf32):
    """fp32 is IEEE fp32, although torch runs convolutions in TF32 by default; tf32 asks for it;
    bf16's float32 leftovers are IEEE. Both switches are set from the opposite value."""
    backends = tf32_switches
    backends.cudnn.allow_tf32 = backends.cuda.matmul.allow_tf32 = not tf32
    data = load(tiny_digits, "synthetic")
    trainer = Trainer(config(precision=precision), DistEnv(), torch.device("cpu"), data,
                      run_id="fast", restart_generation=0)
    assert backends.cudnn.allow_tf32 is tf32 and backends.cuda.matmul.allow_tf32 is tf32
    # torch 2.9+'s per-operator view of the same switches agrees (and stays readable).
    assert (backends.cudnn.conv.fp32_precision == "tf32") is tf32
    assert backends.cuda.matmul.fp32_precision == ("tf32" if tf32 else "ieee")
    assert trainer.engine.float32_math.startswith(f"{precision} (")
    assert ("TF32 off" in trainer.engine.float32_math) is not tf32
    summary = launch_summary(trainer.cfg, trainer.env, trainer.device, data, trainer)
    assert f"precision: {trainer.engine.float32_math}" in summary


class RecordingWatchdog(NullWatchdog):
    """Notes which step each "busy" block belonged to."""

    def __init__(self) -> None:
        self.step, self.busy_at = 0, []

    def step_done(self, step: int, seconds: float) -> None:
        self.step = step

    @contextlib.contextmanager
    def busy(self, what: str):
        self.busy_at.append((self.step + 1, what))
        yield


@pytest.mark.parametrize("compile", [True, False])
def test_a_compiled_steps_new_micro_batch_size_is_busy_for_the_watchdog(tiny_digits, monkeypatch,
                                                                        compile):
    """640 digits in global batches of 96, micro-batches of 24: the epoch's last step (64
    digits) ends with a micro-batch of 16, which a compiled model recompiles for. (The model
    runs uncompiled here: what counts is that the Trainer knows it would be.)"""
    monkeypatch.setattr(torch, "compile", lambda model, mode=None: model)
    cfg = config(compile=compile)
    cfg.optim.global_batch_size, cfg.optim.micro_batch_size = 96, 24
    dog = RecordingWatchdog()
    trainer = Trainer(cfg, DistEnv(), torch.device("cpu"), load(tiny_digits, "synthetic"),
                      run_id="fast", restart_generation=0, writers=Writers(watchdog=dog))
    for _ in range(8):  # the whole first epoch (7 steps) and one more
        trainer.iteration(stop_requested=False)
    compiling = [step for step, what in dog.busy_at if what == "compiling"]
    assert compiling == ([1, 7] if compile else [])
    assert trainer.engine.compiled_sizes == ({24, 16} if compile else set())


def test_the_evaluation_reads_the_test_split_kept_on_the_device(tiny_digits, monkeypatch):
    trainer = trained(tiny_digits, config(), steps=1)
    assert trainer.test_data.images.device == trainer.device
    assert torch.equal(trainer.test_data.images, trainer.dataset.test.images)
    evaluated = []
    monkeypatch.setattr(report_module, "evaluate",
                        lambda model, digits, *args, **kwargs: evaluated.append(digits) or (1, 0))
    trainer.report.evaluation()
    assert evaluated == [trainer.test_data]


# --- on a GPU ----------------------------------------------------------------------------------


@cuda
def test_steps_copy_nothing_from_the_host(tiny_digits):
    """The data and each epoch's order live on the GPU: a step's only copy is the one reading
    back its scalars."""
    from torch.profiler import ProfilerActivity, profile

    trainer = trained(tiny_digits, config(), steps=2, device="cuda")
    assert trainer.train_data.images.is_cuda and trainer.train_data.images.dtype == torch.uint8
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            batch = trainer.global_batch()
            trainer.train_step(batch, stop_requested=False)
            trainer.advance(len(batch))
        torch.cuda.synchronize()
    copies = [e.name for e in prof.events() if e.name.startswith("Memcpy")]
    assert not [name for name in copies if "HtoD" in name], copies
    assert len([name for name in copies if "DtoH" in name]) <= 3, copies


@cuda
def test_bf16_channels_last_compiled_trains_on_the_gpu(tiny_digits):
    torch._dynamo.reset()
    cfg = config(precision="bf16", channels_last=True, compile=True)
    cfg.optim.micro_batch_size, cfg.optim.warmup_steps = 64, 1
    trainer = trained(tiny_digits, cfg, steps=1, device="cuda")
    losses = []
    for _ in range(8):
        batch = trainer.global_batch()
        losses.append(trainer.train_step(batch, stop_requested=False).loss)
        trainer.advance(len(batch))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) < sum(losses[:3])
    bn = trainer.model.layer1[1]
    assert bn.num_batches_tracked.item() == 9
    assert torch.isfinite(bn.running_var).all() and (bn.running_var != 1).all()
    assert trainer.optimizer.defaults["fused"]


@cuda
@pytest.mark.parametrize("micro_batch_size", [64, 16])
def test_compiled_steps_give_eager_gradients(tiny_digits, tf32_switches, micro_batch_size):
    """One micro-batch per step (CUDA graphs) and four accumulated (without them): the compiled
    model's gradients and losses are eager's, to rounding, step after step."""
    runs = []
    for compile in (False, True):
        torch._dynamo.reset()
        cfg = config(compile=compile)
        cfg.optim.micro_batch_size = micro_batch_size
        trainer = Trainer(cfg, DistEnv(), torch.device("cuda"), load(tiny_digits, "synthetic"),
                          run_id="fast", restart_generation=0)
        grads, losses = [], []
        for _ in range(3):
            batch = trainer.global_batch()
            losses.append(trainer.train_step(batch, stop_requested=False).loss)
            trainer.advance(len(batch))
            grads.append([p.grad.detach().clone() for p in trainer.model.parameters()])
        runs.append((trainer, grads, losses))
    (_, eager_grads, eager_losses), (compiled, compiled_grads, compiled_losses) = runs
    graphs = compiled.engine.compilation.mode == CUDA_GRAPHS
    assert graphs == (micro_batch_size == 64)
    for step, (ours, theirs) in enumerate(zip(compiled_grads, eager_grads), 1):
        for got, want in zip(ours, theirs):
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4 * want.abs().max().item(),
                                       msg=f"step {step}, CUDA graphs {graphs}")
    torch.testing.assert_close(compiled_losses, eager_losses, rtol=1e-4, atol=0)


@cuda
def test_evaluation_copies_nothing_from_the_host(tiny_digits):
    from torch.profiler import ProfilerActivity, profile

    trainer = trained(tiny_digits, config(), steps=1, device="cuda")
    assert trainer.test_data.images.is_cuda and trainer.test_data.images.dtype == torch.uint8
    evaluate(trainer.model, trainer.test_data, trainer.device, trainer.env, batch_size=64)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        evaluate(trainer.model, trainer.test_data, trainer.device, trainer.env, batch_size=64)
        torch.cuda.synchronize()
    copies = [e.name for e in prof.events() if e.name.startswith("Memcpy")]
    assert not [name for name in copies if "HtoD" in name], copies


@cuda
def test_fp32_is_ieee_and_tf32_is_tf32_on_the_gpu(tiny_digits, tf32_switches):
    """A convolution and a matmul against float64: IEEE fp32's error is ~1e-7 of the largest
    output, TF32's (10 mantissa bits, on Ampere and newer) ~1e-3."""
    generator = torch.Generator().manual_seed(0)
    x, w = (torch.randn(shape, generator=generator) for shape in ((64, 16, 14, 14),
                                                                  (32, 16, 5, 5)))
    a, b = (torch.randn(shape, generator=generator) for shape in ((256, 1568), (1568, 10)))
    exact_conv = F.conv2d(x.double(), w.double(), padding=2)
    exact_mm = a.double() @ b.double()

    def errors(precision: str) -> tuple[float, float]:
        Trainer(config(precision=precision), DistEnv(), torch.device("cuda"),
                load(tiny_digits, "synthetic"), run_id="fast", restart_generation=0)
        conv = F.conv2d(x.cuda(), w.cuda(), padding=2).double().cpu()
        mm = (a.cuda() @ b.cuda()).double().cpu()
        return ((conv - exact_conv).abs().max().item() / exact_conv.abs().max().item(),
                (mm - exact_mm).abs().max().item() / exact_mm.abs().max().item())

    assert max(errors("fp32")) < 5e-5
    if torch.cuda.get_device_capability() >= (8, 0):
        assert min(errors("tf32")) > 1e-4
