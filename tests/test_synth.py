"""The synthetic MNIST stand-in: deterministic, MNIST-shaped, learnable but not trivial."""

from __future__ import annotations

import hashlib

import pytest
import torch

from elastic_mnist.data import synth
from elastic_mnist.data.synth import generate, render_digits


@pytest.fixture(scope="module")
def train_set() -> tuple[torch.Tensor, torch.Tensor]:
    return generate(2000, seed=0)


def test_shapes_and_dtypes(train_set):
    images, labels = train_set
    assert images.shape == (2000, 28, 28) and images.dtype == torch.uint8
    assert labels.shape == (2000,) and labels.dtype == torch.uint8
    assert render_digits(torch.tensor([3, 1, 4]), seed=5).shape == (3, 28, 28)
    assert render_digits(torch.zeros(0, dtype=torch.int64), seed=5).shape == (0, 28, 28)


def test_same_seed_same_bytes_and_other_seed_differs(train_set):
    images, labels = train_set
    again_images, again_labels = generate(2000, seed=0)
    assert torch.equal(images, again_images) and torch.equal(labels, again_labels)
    other_images, other_labels = generate(2000, seed=1)
    assert not torch.equal(images, other_images) and not torch.equal(labels, other_labels)
    assert not torch.equal(render_digits(labels.long(), 7), render_digits(labels.long(), 8))


def test_bytes_are_pinned():
    """Same bytes on every machine; a renderer change changes every dataset, so update this too."""
    images, labels = generate(256, seed=0)
    digest = hashlib.sha256(images.numpy().tobytes() + labels.numpy().tobytes()).hexdigest()
    assert digest == "853b5fa04a7c1a2bf2db3dec846abf799d7f1709d00b7f689e52efddb93bcb6a"


def test_global_rng_untouched():
    state = torch.get_rng_state()
    generate(50, seed=3)
    assert torch.equal(state, torch.get_rng_state())


def test_sample_depends_only_on_seed_index_and_label(monkeypatch):
    labels = torch.randint(0, 10, (300,), generator=torch.Generator().manual_seed(9))
    reference = render_digits(labels, seed=11)
    monkeypatch.setattr(synth, "_CHUNK", 7)
    assert torch.equal(render_digits(labels, seed=11), reference)  # chunk size is irrelevant
    assert torch.equal(render_digits(labels[:50], seed=11), reference[:50])  # so is N
    relabelled = labels.clone()
    relabelled[100:] = (relabelled[100:] + 1) % 10
    assert torch.equal(render_digits(relabelled, seed=11)[:100], reference[:100])


def test_labels_cover_all_classes_roughly_evenly(train_set):
    _, labels = train_set
    counts = torch.bincount(labels.long(), minlength=10)
    assert counts.numel() == 10
    assert counts.min() >= 150 and counts.max() <= 250  # 200 expected per class


def test_pixel_statistics_look_like_mnist(train_set):
    images, _ = train_set
    assert 0.08 <= images.float().mean().item() / 255 <= 0.2  # MNIST: 0.13
    assert (images == 0).float().mean().item() >= 0.7  # MNIST: 0.81
    assert images.amax(dim=(1, 2)).min().item() >= 200  # every digit has full ink
    border = torch.cat([images[:, :2].flatten(1), images[:, -2:].flatten(1)], dim=1)
    assert (border == 0).float().mean().item() >= 0.97  # the digit sits inside the frame


def test_classes_are_learnable_but_varied(train_set):
    images, labels = train_set
    x = images.flatten(1).float() / 255
    means = torch.stack([x[labels == c].mean(0) for c in range(10)])
    test_images, test_labels = generate(1000, seed=1)
    test_x = test_images.flatten(1).float() / 255
    predicted = torch.cdist(test_x, means).argmin(1)
    accuracy = (predicted == test_labels.long()).float().mean().item()
    assert accuracy > 0.5, accuracy  # nearest class mean; 0.1 is chance, ~0.8 on MNIST itself

    between = torch.cdist(means, means).fill_diagonal_(float("inf")).amin(1)
    for c in range(10):
        within = torch.pdist(x[labels == c]).mean()  # mean pairwise distance inside the class
        assert within > between[c], (c, within, between[c])  # samples vary more than the classes
