"""The synthetic MNIST stand-in: deterministic, MNIST-shaped, learnable but not trivial."""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from launch import clean_env

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


def test_same_seed_same_bytes_and_other_seed_differs():
    images, labels = generate(300, seed=0)
    again_images, again_labels = generate(300, seed=0)
    assert torch.equal(images, again_images) and torch.equal(labels, again_labels)
    other_images, other_labels = generate(300, seed=1)
    assert not torch.equal(images, other_images) and not torch.equal(labels, other_labels)
    assert not torch.equal(render_digits(labels.long(), 7), render_digits(labels.long(), 8))


PINNED = "2277f188ecbe2ef02a426d4c0edd7a96478e56d66951e48cee39567ce55df959"
"""sha256 of ``generate(256, seed=0)``: the same on every machine. A renderer change changes every
dataset, so update this too."""


def digest_of(images: torch.Tensor, labels: torch.Tensor) -> str:
    return hashlib.sha256(images.numpy().tobytes() + labels.numpy().tobytes()).hexdigest()


def test_bytes_are_pinned():
    assert digest_of(*generate(256, seed=0)) == PINNED


def test_pinned_set_takes_every_path():
    """The pinned samples hold a break, a stray mark and a confusable glyph, so the digest checked
    on every kernel path covers the code that draws them."""
    labels, render_seed = synth.draw_labels(256, seed=0)
    params = synth._sample_params(256, render_seed)
    glyph = synth._glyph_index(labels, params["variant"])
    odd = torch.tensor([len(synth.CONFUSABLE.get(digit, [])) for digit in range(10)])
    confusable = glyph < synth._FIRST_GLYPH[labels] + odd[labels]  # they come first
    assert (params["gap"] < synth.GAP_SHARE).any() and (params["stray"] < synth.STRAY_SHARE).any()
    assert confusable.any()


def test_every_glyph_is_drawn(train_set):
    labels, render_seed = synth.draw_labels(2000, seed=0)
    glyph = synth._glyph_index(labels, synth._sample_params(2000, render_seed)["variant"])
    assert torch.equal(glyph.unique(), torch.arange(len(synth._NUM_SEGMENTS)))
    assert torch.equal(labels.to(torch.uint8), train_set[1])  # the labels generate() drew


def test_wobbled_strokes_stay_joined():
    """Ends that are one point of a glyph land on one pixel position, however they wobble."""
    glyphs = torch.arange(len(synth._NUM_SEGMENTS))
    params = synth._sample_params(len(glyphs), seed=4)
    params["wobble"] = torch.full_like(params["wobble"], synth.PARAM_RANGES["wobble"][1])
    x, y = synth._place(synth._SEGMENTS[glyphs], synth._POINTS[glyphs], params)
    for g in glyphs:
        ends = list(zip(synth._POINTS[g].flatten().tolist(), x[g].flatten().tolist(),
                        y[g].flatten().tolist()))
        where = {number: (px, py) for number, px, py in ends}
        assert all(where[number] == (px, py) for number, px, py in ends), int(g)


def test_distance_to_a_segment_and_to_a_point():
    x = torch.tensor([[[2.0, 6.0], [20.0, 20.0]]])  # one sample: a segment, and a point
    y = torch.tensor([[[3.0, 3.0], [10.0, 10.0]]])
    distance = synth._distance(x, y)[0]
    assert distance[3, 4] == 0 and distance[5, 4] == 2 and distance[3, 9] == 3  # row y, column x
    assert distance[10, 20] == 0 and distance[14, 17] == 5


RENDER_IN_CHILD = """
import hashlib, json, torch
from numpy._core._multiarray_umath import __cpu_features__ as numpy_features
from elastic_mnist.data.synth import generate
images, labels = generate(256, seed=0)
print(json.dumps({
    "capability": torch.backends.cpu.get_cpu_capability(),
    "threads": torch.get_num_threads(),
    "numpy_avx2": numpy_features["X86_V3"], "numpy_avx512": numpy_features["X86_V4"],
    "digest": hashlib.sha256(images.numpy().tobytes() + labels.numpy().tobytes()).hexdigest(),
}))
"""
NUMPY_BASELINE_ONLY = {"NPY_DISABLE_CPU_FEATURES": "X86_V4 X86_V3 AVX512_ICL AVX512_SPR"}


def test_bytes_match_on_every_cpu_kernel_path():
    """Each torch CPU capability this machine has, numpy's baseline path, 1 and 2 threads.

    AVX-512 only where the processor has it: asked for elsewhere, torch's kernels die of an
    illegal instruction (an AMD with AVX2 only, say)."""
    variants = [{"ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "1", **NUMPY_BASELINE_ONLY},
                {"ATEN_CPU_CAPABILITY": "avx2", "OMP_NUM_THREADS": "2"}]
    if torch.cpu._is_avx512_supported():
        variants.append({"ATEN_CPU_CAPABILITY": "avx512", "OMP_NUM_THREADS": "1"})
    children = [subprocess.Popen([sys.executable, "-c", RENDER_IN_CHILD], text=True,
                                 stdout=subprocess.PIPE, env={**clean_env(), **extra})
                for extra in variants]
    outputs = [child.communicate(timeout=120)[0] for child in children]
    assert all(child.returncode == 0 for child in children), (variants, outputs)
    results = [json.loads(output) for output in outputs]
    assert {"DEFAULT", "AVX2"} <= {r["capability"] for r in results}, results  # AVX512 if here
    assert any(not r["numpy_avx2"] for r in results), results  # numpy's baseline path ran
    assert {r["digest"] for r in results} == {PINNED}, results


def test_exact_sqrt_is_correctly_rounded():
    """torch's CPU sqrt is not (MKL's vector math); the renderer's must be, on every machine."""
    values = torch.rand(20_000, generator=torch.Generator().manual_seed(0)) * 1000
    expected = torch.tensor([np.float32(math.sqrt(v)) for v in values.double().tolist()])
    assert torch.equal(synth.exact_sqrt(values), expected)
    assert torch.equal(synth.exact_sqrt(values[::3]), expected[::3])  # strided too


def test_global_rng_untouched():
    state = torch.get_rng_state()
    generate(50, seed=3)
    assert torch.equal(state, torch.get_rng_state())


def test_sample_depends_only_on_seed_index_and_label(monkeypatch):
    labels = torch.randint(0, 10, (120,), generator=torch.Generator().manual_seed(9))
    reference = render_digits(labels, seed=11)
    monkeypatch.setattr(synth, "_CHUNK", 7)
    assert torch.equal(render_digits(labels, seed=11), reference)  # chunk size is irrelevant
    assert torch.equal(render_digits(labels[:30], seed=11), reference[:30])  # so is N
    relabelled = labels.clone()
    relabelled[80:] = (relabelled[80:] + 1) % 10
    assert torch.equal(render_digits(relabelled, seed=11)[:80], reference[:80])


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
    assert accuracy > 0.5, accuracy  # nearest class mean; 0.1 is chance, ~0.8 on MNIST, 0.69 here

    between = torch.cdist(means, means).fill_diagonal_(float("inf")).amin(1)
    for c in range(10):
        within = torch.pdist(x[labels == c]).mean()  # mean pairwise distance inside the class
        assert within > between[c], (c, within, between[c])  # samples vary more than the classes
