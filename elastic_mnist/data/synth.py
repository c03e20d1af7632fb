"""A learnable synthetic stand-in for MNIST, rendered from hand-drawn stroke paths.

Each digit class has a couple of glyph variants, written below as strokes (polylines, arcs and
Bézier curves) in a unit box: x to the right, y downwards, the glyph filling the box's height.
Every sample picks a variant, bends its control points with a smooth random warp, maps them by a
random affine (scale, aspect, slant, rotation, shift) into the 28x28 frame and renders the strokes
as a distance-to-segment field with a soft (antialiased) edge, a random stroke width and mild
multiplicative pixel noise: uint8 images, background 0, ink up to 255, the digit in a ~20x20 box.

Sample ``i`` depends only on ``seed``, ``i`` and its label: its parameters are one row of a
table drawn up front from a ``torch.Generator``, and its pixel noise is an integer hash of its
own key and the pixel index, so rendering in chunks changes nothing.

The bytes are the same on every machine, every CPU kernel path and any thread count: rendering
uses only float32 operations that IEEE 754 rounds exactly (+, -, *, /, sqrt), elementwise, and
min-reductions (exact in any order); no BLAS and no transcendental functions. One of them needs
care: torch's CPU ``sqrt`` goes through MKL's vector math, which is not correctly rounded and
whose result depends on the processor (a fifth of float32 results differ from IEEE's by an ulp
on an AMD EPYC), so square roots are taken by numpy, whose every SIMD path uses the processor's
own square-root instruction.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch

SIZE = 28
"""Images are SIZE x SIZE pixels."""
_CHUNK = 64
"""Samples rendered at once; any value gives the same images."""


def _arc(cx, cy, rx, ry, start, stop):
    """Points on an ellipse from angle ``start`` to ``stop`` (degrees, counter-clockwise as seen)."""
    n = max(2, round(abs(stop - start) / 30))
    angles = [math.radians(start + (stop - start) * k / n) for k in range(n + 1)]
    # rounded, so that libm's last-bit differences between machines cannot reach the table
    return [(round(cx + rx * math.cos(a), 6), round(cy - ry * math.sin(a), 6)) for a in angles]


def _curve(p0, p1, p2, n=5):
    """Points on the quadratic Bézier curve from ``p0`` to ``p2`` pulled towards ``p1``."""
    ts = [k / n for k in range(n + 1)]
    return [
        tuple(
            (1 - t) * (1 - t) * a + 2 * (1 - t) * t * b + t * t * c for a, b, c in zip(p0, p1, p2)
        )
        for t in ts
    ]


GLYPHS: dict[int, list[list[list[tuple[float, float]]]]] = {
    0: [
        [_arc(0.5, 0.5, 0.32, 0.5, 95, 455)],  # round
        [_arc(0.5, 0.5, 0.24, 0.5, 60, 440)],  # narrow, overshooting its start
    ],
    1: [
        [[(0.5, 0.0), (0.5, 1.0)]],  # a bar
        [[(0.3, 0.2), (0.55, 0.0), (0.55, 1.0)]],  # with a flag
    ],
    2: [
        # straight neck
        [_arc(0.5, 0.28, 0.3, 0.28, 160, -20) + [(0.15, 1.0), (0.88, 1.0)]],
        # curved neck
        [
            _arc(0.5, 0.3, 0.32, 0.3, 170, -40)
            + _curve((0.75, 0.49), (0.4, 0.75), (0.15, 0.98))
            + [(0.85, 0.96)]
        ],
    ],
    3: [
        # two bows
        [_arc(0.5, 0.25, 0.28, 0.25, 160, -90) + _arc(0.5, 0.74, 0.32, 0.26, 90, -160)],
        # flat top
        [[(0.2, 0.0), (0.8, 0.0), (0.45, 0.4)] + _arc(0.5, 0.7, 0.32, 0.3, 100, -155)],
    ],
    4: [
        [[(0.62, 0.0), (0.12, 0.68), (0.88, 0.68)], [(0.66, 0.25), (0.66, 1.0)]],  # closed
        [[(0.22, 0.0), (0.18, 0.58), (0.85, 0.58)], [(0.68, 0.0), (0.68, 1.0)]],  # open
    ],
    5: [
        # round belly
        [[(0.8, 0.0), (0.3, 0.0), (0.25, 0.47)] + _arc(0.48, 0.68, 0.3, 0.3, 140, -150)],
        # pointed belly
        [
            [(0.78, 0.0), (0.28, 0.02), (0.22, 0.42)]
            + _curve((0.22, 0.42), (0.8, 0.25), (0.75, 0.7))
            + _curve((0.75, 0.7), (0.7, 1.0), (0.2, 0.92))
        ],
    ],
    6: [
        # arched stem
        [_arc(0.95, 0.72, 0.72, 0.7, 100, 180) + _arc(0.5, 0.72, 0.27, 0.27, 180, 540)],
        # leaning stem, small loop
        [_curve((0.7, 0.0), (0.25, 0.25), (0.24, 0.74)) + _arc(0.48, 0.74, 0.24, 0.24, 180, 530)],
    ],
    7: [
        # plain
        [[(0.15, 0.02), (0.85, 0.02), (0.4, 1.0)]],
        # bent, with a crossbar
        [
            [(0.15, 0.05), (0.85, 0.0)] + _curve((0.85, 0.0), (0.55, 0.45), (0.5, 1.0)),
            [(0.38, 0.5), (0.78, 0.5)],
        ],
    ],
    8: [
        [_arc(0.5, 0.25, 0.24, 0.25, -90, 270), _arc(0.5, 0.73, 0.3, 0.27, 90, 450)],  # even
        [_arc(0.52, 0.27, 0.2, 0.27, -90, 270), _arc(0.48, 0.75, 0.28, 0.25, 90, 450)],  # top-light
    ],
    9: [
        # curved stem
        [_arc(0.5, 0.28, 0.27, 0.28, 0, 360) + _curve((0.77, 0.28), (0.76, 0.7), (0.68, 1.0))],
        # straight stem
        [_arc(0.5, 0.25, 0.27, 0.25, 0, 360), [(0.77, 0.25), (0.77, 1.0)]],
    ],
}
"""Per digit, its glyph variants; a glyph is a list of strokes, a stroke a list of (x, y)."""


def _segment_table() -> tuple[torch.Tensor, ...]:
    """All glyphs as segments ``[G, S, 2 ends, 2 coords]``, padded by repeating a segment.

    Also returns each glyph's number of segments and, per digit, the index of its first glyph and
    its number of variants.
    """
    glyphs, first, count = [], [], []
    for digit in range(10):
        first.append(len(glyphs))
        count.append(len(GLYPHS[digit]))
        for strokes in GLYPHS[digit]:
            segments = [(p, q) for stroke in strokes for p, q in itertools.pairwise(stroke)]
            glyphs.append([(p, q) for p, q in segments if math.dist(p, q) > 1e-3])  # no joins
    longest = max(map(len, glyphs))
    padded = [segs + segs[:1] * (longest - len(segs)) for segs in glyphs]
    lengths = [len(segs) for segs in glyphs]
    return tuple(map(torch.tensor, (padded, lengths, first, count)))


_SEGMENTS, _NUM_SEGMENTS, _FIRST_GLYPH, _NUM_VARIANTS = _segment_table()

PARAM_RANGES: dict[str, tuple[float, float]] = {
    "variant": (0.0, 1.0),  # which glyph variant of the digit
    "height": (16.0, 21.0),  # pixels spanned by the unit box's height
    "aspect": (0.75, 1.2),  # width / height scale
    "slant": (-0.15, 0.45),  # horizontal shear; positive leans the top to the right
    "tan_half_angle": (-0.1, 0.1),  # of the rotation: about +-11 degrees
    "shift_x": (-2.0, 2.0),  # pixels
    "shift_y": (-2.0, 2.0),
    "bow_x": (-0.12, 0.12),  # smooth warp of the unit box, see _warp
    "bow_y": (-0.12, 0.12),
    "taper_x": (-0.15, 0.15),
    "taper_y": (-0.15, 0.15),
    "radius": (0.8, 1.7),  # half the stroke width, pixels
    "softness": (0.7, 1.5),  # width of the antialiased edge, pixels
    "noise": (0.0, 0.5),  # amplitude of multiplicative pixel noise
}
"""Per-sample random parameters, each uniform in its range."""


def _sample_params(n: int, seed: int) -> dict[str, torch.Tensor]:
    """One row of parameters per sample, and a 32-bit ``noise_key``; row i depends on i alone."""
    gen = torch.Generator().manual_seed(seed)
    uniform = torch.rand(n, len(PARAM_RANGES) + 1, generator=gen, dtype=torch.float64)
    params = {
        name: (lo + (hi - lo) * uniform[:, j]).float()
        for j, (name, (lo, hi)) in enumerate(PARAM_RANGES.items())
    }
    params["noise_key"] = (uniform[:, -1] * 2**32).long()
    return params


def _warp(x: torch.Tensor, y: torch.Tensor, p: dict[str, torch.Tensor]):
    """Bend unit-box coordinates (centred at 0) by a smooth quadratic warp."""
    return (
        x + p["bow_x"] * (y * y) + p["taper_x"] * (x * y),
        y + p["bow_y"] * (x * x) + p["taper_y"] * (x * y),
    )


def _place(segments: torch.Tensor, p: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Map unit-box segment ends ``[C, S, 2, 2]`` to pixel coordinates (x, y), each ``[C, S, 2]``."""
    p = {name: value[:, None, None] for name, value in p.items()}
    x, y = _warp(segments[..., 0] - 0.5, segments[..., 1] - 0.5, p)
    x, y = x * (p["height"] * p["aspect"]), y * p["height"]
    x = x - p["slant"] * y
    t = p["tan_half_angle"]  # rational rotation: cos = (1 - t^2) / (1 + t^2), sin = 2t / (1 + t^2)
    cos, sin = (1 - t * t) / (1 + t * t), (2 * t) / (1 + t * t)
    centre = (SIZE - 1) / 2
    return (
        cos * x - sin * y + (centre + p["shift_x"]),
        sin * x + cos * y + (centre + p["shift_y"]),
    )


def exact_sqrt(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root of a CPU tensor, the same bytes on every processor."""
    return torch.from_numpy(np.sqrt(x.numpy()))


def _distance(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Distance ``[C, SIZE, SIZE]`` from each pixel centre to the nearest segment.

    Splits the offset from a segment into its part across the segment's line and its overshoot
    beyond the segment's ends; both are sums of a per-row and a per-column term.
    """
    ax, ay = x[..., 0, None, None], y[..., 0, None, None]  # [C, S, 1, 1]
    ex, ey = x[..., 1, None, None] - ax, y[..., 1, None, None] - ay
    length = exact_sqrt(ex * ex + ey * ey).clamp_min(1e-3)
    ux, uy, half = ex / length, ey / length, length / 2
    grid = torch.arange(SIZE, dtype=torch.float32)
    dx, dy = grid - ax, grid[:, None] - ay  # [C, S, 1, SIZE] and [C, S, SIZE, 1]
    across = (dx * uy) - (dy * ux)
    beyond = (dx * ux - half) + (dy * uy)  # signed distance along the line from the midpoint
    beyond.abs_().sub_(half).clamp_min_(0)
    return exact_sqrt(across.square_().add_(beyond.square_()).amin(dim=1))


def _hash_uniform(counter: torch.Tensor) -> torch.Tensor:
    """Uniform floats in [0, 1) from a 32-bit integer hash of int64 ``counter``."""
    mask = 0xFFFFFFFF
    x = counter & mask
    x = ((x >> 16) ^ x) * 0x45D9F3B & mask
    x = ((x >> 16) ^ x) * 0x45D9F3B & mask
    x = (x >> 16) ^ x
    return (x & 0xFFFFFF).float() / 2**24


def _glyph_index(labels: torch.Tensor, variant: torch.Tensor) -> torch.Tensor:
    """Index into the glyph table of each label's variant, chosen by ``variant`` in [0, 1)."""
    count = _NUM_VARIANTS[labels]
    return _FIRST_GLYPH[labels] + (variant * count).long().clamp_max(count - 1)


def _render_chunk(glyph: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    """Render one chunk of samples to uint8 ``[C, SIZE, SIZE]``."""
    segments = _SEGMENTS[glyph, : _NUM_SEGMENTS[glyph].max()]  # drop padding none of them need
    x, y = _place(segments, p)
    r, soft, noise = (p[name][:, None, None] for name in ("radius", "softness", "noise"))
    ink = ((r - _distance(x, y)) / soft + 0.5).clamp(0, 1)
    pixel = torch.arange(SIZE * SIZE).view(SIZE, SIZE)
    gain = 1.05 + noise * (_hash_uniform(p["noise_key"][:, None, None] + pixel) - 0.5)
    return (ink * gain).clamp(0, 1).mul(255).round().to(torch.uint8)


def render_digits(labels: torch.Tensor, seed: int) -> torch.Tensor:
    """uint8 tensor [N, 28, 28] of digits of the given int64 labels [N], deterministic from seed."""
    params = _sample_params(len(labels), seed)
    glyph = _glyph_index(labels.long(), params["variant"])
    images = torch.empty(len(labels), SIZE, SIZE, dtype=torch.uint8)
    order = torch.argsort(glyph, stable=True)  # chunks of one glyph carry little padding
    for start in range(0, len(order), _CHUNK):
        idx = order[start : start + _CHUNK]
        images[idx] = _render_chunk(glyph[idx], {k: v[idx] for k, v in params.items()})
    return images


def generate(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(images uint8 [n,28,28], labels uint8 [n]) with labels drawn uniformly-ish from 0-9."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=gen)
    render_seed = int(torch.randint(0, 2**62, (), generator=gen))
    return render_digits(labels, render_seed), labels.to(torch.uint8)
