#!/usr/bin/env python3
"""What one GPU can prove of the job's CUDA path, one probe per step of scripts/gpu_check.sh.

    scripts/gpu_probes.py PROBE --data-dir DIR --out RESULT.json [--device cuda|cpu]

Each probe prints one line per check and writes ``{"probe", "device", "checks", "figures"}`` to
``--out``; a check is true, false, or null where it cannot be made on this device (a GPU's, asked
on CPU). Exit 0 when no check is false, 1 otherwise, 2 on bad input. The probes marked (torchrun)
are run as ``torchrun --standalone --nproc_per_node=1 scripts/gpu_probes.py ...``: a process group
of one, NCCL on a GPU, the model in DDP as the job runs it.

  ddp      (torchrun) the group is NCCL, an all-reduce's future gives its sum; in DDP, a step
           copies nothing from the host and an evaluation neither
  rng      (torchrun) building a Trainer leaves the CUDA generator as it was; advanced after
           that, saved, drawn from, moved on: a restore brings its draws back (issue 27, item 4)
  futures  a stand-in for the futures that ``--recovery in-process`` wraps NCCL's in: a
           ``torch.futures.Future(devices=[cuda])`` completed on a side stream, wrapped through
           ``then`` into another with the device, orders the reader's stream after the side
           stream's work; one without devices (what item 2 found) is observed, not required
  graphs   (torchrun) ``--compile`` at one micro-batch per step (no accumulation) chooses CUDA
           graphs under DDP, and its gradients and losses are eager DDP's, step after step

On CPU (gpu_check.sh's dry run, tests/test_gpu_check.py) the same code runs with the GPU's
checks null: the plumbing stays tested where no GPU is.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

Checks = dict[str, Any]


def config(device: torch.device, accumulate: bool = True, **run_flags: Any):
    """Batches of 64 on a GPU (two micro-batches of 32, or one), of 16 on CPU: the dry run's
    seconds are the suite's."""
    from elastic_mnist.config import TrainConfig

    global_batch = 64 if device.type == "cuda" else 16
    micro_batch = global_batch // 2 if accumulate else global_batch
    cfg = TrainConfig()
    cfg.optim.global_batch_size, cfg.optim.micro_batch_size = global_batch, micro_batch
    for name, value in run_flags.items():
        setattr(cfg.run, name, value)
    return cfg


def trainer_for(cfg, env, device: torch.device, data_dir: Path):
    from elastic_mnist.data.datasets import load
    from elastic_mnist.trainer import Trainer

    return Trainer(cfg, env, device, load(data_dir, "synthetic"), run_id="gpu-probe",
                   restart_generation=0)


def step(trainer) -> float:
    batch = trainer.global_batch()
    loss = trainer.train_step(batch, stop_requested=False).loss
    trainer.advance(len(batch))
    return loss


def copies(device: torch.device, work: Callable[[], None]) -> list[str] | None:
    """The names of the memory copies that ``work`` ran on the GPU; None off a GPU."""
    if device.type != "cuda":
        work()
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        work()
        torch.cuda.synchronize(device)
    return [e.name for e in prof.events() if e.name.startswith("Memcpy")]


def on_gpu(device: torch.device, value: bool) -> bool | None:
    return value if device.type == "cuda" else None


def probe_ddp(device: torch.device, data_dir: Path, env) -> tuple[Checks, dict]:
    import torch.distributed as dist

    from elastic_mnist.report import evaluate

    checks: Checks = {}
    backend = "nccl" if device.type == "cuda" else "gloo"
    checks[f"a {backend} group of one under torchrun"] = (
        dist.is_initialized() and dist.get_backend() == backend and dist.get_world_size() == 1)
    summed = torch.full((4,), 3.0, device=device)
    dist.all_reduce(summed, async_op=True).get_future().wait()
    checks["an all-reduce's future gives its sum"] = summed.tolist() == [3.0] * 4
    trainer = trainer_for(config(device), env, device, data_dir)
    checks["the model is in DDP"] = trainer.engine.ddp is not None
    for _ in range(2):
        step(trainer)

    def three_steps() -> None:
        for _ in range(3):
            step(trainer)

    names = copies(device, three_steps)
    checks["3 steps in DDP copy nothing from the host"] = on_gpu(
        device, names is not None and not [n for n in names if "HtoD" in n])
    checks["3 steps in DDP read back at most 3 times"] = on_gpu(
        device, names is not None and len([n for n in names if "DtoH" in n]) <= 3)
    evaluate(trainer.model, trainer.test_data, device, trainer.env, batch_size=64)
    names_eval = copies(device, lambda: evaluate(trainer.model, trainer.test_data, device,
                                                 trainer.env, batch_size=64))
    checks["an evaluation in DDP copies nothing from the host"] = on_gpu(
        device, names_eval is not None and not [n for n in names_eval if "HtoD" in n])
    return checks, {"copies_in_3_steps": names, "copies_in_an_evaluation": names_eval}


def probe_rng(device: torch.device, data_dir: Path, env) -> tuple[Checks, dict]:
    from elastic_mnist.checkpoint import deserialize, payload_bytes

    checks: Checks = {}
    if device.type != "cuda":
        trainer_for(config(device), env, device, data_dir).state()
        return {"building a Trainer leaves the CUDA generator as it was": None,
                "a restore brings the advanced CUDA generator's draws back": None}, {}
    torch.cuda.manual_seed(7)
    torch.rand(10, device=device)
    before = torch.cuda.get_rng_state(device)
    source = trainer_for(config(device), env, device, data_dir)
    checks["building a Trainer leaves the CUDA generator as it was"] = torch.equal(
        torch.cuda.get_rng_state(device), before)
    torch.rand(10, device=device)  # advanced after the construction: only a restore undoes it
    payload = deserialize(payload_bytes(source.state()), "a checkpoint")
    expected = torch.rand(4, device=device)
    torch.rand(100, device=device)
    target = trainer_for(config(device), env, device, data_dir)
    unrestored = torch.cuda.get_rng_state(device)
    target.restore(payload, "the probe's checkpoint")
    got = torch.rand(4, device=device)
    torch.cuda.set_rng_state(unrestored, device)
    checks["a restore brings the advanced CUDA generator's draws back"] = (
        torch.equal(got, expected) and not torch.equal(torch.rand(4, device=device), expected))
    return checks, {}


def probe_futures(device: torch.device, data_dir: Path, env) -> tuple[Checks, dict]:
    name = "a Future(devices=[cuda]) from a side stream, wrapped with the device: the reader waits"
    if device.type != "cuda":
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(torch.ones(1))
        return {name: None}, {}

    def read_after(wrap_devices: list[torch.device]) -> float:
        """A side stream's slow work writes ones; the reader, on the current stream, sums them
        after waiting on a wrapper of the side stream's future (as Membership.guard wraps
        NCCL's): the sum is complete only if the wait ordered the streams."""
        size = 8192
        a = torch.randn(size, size, device=device) / size ** 0.5
        ones = torch.zeros(1 << 20, device=device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            x = a
            for _ in range(40):  # about a second of matmuls in fp32, bounded by tanh
                x = (x @ a).tanh()
            ones.add_(1 + 0 * x[0, :1])  # ones, once the matmuls are done
            inner = torch.futures.Future(devices=[device])
            inner.set_result(ones)
        wrapper: torch.futures.Future = (torch.futures.Future(devices=wrap_devices)
                                         if wrap_devices else torch.futures.Future())
        chained = inner.then(lambda done: wrapper.set_result(done.value()))
        if not wrapper.done():
            chained.value()  # the callback's error (its own wait would order the streams)
        read = wrapper.wait().sum()  # on the current stream
        total = read.item()
        torch.cuda.synchronize(device)
        return total

    n = float(1 << 20)
    with_device = read_after([device])
    without = read_after([])
    return ({name: with_device == n},
            {"sum_read_with_devices": with_device, "sum_read_without_devices": without,
             "without_devices_the_reader_saw_unfinished_work": without != n, "expected": n})


def probe_graphs(device: torch.device, data_dir: Path, env) -> tuple[Checks, dict]:
    """Eager against compiled; on CPU eager against eager (compiling there proves nothing of
    CUDA graphs and costs the dry run most of a minute)."""
    from elastic_mnist.fast_path import CUDA_GRAPHS

    runs = []
    for compile in (False, device.type == "cuda"):
        torch._dynamo.reset()
        trainer = trainer_for(config(device, accumulate=False, compile=compile), env, device, data_dir)
        grads, losses = [], []
        for _ in range(3):
            losses.append(step(trainer))
            grads.append([p.grad.detach().clone() for p in trainer.model.parameters()])
        runs.append((trainer, grads, losses))
    (_, eager_grads, eager_losses), (compiled, compiled_grads, compiled_losses) = runs
    checks: Checks = {"the model is in DDP": compiled.engine.ddp is not None,
                      "one micro-batch per step chooses CUDA graphs": on_gpu(
                          device, compiled.engine.compilation.mode == CUDA_GRAPHS)}
    apart = []  # tests/test_fast_path.py's tolerances, per step and parameter
    for number, (ours, theirs) in enumerate(zip(compiled_grads, eager_grads), 1):
        for index, (got, want) in enumerate(zip(ours, theirs)):
            if not torch.allclose(got, want, rtol=1e-3, atol=1e-4 * want.abs().max().item()):
                apart.append(f"step {number}, parameter {index}: "
                             f"{(got - want).abs().max().item():.3g} apart")
    checks["3 compiled steps' gradients are eager's, to rounding"] = not apart
    loss_gap = max(abs(a - b) / abs(b) for a, b in zip(compiled_losses, eager_losses))
    checks["3 compiled steps' losses are eager's (to 1e-4)"] = loss_gap < 1e-4
    return checks, {"mode": compiled.engine.compilation.mode, "gradients_apart": apart,
                    "worst_loss_gap": loss_gap, "eager_losses": eager_losses,
                    "compiled_losses": compiled_losses}


PROBES = {"ddp": (probe_ddp, True), "rng": (probe_rng, True), "futures": (probe_futures, False),
          "graphs": (probe_graphs, True)}
"""Each probe, and whether it runs in a process group (under torchrun)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("probe", choices=sorted(PROBES))
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args(argv)
    if not args.data_dir.is_dir():
        print(f"gpu_probes: --data-dir {args.data_dir} is not a folder", file=sys.stderr)
        return 2
    from elastic_mnist.distributed import process_group, resolve_device
    from elastic_mnist.env import DistEnv
    from elastic_mnist.errors import EnvError

    run, grouped = PROBES[args.probe]
    try:
        env = DistEnv.from_environ()
        device = resolve_device(args.device, env)
    except EnvError as error:
        print(f"gpu_probes: {error}", file=sys.stderr)
        return 2
    if grouped and not env.is_distributed:
        print(f"gpu_probes: {args.probe} runs under torchrun (--standalone --nproc_per_node=1)",
              file=sys.stderr)
        return 2
    with process_group(env, device, timeout_s=60) if grouped else contextlib.nullcontext():
        checks, figures = run(device, args.data_dir, env)
    if env.rank == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"probe": args.probe, "device": str(device),
                                        "checks": checks, "figures": figures}, indent=2) + "\n")
        for check, held in checks.items():
            print(f"{args.probe}: {_word(held)}: {check}", flush=True)
    return 1 if False in checks.values() else 0


def _word(held: bool | None) -> str:
    return "ok" if held else "not on this device" if held is None else "FAILED"


if __name__ == "__main__":
    sys.exit(main())
