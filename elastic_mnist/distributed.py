"""Device choice, the process group's lifecycle, and the few collectives the job uses."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
from collections.abc import Iterator
from typing import NoReturn

import torch
import torch.distributed as dist

from elastic_mnist.addresses import maybe_warn_unreachable_gloo
from elastic_mnist.attempt_store import attempt_store
from elastic_mnist.env import DistEnv
from elastic_mnist.errors import EnvError

log = logging.getLogger(__name__)


def resolve_device(choice: str, env: DistEnv) -> torch.device:
    """``cuda:LOCAL_RANK`` or ``cpu``, per ``--device``; raises EnvError when it cannot be had."""
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise EnvError("--device cuda was asked for, but no CUDA GPU is visible")
    visible = torch.cuda.device_count()
    if max(env.local_rank, env.local_world_size - 1) >= visible:  # every worker says it at once
        raise EnvError(f"LOCAL_RANK={env.local_rank} of LOCAL_WORLD_SIZE={env.local_world_size} "
                       f"but only {visible} GPU(s) are visible; lower --nproc_per_node to "
                       f"{visible}, or pass --device cpu")
    return torch.device("cuda", env.local_rank)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


@contextlib.contextmanager
def process_group(env: DistEnv, device: torch.device,
                  timeout_s: float) -> Iterator[dist.Store | None]:
    """Joins the job's process group for the duration of the block, and always leaves it.

    Yields a connection of its own to the group's store (None in a single process, and for a
    worker of a node that joins a job as it trains: its group is the job's next generation,
    which the membership installs once the job admits it), for threads that talk beside the
    training loop's collectives.
    """
    if not env.is_distributed:
        yield None
        return
    maybe_warn_unreachable_gloo(env, backend_for(device))  # its node's local rank 0, in one line
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = None
    if env.join is None:
        timeout = datetime.timedelta(seconds=timeout_s)
        store = attempt_store(env, timeout)
        dist.init_process_group(backend=backend_for(device), timeout=timeout,
                                device_id=device if device.type == "cuda" else None,
                                store=store, rank=env.rank, world_size=env.world_size)
    try:
        yield None if store is None else store.clone()
    finally:
        if dist.is_initialized():  # a recovery in process may have replaced it, or failed to
            dist.destroy_process_group()


def end_process(code: int) -> NoReturn:
    """Ends a worker's process with ``code`` at once, without the interpreter's finalization.

    ``destroy_process_group`` does not promise to destroy the backend: DDP keeps a reference to
    the group, so gloo's worker threads outlive it. Such a thread drops its last reference to a
    finished collective's tensors a little after the collective returns, and that takes the GIL;
    if the interpreter is finalizing by then, the process aborts ("terminate called without an
    active exception", SIGABRT) after a run that succeeded; ``scripts/exit_race.py`` shows it on
    a loaded machine. Everything the job writes is closed before this; logs and standard streams
    are flushed here.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def is_active(group: dist.ProcessGroup | None = None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def all_reduce_(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce; a no-op in a single process."""
    if is_active():
        dist.all_reduce(tensor, op=op)
    return tensor


def all_agree(ok: bool, device: torch.device) -> bool:
    """True only if ``ok`` holds on every rank."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    return bool(all_reduce_(flag, dist.ReduceOp.MIN).item())


def all_gather_object(obj: object, device: torch.device,
                      group: dist.ProcessGroup | None = None) -> list[object]:
    """Every rank's ``obj``, in rank order, on every rank (of ``group``, the default one if
    None)."""
    if not is_active(group):
        return [obj]
    gathered: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group)  # NCCL: the current device, set at start
    return gathered


def broadcast_object(obj: object, src: int, device: torch.device,
                     group: dist.ProcessGroup | None = None) -> object:
    """``obj`` as held by rank ``src`` (of ``group``, the default one if None), on every
    rank."""
    if not is_active(group):
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, group=group, group_src=src,
                               device=device if device.type == "cuda" else None)
    return holder[0]
