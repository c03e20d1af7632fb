"""MNIST (or synthetic digits) on disk in torchvision's layout, loaded once into memory.

The layout is ``<data-dir>/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte`` (the ``.gz``
files as distributed are extracted when only they are present). Synthetic digits use the same layout
and carry a marker file, so they are never mistaken for the real thing.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from elastic_mnist.data.fingerprint import SHORT, fingerprint
from elastic_mnist.data.idx import IMAGES_MAGIC, LABELS_MAGIC, gunzip, read_idx, write_idx
from elastic_mnist.errors import DataError
from elastic_mnist.fsutil import atomic_write_bytes

log = logging.getLogger(__name__)

SPLIT_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
ALL_FILES = [name for names in SPLIT_FILES.values() for name in names]
SYNTHETIC_MARKER = "SYNTHETIC.json"
DEFAULT_SYNTHETIC = {"train": 60_000, "test": 10_000, "seed": 0}
SYNTHETIC_WARNING = ("TRAINING ON SYNTHETIC DIGITS, NOT MNIST: accuracy figures of this run say "
                     "nothing about handwritten digits")

# Normalisation of MNIST (mean and std of its training pixels), applied on the fly.
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


@dataclass(frozen=True)
class Digits:
    """One split, resident in memory as uint8 images and int64 labels."""

    images: torch.Tensor
    """uint8 [N, 28, 28]."""
    labels: torch.Tensor
    """int64 [N]."""

    def __len__(self) -> int:
        return self.labels.numel()

    def to(self, device: torch.device) -> Digits:
        return Digits(self.images.to(device), self.labels.to(device))

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalised float images [n, 1, 28, 28] and labels of the given sample indices."""
        # index_select copies whole rows (10x faster than images[indices] on CPU)
        images = self.images.index_select(0, indices).unsqueeze(1).float()
        images = images.mul_(1.0 / (255.0 * MNIST_STD)).sub_(MNIST_MEAN / MNIST_STD)
        return images, self.labels.index_select(0, indices)


@dataclass(frozen=True)
class Dataset:
    """The train and test splits, and where they came from."""

    train: Digits
    test: Digits
    kind: str
    """'mnist' or 'synthetic'."""
    root: Path
    """The folder holding MNIST/raw."""
    fingerprint: str
    """sha256 of both splits' files (data/fingerprint.py): the same digits, the same value."""

    @property
    def is_synthetic(self) -> bool:
        return self.kind == "synthetic"

    def describe(self) -> str:
        return (f"{self.kind} digits from {self.root} ({len(self.train)} train, "
                f"{len(self.test)} test, fingerprint {self.fingerprint[:SHORT]})")


def raw_dir(root: Path) -> Path:
    return Path(root) / "MNIST" / "raw"


def is_synthetic_dir(root: Path) -> bool:
    return (raw_dir(root) / SYNTHETIC_MARKER).exists()


def has_split_files(root: Path) -> bool:
    raw = raw_dir(root)
    return all((raw / name).exists() or (raw / f"{name}.gz").exists() for name in ALL_FILES)


def synthetic_root(data_dir: Path, dataset: str) -> Path:
    """Where synthetic digits live: --data-dir itself, or a subfolder when they stand in for MNIST."""
    return Path(data_dir) if dataset == "synthetic" else Path(data_dir) / "synthetic"


def dataset_root(data_dir: Path, dataset: str, kind: str) -> Path:
    """The folder holding MNIST/raw for ``--dataset`` when ``kind`` was prepared."""
    return synthetic_root(data_dir, dataset) if kind == "synthetic" else Path(data_dir)


# --- preparing files on disk (one process per node, under a file lock) --------------------------


@contextlib.contextmanager
def prepare_lock(root: Path) -> Iterator[None]:
    """An exclusive lock on the data folder, safe when several nodes share it."""
    raw = raw_dir(root)
    raw.mkdir(parents=True, exist_ok=True)
    with open(raw / ".prepare.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def prepare(data_dir: Path, dataset: str, *, download: bool, synthetic_fallback: bool) -> str:
    """Makes the dataset's raw files exist; returns the kind prepared ('mnist' or 'synthetic')."""
    data_dir = Path(data_dir)
    if dataset == "synthetic":
        ensure_synthetic(synthetic_root(data_dir, dataset))
        return "synthetic"
    try:
        ensure_mnist(data_dir, download=download, fallback=synthetic_fallback)
        return "mnist"
    except DataError as e:
        if not synthetic_fallback:
            raise
        log.warning("synthetic digits stand in for MNIST, which cannot be had: %s", e)
        ensure_synthetic(synthetic_root(data_dir, dataset))
        return "synthetic"


def ensure_mnist(root: Path, *, download: bool, fallback: bool = False) -> None:
    """Extracts the .gz files, or downloads MNIST when allowed; a DataError says what is missing
    (and, unless synthetic digits stand in for it as a ``fallback``, what to train on instead)."""
    if is_synthetic_dir(root):
        raise DataError(f"{raw_dir(root)} holds synthetic digits ({SYNTHETIC_MARKER}); "
                        f"use --dataset synthetic or another --data-dir")
    with prepare_lock(root):
        if not has_split_files(root) and download:
            _download(root)
        if not has_split_files(root):
            raise DataError(missing_mnist_message(root, download, fallback))
        _extract_archives(root)
        fingerprint(raw_dir(root), ALL_FILES)  # cached for every rank that loads the files


def missing_mnist_message(root: Path, download: bool, fallback: bool = False) -> str:
    names = ", ".join(ALL_FILES)
    why = "downloading is off (--no-download)" if not download else "the download failed"
    instead = " for MNIST" if fallback else ", or train on --dataset synthetic"
    return (f"MNIST not found in {raw_dir(root)} and {why}: put {names} (or their .gz files) "
            f"there{instead}")


def _download(root: Path) -> None:
    import torchvision  # imported here: only the downloading process needs it

    log.info("downloading MNIST into %s", raw_dir(root))
    try:
        for train in (True, False):
            torchvision.datasets.MNIST(str(root), train=train, download=True)
    except Exception as e:  # noqa: BLE001 - torchvision raises RuntimeError, URLError, OSError...
        log.warning("MNIST download failed: %s", " ".join(str(e).split()) or type(e).__name__)


def _extract_archives(root: Path) -> None:
    raw = raw_dir(root)
    for name in ALL_FILES:
        if not (raw / name).exists():
            log.info("extracting %s", raw / f"{name}.gz")
            gunzip(raw / f"{name}.gz", raw / name)


def ensure_synthetic(root: Path) -> None:
    """Generates the default synthetic set into ``root`` unless one is there already."""
    with prepare_lock(root):
        if not is_synthetic_dir(root):
            log.info("rendering synthetic digits into %s (%s)", raw_dir(root),
                     ", ".join(f"{k} {v:,}" for k, v in DEFAULT_SYNTHETIC.items()))
            write_synthetic(root, **DEFAULT_SYNTHETIC)
        fingerprint(raw_dir(root), ALL_FILES)  # cached for every rank that loads the files


def write_synthetic(root: Path, train: int, test: int, seed: int) -> None:
    """Renders synthetic digits into ``root`` in MNIST's layout; the marker is written last."""
    from elastic_mnist.data.synth import generate

    raw = raw_dir(root)
    for offset, (split, count) in enumerate((("train", train), ("test", test))):
        images, labels = generate(count, seed=seed * 2 + offset)
        image_file, label_file = SPLIT_FILES[split]
        write_idx(raw / image_file, images)
        write_idx(raw / label_file, labels)
    marker = {"generator": "elastic_mnist.data.synth", "train": train, "test": test, "seed": seed}
    atomic_write_bytes(raw / SYNTHETIC_MARKER, json.dumps(marker, indent=2).encode())


# --- loading ----------------------------------------------------------------------------------


def load(root: Path, kind: str) -> Dataset:
    """Reads both splits from ``root`` into memory, validating every file."""
    raw = raw_dir(root)
    if kind == "synthetic" and not is_synthetic_dir(root):
        raise DataError(f"{raw} holds no synthetic digits; write them with `elastic-mnist synth`")
    splits = {}
    for split, (image_file, label_file) in SPLIT_FILES.items():
        images = read_idx(raw / image_file, IMAGES_MAGIC)
        labels = read_idx(raw / label_file, LABELS_MAGIC)
        if images.shape[1:] != (28, 28):
            raise DataError(f"{raw / image_file} holds images of shape {tuple(images.shape[1:])},"
                            f" expected 28x28")
        if len(images) != len(labels):
            raise DataError(f"{raw / image_file} has {len(images)} images but {raw / label_file} "
                            f"has {len(labels)} labels")
        if len(labels) and int(labels.max()) > 9:
            raise DataError(f"{raw / label_file} holds a label {int(labels.max())} outside 0-9")
        splits[split] = Digits(images, labels.long())
    return Dataset(train=splits["train"], test=splits["test"], kind=kind, root=Path(root),
                   fingerprint=fingerprint(raw, ALL_FILES))
