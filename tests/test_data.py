import gzip
import os

import pytest
import torch

from elastic_mnist.data.datasets import (
    SPLIT_FILES,
    ensure_mnist,
    load,
    prepare,
    raw_dir,
    write_synthetic,
)
from elastic_mnist.data.idx import IMAGES_MAGIC, read_idx, write_idx
from elastic_mnist.errors import DataError


def fake_mnist(root, n_train=20, n_test=10, gz=False):
    raw = raw_dir(root)
    for split, n in (("train", n_train), ("test", n_test)):
        images = torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8)
        labels = torch.randint(0, 10, (n,), dtype=torch.uint8)
        for name, tensor in zip(SPLIT_FILES[split], (images, labels)):
            write_idx(raw / name, tensor)
            if gz:
                (raw / f"{name}.gz").write_bytes(gzip.compress((raw / name).read_bytes()))
                (raw / name).unlink()


def test_idx_round_trip(tmp_path):
    images = torch.randint(0, 256, (5, 28, 28), dtype=torch.uint8)
    write_idx(tmp_path / "x", images)
    assert torch.equal(read_idx(tmp_path / "x", IMAGES_MAGIC), images)


@pytest.mark.parametrize("cut, words", [(-1, "truncated"), (10, "truncated"),
                                        (None, r"corrupt \(trailing")])
def test_damaged_idx_file_is_named(tmp_path, cut, words):
    write_idx(tmp_path / "imgs", torch.zeros(3, 28, 28, dtype=torch.uint8))
    data = (tmp_path / "imgs").read_bytes()
    (tmp_path / "imgs").write_bytes(data[:cut] if cut else data + b"xx")
    with pytest.raises(DataError, match=rf"imgs is {words}"):
        read_idx(tmp_path / "imgs", IMAGES_MAGIC)


def test_wrong_magic_is_named(tmp_path):
    write_idx(tmp_path / "labels", torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(DataError, match="labels is not an IDX file"):
        read_idx(tmp_path / "labels", IMAGES_MAGIC)


def test_gz_files_as_distributed_are_extracted(tmp_path):
    fake_mnist(tmp_path, gz=True)
    ensure_mnist(tmp_path, download=False)
    data = load(tmp_path, "mnist")
    assert (len(data.train), len(data.test)) == (20, 10)
    assert all((raw_dir(tmp_path) / n).exists() for names in SPLIT_FILES.values() for n in names)


def test_corrupt_gz_is_named(tmp_path):
    fake_mnist(tmp_path, gz=True)
    bad = raw_dir(tmp_path) / "train-labels-idx1-ubyte.gz"
    bad.write_bytes(bad.read_bytes()[:15])
    with pytest.raises(DataError, match="train-labels-idx1-ubyte.gz is corrupt or truncated"):
        ensure_mnist(tmp_path, download=False)


def test_missing_mnist_says_which_files_where(tmp_path):
    with pytest.raises(DataError) as error:
        prepare(tmp_path, "mnist", download=False, synthetic_fallback=False)
    message = str(error.value)
    assert str(raw_dir(tmp_path)) in message and "t10k-labels-idx1-ubyte" in message
    assert "\n" not in message


def test_synthetic_reads_exactly_what_synth_wrote(tmp_path):
    write_synthetic(tmp_path, train=30, test=12, seed=4)
    assert prepare(tmp_path, "synthetic", download=False, synthetic_fallback=False) == "synthetic"
    data = load(tmp_path, "synthetic")
    assert (len(data.train), len(data.test)) == (30, 12)
    images, _ = data.train.batch(torch.tensor([0, 1]))
    assert images.shape == (2, 1, 28, 28) and images.dtype == torch.float32
    with pytest.raises(DataError, match="synthetic"):  # never mistaken for MNIST
        ensure_mnist(tmp_path, download=False)


def test_fallback_generates_synthetic_beside_not_instead(tmp_path, monkeypatch):
    from elastic_mnist.data import datasets

    monkeypatch.setattr(datasets, "DEFAULT_SYNTHETIC", {"train": 20, "test": 10, "seed": 0})
    kind = prepare(tmp_path, "mnist", download=False, synthetic_fallback=True)
    assert kind == "synthetic"
    assert len(load(tmp_path / "synthetic", "synthetic").train) == 20
    assert not raw_dir(tmp_path).joinpath("train-images-idx3-ubyte").exists()


def test_fingerprint_is_cached_beside_the_files_and_follows_them(tmp_path):
    from elastic_mnist.data.fingerprint import CACHE

    fake_mnist(tmp_path)
    ensure_mnist(tmp_path, download=False)  # prepares, and caches the fingerprint
    raw = raw_dir(tmp_path)
    assert (raw / CACHE).exists()
    first = load(tmp_path, "mnist").fingerprint
    assert len(first) == 64 and load(tmp_path, "mnist").fingerprint == first

    labels = raw / SPLIT_FILES["test"][1]
    before = labels.stat()
    last = labels.read_bytes()[-1]
    with open(labels, "r+b") as f:  # another label, same size, same times: the cache answers
        f.seek(-1, os.SEEK_END)
        f.write(bytes([(last + 1) % 10]))
    os.utime(labels, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert load(tmp_path, "mnist").fingerprint == first
    os.utime(labels, ns=(before.st_atime_ns, before.st_mtime_ns + 1))  # touched: hashed anew
    assert load(tmp_path, "mnist").fingerprint != first


def test_fingerprint_differs_between_datasets_of_one_shape(tmp_path):
    write_synthetic(tmp_path / "a", train=30, test=10, seed=1)
    write_synthetic(tmp_path / "b", train=30, test=10, seed=2)
    assert load(tmp_path / "a", "synthetic").fingerprint != \
        load(tmp_path / "b", "synthetic").fingerprint
