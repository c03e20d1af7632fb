"""The fast path's two global choices, each made in one place and said in the launch summary: how
float32 convolutions and matmuls compute (``--precision``), and torch.compile's mode
(``--compile``); and AdamW's kernels, the device's choice.

**Precision.** torch runs cuDNN convolutions in TF32 by default on Ampere and newer GPUs (10 bits
of mantissa), while cuBLAS matmuls stay IEEE fp32: left alone, "fp32" would be neither. Here
``fp32`` is IEEE fp32 throughout (TF32 off for both), ``tf32`` asks for TF32 tensor cores for both,
and ``bf16`` runs convolutions and matmuls in bf16 under autocast, with whatever stays in float32
IEEE. On CPU the switches change nothing; there only bf16 differs from fp32.

**Compilation.** ``mode="reduce-overhead"`` replays CUDA graphs, and a graph's outputs, the
gradients included, live in memory that its next replay overwrites: with more than one
micro-batch per rank and step the accumulated gradients would be lost (torch's
``cudagraph_trees.format_dealloc_msg``; pytorch/pytorch#96693 shows the silent case, a gradient
of 0.25 where four accumulations should give 1.0). So CUDA graphs are used only where every rank
runs one micro-batch per step; elsewhere the model is compiled without them (inductor's default
mode). The launch's world size decides, since a restart may change it.

**AdamW** runs as one fused kernel on a GPU (not dozens per step); elsewhere as torch chooses. A
checkpoint carries the kernels of the device that wrote it in its parameter groups, and loading
it would keep them (a CPU checkpoint resumed on a GPU: unfused): the device's own are kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

CUDA_GRAPHS = "reduce-overhead"
NO_CUDA_GRAPHS = "default"

FLOAT32_MATH = {
    "fp32": "IEEE fp32: TF32 off for cuDNN convolutions and cuBLAS matmuls",
    "tf32": "TF32 tensor cores for float32 convolutions and matmuls (Ampere and newer GPUs)",
    "bf16": "bf16 autocast for convolutions and matmuls; what stays float32 is IEEE fp32 "
            "(TF32 off)",
}


def adamw_kernels(device: torch.device) -> dict[str, bool | None]:
    """AdamW's ``fused`` and ``foreach`` on ``device``: fused on a GPU."""
    return {"fused": device.type == "cuda", "foreach": None}


def set_float32_math(precision: str) -> str:
    """Sets, for the whole process, whether CUDA float32 convolutions and matmuls may use TF32,
    as ``--precision`` says; returns the line that describes it.

    Through torch's two boolean switches rather than the per-operator ``fp32_precision`` of torch
    2.9+: each switch sets the per-operator values too and keeps both readable, while setting only
    the per-operator values makes torch's own readers of the switches (in dynamo and inductor)
    raise about "a mix of the legacy and new APIs".
    """
    tf32 = precision == "tf32"
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    return f"{precision} ({FLOAT32_MATH[precision]})"


def micro_batches_per_rank(global_batch_size: int, micro_batch_size: int,
                           world_size: int) -> int:
    """The most micro-batches any rank runs in one step; at least one, since a rank left without
    a micro-batch still runs a pass that counts for nothing."""
    per_step = math.ceil(global_batch_size / micro_batch_size)
    return max(1, math.ceil(per_step / world_size))


@dataclass(frozen=True)
class Compilation:
    """torch.compile's mode for this launch (None: not compiled), and why."""

    mode: str | None
    why: str

    def describe(self) -> str:
        return "off" if self.mode is None else f"torch.compile mode={self.mode!r}: {self.why}"


def choose_compilation(device_type: str, micro_batches: int, compile: bool) -> Compilation:
    """The one place that decides: CUDA graphs only on a GPU where a rank runs one micro-batch
    per step (``micro_batches``, from :func:`micro_batches_per_rank`), since their replay
    overwrites the gradients that accumulation would add to."""
    if not compile:
        return Compilation(None, "")
    if device_type != "cuda":
        return Compilation(NO_CUDA_GRAPHS, "no CUDA graphs off a GPU")
    if micro_batches == 1:
        return Compilation(CUDA_GRAPHS, "CUDA graphs, one micro-batch per rank and step")
    return Compilation(NO_CUDA_GRAPHS,
                       f"no CUDA graphs, since a rank accumulates the gradients of up to "
                       f"{micro_batches} micro-batches per step, which a graph's replay would "
                       f"overwrite")
