from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

pytest_plugins = ["shared_runs"]  # the expensive runs, launched once and shared

REAL_MNIST = Path(__file__).resolve().parents[2] / "shared" / "mnist-t10k"


def pytest_configure(config):
    """SIGINT as a terminal's shell leaves it, for the launches that tests Ctrl-C. A shell's
    background job (a CI runner's, ``make test &``) starts with SIGINT ignored, and an ignored
    signal stays ignored in every child, through exec and traps alike: the jobs would never see
    their Ctrl-C. A handler of this process's own is reset to the default in each child."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # The tests' own tensor work, in this process, on one thread: the suite runs in as many
    # processes as cores, and torch's default (a thread per core in each) oversubscribes them.
    # The jobs the tests launch get the environment each test gives them, as before.
    import torch

    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` run where a CUDA GPU is visible and are skipped elsewhere; the
    slow tests are handed out first, so that the suite's last minute is not one long test on one
    core while the other idles."""
    import torch

    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable

    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None and not torch.cuda.is_available():
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_digits(tmp_path_factory) -> Path:
    """A small synthetic dataset (640 train, 256 test) written once by `elastic-mnist synth`."""
    from elastic_mnist.data.datasets import write_synthetic

    root = tmp_path_factory.mktemp("tiny-digits")
    write_synthetic(root, train=640, test=256, seed=3)
    return root


@pytest.fixture(scope="session")
def real_split(tmp_path_factory) -> Path:
    """The real MNIST test digits as an 8,000/2,000 train/test split; skips when absent."""
    if not REAL_MNIST.is_dir():
        pytest.skip(f"real MNIST digits not found at {REAL_MNIST}")
    import gzip

    from elastic_mnist.data.idx import IMAGES_MAGIC, LABELS_MAGIC, read_idx, write_idx

    root = tmp_path_factory.mktemp("real-split")
    raw = root / "MNIST" / "raw"
    tmp = root / "unpacked"
    tmp.mkdir()
    for name in ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        (tmp / name).write_bytes(gzip.decompress((REAL_MNIST / f"{name}.gz").read_bytes()))
    images = read_idx(tmp / "t10k-images-idx3-ubyte", IMAGES_MAGIC)
    labels = read_idx(tmp / "t10k-labels-idx1-ubyte", LABELS_MAGIC)
    for prefix, sl in (("train", slice(0, 8000)), ("t10k", slice(8000, 10000))):
        write_idx(raw / f"{prefix}-images-idx3-ubyte", images[sl])
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels[sl])
    return root


@pytest.fixture(autouse=True)
def _the_dropped_line_said_anew():
    """A process says its leaving line once (errors.first_to_say_dropped); each test here is
    a process of its own in that respect."""
    yield
    from elastic_mnist import errors

    if errors._SAYING_DROPPED.locked():
        errors._SAYING_DROPPED.release()
