"""The fast path's global choice of how float32 convolutions and matmuls compute
(``--precision``), made in one place and said in the launch summary.

torch runs cuDNN convolutions in TF32 by default on Ampere and newer GPUs (10 bits of mantissa),
while cuBLAS matmuls stay IEEE fp32: left alone, "fp32" would be neither. Here ``fp32`` is IEEE
fp32 throughout (TF32 off for both), ``tf32`` asks for TF32 tensor cores for both, and ``bf16``
runs convolutions and matmuls in bf16 under autocast, with whatever stays in float32 IEEE. On CPU
the switches change nothing; there only bf16 differs from fp32.
"""

from __future__ import annotations

import torch

FLOAT32_MATH = {
    "fp32": "IEEE fp32: TF32 off for cuDNN convolutions and cuBLAS matmuls",
    "tf32": "TF32 tensor cores for float32 convolutions and matmuls (Ampere and newer GPUs)",
    "bf16": "bf16 autocast for convolutions and matmuls; what stays float32 is IEEE fp32 "
            "(TF32 off)",
}


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

