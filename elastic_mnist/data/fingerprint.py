"""The fingerprint of the digits a job trains on, computed once per data folder and cached there.

The fingerprint is the sha256 of both splits' IDX files in a fixed order: their payloads are exactly
the uint8 image and label tensors, their headers the shapes. It is kept in ``FINGERPRINT.json``
beside the files, keyed by each file's size, modification time and inode, so that a start reads
it instead of hashing some 50 MB again, and a file written anew is hashed anew.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from elastic_mnist.fsutil import atomic_write_bytes

log = logging.getLogger(__name__)

CACHE = "FINGERPRINT.json"
SHORT = 12
"""Hex digits of a fingerprint shown in messages."""


def fingerprint(raw: Path, names: list[str]) -> str:
    """The sha256 of the files ``names`` in ``raw``, from the cache when it is still current."""
    raw = Path(raw)
    stats = {name: _identity(raw / name) for name in names}
    cached = _read_cache(raw)
    if cached.get("files") == stats and isinstance(cached.get("sha256"), str):
        return cached["sha256"]
    digest = hashlib.sha256()
    for name in names:
        digest.update((raw / name).read_bytes())
    value = digest.hexdigest()
    try:
        atomic_write_bytes(raw / CACHE, json.dumps({"sha256": value, "files": stats},
                                                   indent=2).encode())
    except OSError as e:  # a read-only data folder: hash on every start instead
        log.info("cannot cache the data fingerprint in %s (%s)", raw, e.strerror)
    return value


def _identity(path: Path) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _read_cache(raw: Path) -> dict:
    try:
        cached = json.loads((raw / CACHE).read_text())
    except (OSError, ValueError):
        return {}
    return cached if isinstance(cached, dict) else {}
