"""The IDX file format of MNIST: read with validation, write atomically."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import torch

from elastic_mnist.errors import DataError
from elastic_mnist.fsutil import atomic_write_bytes

IMAGES_MAGIC = 2051  # unsigned byte, 3 dimensions
LABELS_MAGIC = 2049  # unsigned byte, 1 dimension


def read_idx(path: Path, magic: int) -> torch.Tensor:
    """Reads one uncompressed IDX file of unsigned bytes into a uint8 tensor."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}") from None
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    found = struct.unpack(">i", raw[:4])[0] if len(raw) >= 4 else None
    if found is not None and found != magic:
        raise DataError(f"{path} is not an IDX file of the expected kind "
                        f"(magic {found}, expected {magic})")
    if len(raw) < header:
        raise DataError(f"{path} is truncated: {len(raw)} bytes, shorter than its header")
    shape = struct.unpack(f">{ndim}i", raw[4:header])
    expected = header + int(np.prod(shape))
    if len(raw) != expected:
        state = "truncated" if len(raw) < expected else "corrupt (trailing bytes)"
        raise DataError(f"{path} is {state}: {len(raw)} bytes, expected {expected} "
                        f"for shape {tuple(shape)}")
    array = np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)
    return torch.from_numpy(array.copy())


def write_idx(path: Path, tensor: torch.Tensor) -> None:
    """Writes a uint8 tensor as an IDX file, atomically (temp file, fsync, rename)."""
    array = tensor.to(torch.uint8).contiguous().numpy()
    magic = 0x0800 | array.ndim
    header = struct.pack(f">i{array.ndim}i", magic, *array.shape)
    atomic_write_bytes(Path(path), header + array.tobytes())


def gunzip(src: Path, dst: Path) -> None:
    """Extracts ``src`` (.gz) to ``dst`` atomically; a corrupt archive is a DataError."""
    try:
        with gzip.open(src, "rb") as f:
            data = f.read()
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise DataError(f"{src} is corrupt or truncated: {e}") from None
    atomic_write_bytes(dst, data)
