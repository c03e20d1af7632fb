"""Machines with any number of GPUs, or none: the device a worker takes, and checkpoints that move.

On CPU, with torch.cuda's answers faked where the logic needs a GPU: ``--device auto`` (or cuda)
with more workers on a node than GPUs is one line and exit 2 on every worker; a checkpoint resumes
whatever CUDA generator state it holds (one per GPU of an 8-GPU node, as older checkpoints did;
none, from a CPU run; the saving device's own) wherever it is loaded. On a GPU (marked ``cuda``,
run by scripts/gpu_check.sh): the generator state saved there comes back there.
"""

from __future__ import annotations

import logging
import pickle
import random
import time

import pytest
import torch

from elastic_mnist import distributed
from elastic_mnist import trainer as trainer_module
from elastic_mnist.checkpoint import deserialize, payload_bytes
from elastic_mnist.cli import main
from elastic_mnist.config import TrainConfig
from elastic_mnist.data.datasets import load
from elastic_mnist.distributed import resolve_device
from elastic_mnist.env import DistEnv
from elastic_mnist.errors import ConfigError, EnvError
from elastic_mnist.fast_path import adamw_kernels
from elastic_mnist.job import check_recovery
from elastic_mnist.model import build_model
from elastic_mnist.resilience.agreement import Change
from elastic_mnist.trainer import Trainer


def node(local_rank: int, local_world_size: int) -> DistEnv:
    return DistEnv(rank=local_rank, local_rank=local_rank, world_size=local_world_size,
                   local_world_size=local_world_size, launched=True)


@pytest.fixture
def gpus(monkeypatch):
    """Makes torch see ``count`` GPUs: ``gpus(1)``."""
    def see(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)

    return see


@pytest.mark.parametrize("choice", ["auto", "cuda"])
@pytest.mark.parametrize("local_rank", [0, 1])
def test_more_workers_than_gpus_is_said_by_every_worker(gpus, choice, local_rank):
    gpus(1)
    with pytest.raises(EnvError) as refused:
        resolve_device(choice, node(local_rank, 2))
    message = str(refused.value)
    assert message.startswith(f"LOCAL_RANK={local_rank} of LOCAL_WORLD_SIZE=2 but only 1 GPU(s)")
    assert "--nproc_per_node to 1" in message and "\n" not in message


def test_each_worker_takes_the_gpu_of_its_local_rank(gpus):
    gpus(8)
    assert resolve_device("auto", node(1, 2)) == torch.device("cuda", 1)
    assert resolve_device("cpu", node(1, 2)) == torch.device("cpu")
    gpus(0)
    assert resolve_device("auto", node(1, 2)) == torch.device("cpu")
    with pytest.raises(EnvError, match="no CUDA GPU is visible"):
        resolve_device("cuda", node(0, 1))


@pytest.fixture
def root_logging():
    """The worker sets the root logger up for its rank: put back as it was."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


LOCAL_RANK_1_OF_2 = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
@pytest.mark.parametrize("environ, flags, said", [
    # local rank 1 of two on a one-GPU laptop, as torchrun would start it
    (LOCAL_RANK_1_OF_2, [], "LOCAL_RANK=1 of LOCAL_WORLD_SIZE=2 but only 1 GPU(s)"),
    # before the process group, the data and the model touch the (here faked) GPU
    ({}, ["--device", "cuda", "--recovery", "in-process"],
     "--recovery in-process is not available on NCCL"),
])
def test_the_worker_says_it_in_one_line_and_exits_2(gpus, monkeypatch, capsys, root_logging,
                                                    tmp_path, environ, flags, said):
    gpus(1)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    status = main(["train", *flags, "--dataset", "synthetic", "--data-dir",
                   str(tmp_path / "data"), "--checkpoint-dir", str(tmp_path / "ckpt")])
    assert status == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"elastic-mnist train: error: {said}"), lines
    assert not (tmp_path / "data").exists() and not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("device, refused", [("cuda:1", True), ("cpu", False)])
def test_recovery_in_process_is_refused_on_nccl(device, refused):
    """Not yet run on GPUs: refused in one line on NCCL; gloo's is the tested one."""
    if refused:
        with pytest.raises(ConfigError) as error:
            check_recovery("in-process", torch.device(device))
        assert str(error.value).startswith("--recovery in-process is not available on NCCL "
                                           "(cuda:1)") and "\n" not in str(error.value)
    else:
        check_recovery("in-process", torch.device(device))
    for recovery in ("auto", "restart"):  # auto takes the restart path on NCCL by itself
        check_recovery(recovery, torch.device(device))


# --- the generators a checkpoint carries, on any device count ---------------------------------


@pytest.fixture
def cuda_generators(monkeypatch, gpus):
    """``count`` fake GPUs whose generator states are recorded as they are set; reading one
    returns a state that names its device. Setting one beyond the count raises IndexError, as
    torch does (``default_generators[index]``)."""
    class Generators:
        def __init__(self) -> None:
            self.count, self.set = 0, []

        def see(self, count: int) -> None:
            self.count = count
            gpus(count)

        def set_state(self, state: torch.Tensor, device=None) -> None:
            index = torch.device(device).index if not isinstance(device, int) else device
            if index >= self.count:
                raise IndexError("tuple index out of range")
            self.set.append((int(state[0]), index))

        def get_state(self, device=None) -> torch.Tensor:
            index = torch.device(device).index if not isinstance(device, int) else device
            return torch.full((16,), 100 + index, dtype=torch.uint8)

    fake = Generators()
    for module in (torch.cuda, torch.cuda.random):  # set_rng_state_all calls the module's own
        monkeypatch.setattr(module, "set_rng_state", fake.set_state)
        monkeypatch.setattr(module, "get_rng_state", fake.get_state)
    return fake


def trainer_on(digits, device: str) -> Trainer:
    """A Trainer on the CPU that saves and restores as if it ran on ``device``."""
    cfg = TrainConfig()
    cfg.optim.global_batch_size, cfg.optim.micro_batch_size = 64, 32
    trainer = Trainer(cfg, DistEnv(), torch.device("cpu"), load(digits, "synthetic"),
                      run_id="devices", restart_generation=0)
    trainer.device = torch.device(device)
    return trainer


def through_disk(payload: dict) -> dict:
    return deserialize(payload_bytes(payload), "a checkpoint")


def written_by_an_older_version(payload: dict, gpus_visible: int) -> dict:
    """rng["cuda"] as checkpoints held it before: one state per GPU visible to rank 0."""
    payload["rng"].pop("cuda_device", None)
    payload["rng"]["cuda"] = [torch.full((16,), index, dtype=torch.uint8)
                              for index in range(gpus_visible)]
    return through_disk(payload)


def test_a_checkpoint_keeps_its_own_devices_generator_only(tiny_digits, cuda_generators):
    cuda_generators.see(8)
    rng = through_disk(trainer_on(tiny_digits, "cuda:3").state())["rng"]
    assert "cuda" not in rng and int(rng["cuda_device"][0]) == 103  # not a list of 8
    assert through_disk(trainer_on(tiny_digits, "cpu").state())["rng"]["cuda_device"] is None


@pytest.mark.parametrize("visible, device, restored", [
    (2, "cuda:1", [(1, 1)]),  # an 8-GPU node's checkpoint, two GPUs here: GPU 1 takes state 1
    (1, "cuda:0", [(0, 0)]),
    (1, "cpu", []),           # GPU -> CPU
])
def test_an_8_gpu_checkpoint_resumes_where_fewer_gpus_are_visible(
        tiny_digits, cuda_generators, visible, device, restored):
    payload = written_by_an_older_version(trainer_on(tiny_digits, "cpu").state(), 8)
    cuda_generators.see(visible)
    trainer_on(tiny_digits, device).restore(payload, "an 8-GPU checkpoint")
    assert cuda_generators.set == restored


@pytest.mark.parametrize("saved", ["no GPU (an older checkpoint)", "no GPU", "one GPU"])
def test_a_checkpoint_without_this_gpus_state_resumes_with_a_log_line(
        tiny_digits, cuda_generators, caplog, saved):
    """CPU -> GPU, and a one-GPU node's checkpoint on local rank 1 of another node."""
    cuda_generators.see(2)
    source = trainer_on(tiny_digits, "cpu")
    if saved == "one GPU":
        payload = written_by_an_older_version(source.state(), 1)
    elif saved == "no GPU":
        payload = through_disk(source.state())
    else:
        payload = written_by_an_older_version(source.state(), 0)
    with caplog.at_level(logging.INFO, logger="elastic_mnist.rng"):
        trainer_on(tiny_digits, "cuda:1").restore(payload, "a checkpoint")
    assert cuda_generators.set == []
    assert "holds no CUDA generator state for cuda:1" in caplog.text


def test_the_cpu_and_python_generators_resume(tiny_digits, cuda_generators):
    """Whatever the CUDA state, the others continue exactly; the saved CUDA state goes to this
    rank's own device."""
    cuda_generators.see(4)
    source = trainer_on(tiny_digits, "cuda:0")
    payload = through_disk(source.state())
    expected = (torch.rand(3), random.random())
    torch.rand(5), random.random()  # the generators move on
    trainer_on(tiny_digits, "cuda:2").restore(payload, "a checkpoint")
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    assert cuda_generators.set == [(100, 2)]  # device 0's state, onto this rank's device 2


def test_building_the_model_leaves_every_gpus_generator_alone(monkeypatch):
    """``torch.manual_seed`` would reseed each GPU's generator as well, and nothing would put it
    back: every Trainer built would reset it, to the state a checkpoint saves and restores."""
    reseeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", reseeded.append)
    monkeypatch.setattr(torch.cuda, "manual_seed", reseeded.append)
    state = torch.get_rng_state()
    first, again = build_model(5).state_dict(), build_model(5).state_dict()
    assert reseeded == [] and torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(first[key], again[key]) for key in first)


@pytest.mark.cuda
def test_the_cuda_generator_resumes_on_the_gpu(tiny_digits):
    """Saved on this GPU, a CPU checkpoint, and an older one listing 8 GPUs: each loads here."""
    cfg = TrainConfig()
    cfg.optim.global_batch_size, cfg.optim.micro_batch_size = 64, 32
    data = load(tiny_digits, "synthetic")

    def trainer() -> Trainer:
        return Trainer(cfg, DistEnv(), torch.device("cuda", 0), data, run_id="devices",
                       restart_generation=0)

    torch.cuda.manual_seed(7)
    torch.rand(10, device="cuda")
    before = torch.cuda.get_rng_state()
    source = trainer()
    assert torch.equal(torch.cuda.get_rng_state(), before)  # building one leaves it alone
    torch.rand(3, device="cuda")  # the generator moves on after the construction
    payload = through_disk(source.state())
    expected = torch.rand(4, device="cuda")
    target = trainer()
    torch.rand(100, device="cuda")  # after the construction: only the restore brings it back
    target.restore(payload, "a checkpoint")
    assert torch.equal(torch.rand(4, device="cuda"), expected)

    cpu_payload = through_disk(Trainer(cfg, DistEnv(), torch.device("cpu"), data,
                                       run_id="devices", restart_generation=0).state())
    trainer().restore(cpu_payload, "a CPU checkpoint")
    older = through_disk(trainer().state())
    older["rng"]["cuda"] = [older["rng"].pop("cuda_device")] * 8
    trainer().restore(older, "an 8-GPU checkpoint")


# --- the state a survivor hands on, in process ---------------------------------------------------


def tensors_in(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v)]
    return []


def adopted(trainer: Trainer, monkeypatch) -> dict:
    """The payload ``trainer`` broadcasts as the holder of the state the survivors agree on."""
    sent = []

    def broadcast_object(obj, src, device, group=None):
        sent.append(obj)
        return obj

    monkeypatch.setattr(distributed, "broadcast_object", broadcast_object)
    trainer.regroup.adopt(Change(env=DistEnv(), generation=1, old_world_size=2, lost=[],
                                 why="died", step=0, holder=0, steps_redone=0, evaluated_step=-1,
                                 detected=time.monotonic(), detected_at=time.time()))
    (payload,) = sent
    return payload


def test_the_state_a_survivor_hands_on_is_a_copy_in_host_memory(tiny_digits, monkeypatch):
    """As a checkpoint's snapshot takes it: never the live (on a GPU, device) tensors."""
    trainer = trainer_on(tiny_digits, "cpu")
    trainer.train_step(trainer.global_batch(), stop_requested=False)  # optimizer state too
    payload = adopted(trainer, monkeypatch)
    live = {t.data_ptr() for t in tensors_in(trainer.model.state_dict())
            + tensors_in(trainer.optimizer.state_dict())}
    sent = tensors_in(payload["model"]) + tensors_in(payload["optimizer"])
    assert len(sent) > len(trainer.model.state_dict())
    assert all(t.device.type == "cpu" for t in tensors_in(payload))
    assert not live & {t.data_ptr() for t in sent}


@pytest.mark.cuda
def test_the_state_a_survivor_hands_on_leaves_the_gpu(tiny_digits, monkeypatch):
    """Sent from a GPU, the payload holds CPU tensors only; a receiver loads it onto its own."""
    cfg = TrainConfig()
    cfg.optim.global_batch_size, cfg.optim.micro_batch_size = 64, 32
    trainer = Trainer(cfg, DistEnv(), torch.device("cuda", 0), load(tiny_digits, "synthetic"),
                      run_id="devices", restart_generation=0)
    trainer.train_step(trainer.global_batch(), stop_requested=False)
    payload = adopted(trainer, monkeypatch)
    assert {t.device.type for t in tensors_in(payload)} == {"cpu"}
    trainer.load_state(pickle.loads(pickle.dumps(payload)))  # as broadcast_object_list does
    assert {t.device for t in tensors_in(trainer.model.state_dict())} == {trainer.device}
    trainer.train_step(trainer.global_batch(), stop_requested=False)


# --- the optimizer's kernels: the device's, whatever device saved the checkpoint -----------------


def stepped(trainer: Trainer) -> Trainer:
    batch = trainer.global_batch()
    trainer.train_step(batch, stop_requested=False)
    trainer.advance(len(batch))
    return trainer


def adamw_steps(trainer: Trainer) -> set[int]:
    return {int(state["step"]) for state in trainer.optimizer.state.values()}


def test_adamw_is_fused_on_a_gpu():
    assert adamw_kernels(torch.device("cuda", 1)) == {"fused": True, "foreach": None}
    assert adamw_kernels(torch.device("cpu")) == {"fused": False, "foreach": None}


@pytest.mark.parametrize("saved, own", [(True, False), (False, True)])
def test_a_checkpoint_resumes_with_this_devices_adamw(tiny_digits, monkeypatch, saved, own):
    """A GPU's checkpoint (fused) where the device does not fuse, and a CPU's (unfused) where it
    does, as a GPU does (shown on the CPU, whose fused kernel torch has too)."""
    def kernels(fused: bool):
        return lambda device: {"fused": fused, "foreach": None}

    monkeypatch.setattr(trainer_module, "adamw_kernels", kernels(saved))
    payload = through_disk(stepped(trainer_on(tiny_digits, "cpu")).state())
    assert [group["fused"] for group in payload["optimizer"]["param_groups"]] == [saved]
    monkeypatch.setattr(trainer_module, "adamw_kernels", kernels(own))
    trainer = trainer_on(tiny_digits, "cpu")
    trainer.restore(payload, "a checkpoint")
    assert [group["fused"] for group in trainer.optimizer.param_groups] == [own]
    assert adamw_steps(stepped(trainer)) == {2}  # its state taken, it steps on with it


@pytest.mark.cuda
def test_a_cpu_checkpoint_resumes_fused_on_the_gpu(tiny_digits):
    cpu = stepped(trainer_on(tiny_digits, "cpu"))
    cfg = TrainConfig()
    cfg.optim.global_batch_size, cfg.optim.micro_batch_size = 64, 32
    gpu = Trainer(cfg, DistEnv(), torch.device("cuda", 0), load(tiny_digits, "synthetic"),
                  run_id="devices", restart_generation=0)
    gpu.restore(through_disk(cpu.state()), "a CPU checkpoint")
    assert [group["fused"] for group in gpu.optimizer.param_groups] == [True]
    assert {state["step"].device for state in gpu.optimizer.state.values()} == {gpu.device}
    assert adamw_steps(stepped(gpu)) == {2}
