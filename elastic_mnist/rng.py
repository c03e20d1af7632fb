"""The random generators a checkpoint carries, resumable on any device count.

A checkpoint holds the CPU generator, Python's, and the CUDA generator of the device that saved it
(rank 0's), never one per visible GPU: a checkpoint from an 8-GPU node must resume where 1 GPU is
visible, or none, and one saved on CPU where there are GPUs. Every rank restores the saved CUDA
state onto its own device; at a fresh start every rank's CUDA generator holds torch's default seed
alike (``build_model`` seeds the CPU generator alone, and puts it back), so this is the state they
would share.

Checkpoints written before this (``rng["cuda"]``: one state per GPU visible to rank 0) are read
too: a rank takes the state of its own device's index if the list has one, and keeps its own
generator otherwise, saying so.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import torch

log = logging.getLogger(__name__)


def rng_state(device: torch.device) -> dict[str, Any]:
    """The generators' states, as a checkpoint keeps them."""
    return {"torch": torch.get_rng_state(),
            "cuda_device": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
            "python": list(random.getstate()[1])}


def saved_cuda_state(rng: dict[str, Any], device: torch.device) -> torch.Tensor | None:
    """The CUDA generator state a checkpoint holds for ``device``; None if it holds none."""
    if "cuda_device" in rng:
        return rng["cuda_device"]
    per_gpu = rng.get("cuda") or []  # older checkpoints: one per GPU visible where it was saved
    index = device.index or 0
    return per_gpu[index] if device.type == "cuda" and index < len(per_gpu) else None


def restore_rng_state(rng: dict[str, Any], device: torch.device) -> None:
    """Sets the generators from a checkpoint's states: the CUDA one only onto ``device``."""
    torch.set_rng_state(rng["torch"])
    state = random.getstate()
    random.setstate((state[0], tuple(rng["python"]), state[2]))
    cuda_state = saved_cuda_state(rng, device)
    if device.type == "cuda" and cuda_state is not None:
        torch.cuda.set_rng_state(cuda_state, device)
    elif device.type == "cuda":
        log.info("the checkpoint holds no CUDA generator state for %s (saved on CPU, or where "
                 "fewer GPUs were visible): %s keeps its own generator", device, device)
    elif cuda_state is not None or rng.get("cuda"):
        log.info("the checkpoint's CUDA generator state is not used on %s", device)
