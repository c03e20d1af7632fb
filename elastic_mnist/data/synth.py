"""A synthetic stand-in for MNIST, rendered from hand-drawn stroke paths, about as hard as MNIST.

Each digit class has several glyph variants, written below as strokes (polylines, arcs and
Bézier curves) in a unit box: x to the right, y downwards, the glyph filling the box's height.
Every sample picks a variant, moves each of its control points by its own small random offset
(a wobbly hand), bends the whole glyph with a smooth random warp, maps it by a random affine
(scale, aspect, slant, rotation, shift) into the 28x28 frame and renders the strokes as a
distance-to-segment field with a soft (antialiased) edge: uint8 images, background 0, ink up to
255, the digit in a ~20x20 box.

Why it is not too easy. On neat renderings (two variants a class, mild geometry) the job's
ConvNet reached 99.98% in two epochs, and then accuracy says nothing. So the renderer copies
what makes real handwriting hard:

- shape: three or four common variants a class (a 7 with a crossbar or a serif, an open or
  closed 4, a 1 with a flag or a foot, a 9 with a straight, curved or hooked tail, a 2 with a
  loop, a 3 with a pointed waist, a 5 whose bar is a stroke of its own, an 8 in one stroke);
- geometry: rotation up to 14 degrees, slant, aspect, size and position, a smooth warp of the
  whole glyph and a wobble of each control point of its own (a shaky hand);
- ink: the stroke width varies over the glyph (pen pressure: a random gradient across the
  frame) as well as between samples, and the pixels carry mild multiplicative noise;
- accidents: in GAP_SHARE of the samples a stroke breaks where the pen lifted, in STRAY_SHARE
  a stray mark lies beside the digit;
- ambiguity: CONFUSABLE_SHARE of eight classes is drawn from glyphs halfway to another class
  (a 1 or a 7 between the two, 3/8, 8/3, 4/9, 9/4, 5/3, 6/0), as MNIST's worst-written digits
  are. A quarter of them are misread after two epochs and a fifth after five (half of the 1/7
  pair): some 0.3% of error that training hardly removes. The rest of the error (0.6% after two
  epochs, 0.4% after five) is learnt away, so accuracy still tells good training from bad.

The result, trained with the default flags on the default 60,000 / 10,000 set on CPU
(``elastic-mnist train --dataset synthetic --data-dir D --epochs E --seed S``, then
``elastic-mnist evaluate --json``): 98.4% after 1 epoch, 98.9% after 2 (model seeds 1 and 2:
98.92% and 98.85%) and 99.3% after 5 (seed 1).

Sample ``i`` depends only on ``seed``, ``i`` and its label: its parameters are one row of a
table drawn up front from a ``torch.Generator``, and its pixel noise and point wobble are
integer hashes of its own keys and the pixel or point, so rendering in chunks changes nothing.

The bytes are the same on every machine, every CPU kernel path and any thread count: rendering
uses only float32 operations that IEEE 754 rounds exactly (+, -, *, /, sqrt), elementwise, and
min-reductions (exact in any order); no BLAS and no transcendental functions (the tables below
that need them are computed once in Python and rounded, see ``_arc``). One of them needs care:
torch's CPU ``sqrt`` goes through MKL's vector math, which is not correctly rounded and whose
result depends on the processor (a fifth of float32 results differ from IEEE's by an ulp on an
AMD EPYC), so square roots are taken by numpy, whose every SIMD path uses the processor's own
square-root instruction.
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
        [_arc(0.5, 0.5, 0.3, 0.5, 115, 420)],  # not closed at the top
    ],
    1: [
        [[(0.5, 0.0), (0.5, 1.0)]],  # a bar
        [[(0.3, 0.2), (0.55, 0.0), (0.55, 1.0)]],  # with a flag
        [[(0.3, 0.2), (0.55, 0.0), (0.55, 1.0)], [(0.3, 1.0), (0.8, 1.0)]],  # flag and foot
        [_curve((0.56, 0.0), (0.4, 0.5), (0.48, 1.0))],  # bowed
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
        # a loop where the neck meets the base
        [
            _arc(0.5, 0.28, 0.3, 0.28, 160, -30)
            + _curve((0.76, 0.42), (0.45, 0.78), (0.22, 0.95))
            + _curve((0.22, 0.95), (0.05, 0.72), (0.3, 0.8))
            + _curve((0.3, 0.8), (0.42, 0.97), (0.6, 0.97))
            + [(0.88, 0.95)]
        ],
        # flat top, sharp corner
        [_arc(0.45, 0.22, 0.3, 0.22, 160, 0) + [(0.18, 1.0), (0.85, 1.0)]],
    ],
    3: [
        # two bows
        [_arc(0.5, 0.25, 0.28, 0.25, 160, -90) + _arc(0.5, 0.74, 0.32, 0.26, 90, -160)],
        # flat top
        [[(0.2, 0.0), (0.8, 0.0), (0.45, 0.4)] + _arc(0.5, 0.7, 0.32, 0.3, 100, -155)],
        # pointed waist
        [
            _arc(0.5, 0.25, 0.28, 0.25, 160, -60)
            + [(0.35, 0.5)]
            + _arc(0.5, 0.75, 0.32, 0.25, 60, -160)
        ],
    ],
    4: [
        [[(0.62, 0.0), (0.12, 0.68), (0.88, 0.68)], [(0.66, 0.25), (0.66, 1.0)]],  # closed
        [[(0.22, 0.0), (0.18, 0.58), (0.85, 0.58)], [(0.68, 0.0), (0.68, 1.0)]],  # open
        [[(0.3, 0.0), (0.12, 0.55), (0.88, 0.55)], [(0.72, 0.1), (0.62, 1.0)]],  # open, leaning
        [[(0.55, 0.0), (0.1, 0.62), (0.9, 0.62)], [(0.6, 0.0), (0.6, 1.0)]],  # closed, tall stem
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
        # the bar a stroke of its own
        [
            [(0.3, 0.04), (0.25, 0.45)] + _arc(0.48, 0.68, 0.3, 0.3, 140, -150),
            [(0.34, 0.0), (0.84, -0.02)],
        ],
    ],
    6: [
        # arched stem
        [_arc(0.95, 0.72, 0.72, 0.7, 100, 180) + _arc(0.5, 0.72, 0.27, 0.27, 180, 540)],
        # leaning stem, small loop
        [_curve((0.7, 0.0), (0.25, 0.25), (0.24, 0.74)) + _arc(0.48, 0.74, 0.24, 0.24, 180, 530)],
        # straight stem
        [[(0.68, 0.0)] + _arc(0.5, 0.72, 0.25, 0.26, 163, 523)],
    ],
    7: [
        # plain
        [[(0.15, 0.02), (0.85, 0.02), (0.4, 1.0)]],
        # bent, with a crossbar
        [
            [(0.15, 0.05), (0.85, 0.0)] + _curve((0.85, 0.0), (0.55, 0.45), (0.5, 1.0)),
            [(0.38, 0.5), (0.78, 0.5)],
        ],
        # with a serif
        [[(0.15, 0.22), (0.15, 0.02), (0.85, 0.02), (0.42, 1.0)]],
        # bent
        [[(0.15, 0.03), (0.85, 0.0)] + _curve((0.85, 0.0), (0.5, 0.4), (0.45, 1.0))],
    ],
    8: [
        [_arc(0.5, 0.25, 0.24, 0.25, -90, 270), _arc(0.5, 0.73, 0.3, 0.27, 90, 450)],  # even
        [_arc(0.52, 0.27, 0.2, 0.27, -90, 270), _arc(0.48, 0.75, 0.28, 0.25, 90, 450)],  # top-light
        # one stroke, crossing itself
        [
            _arc(0.5, 0.22, 0.22, 0.22, 30, 200)
            + _curve((0.293, 0.295), (0.3, 0.45), (0.707, 0.589))
            + _arc(0.5, 0.75, 0.27, 0.25, 40, -200)
            + _curve((0.246, 0.665), (0.35, 0.45), (0.72, 0.26))
        ],
    ],
    9: [
        # curved stem
        [_arc(0.5, 0.28, 0.27, 0.28, 0, 360) + _curve((0.77, 0.28), (0.76, 0.7), (0.68, 1.0))],
        # straight stem
        [_arc(0.5, 0.25, 0.27, 0.25, 0, 360), [(0.77, 0.25), (0.77, 1.0)]],
        # hooked tail
        [
            _arc(0.5, 0.27, 0.27, 0.27, 0, 360)
            + _curve((0.77, 0.27), (0.8, 0.95), (0.5, 1.0))
            + [(0.3, 0.9)]
        ],
        # small loop, leaning stem
        [_arc(0.55, 0.22, 0.22, 0.22, 0, 360) + [(0.6, 1.0)]],
    ],
}
"""Per digit, its common glyph variants; a glyph is a list of strokes, a stroke a list of (x, y)."""

CONFUSABLE: dict[int, list[list[list[tuple[float, float]]]]] = {
    1: [[[(0.22, 0.12), (0.62, 0.0), (0.54, 1.0)]]],  # a long flag: a 7?
    3: [[_arc(0.5, 0.25, 0.26, 0.25, 200, -90) + _arc(0.5, 0.74, 0.3, 0.26, 90, -200)]],  # an 8?
    4: [  # its top closed: a 9?
        [[(0.6, 0.02)] + _curve((0.6, 0.02), (0.05, 0.1), (0.25, 0.5)) + [(0.85, 0.5)],
         [(0.68, 0.0), (0.68, 1.0)]],
    ],
    5: [[[(0.75, 0.0), (0.3, 0.02), (0.42, 0.4)] + _arc(0.5, 0.7, 0.32, 0.3, 120, -155)]],  # a 3?
    6: [  # a tall loop under a short stem: a 0?
        [_curve((0.62, 0.0), (0.25, 0.1), (0.22, 0.55)) + _arc(0.48, 0.62, 0.26, 0.38, 180, 520)],
    ],
    7: [[[(0.35, 0.04), (0.65, 0.0), (0.52, 1.0)]]],  # a short bar: a 1?
    8: [[_arc(0.5, 0.25, 0.24, 0.25, 170, -90), _arc(0.5, 0.73, 0.3, 0.27, 90, 450)]],  # a 3?
    9: [[_arc(0.5, 0.28, 0.27, 0.28, 120, 360), [(0.77, 0.0), (0.77, 1.0)]]],  # open: a 4?
}
"""Per digit, glyphs that look half like another class; they make CONFUSABLE_SHARE of the class."""
CONFUSABLE_SHARE = 0.02
"""Share of a class drawn from its CONFUSABLE glyphs, where it has any."""
GAP_SHARE = 0.15
"""Share of samples with a break cut into one stroke."""
STRAY_SHARE = 0.1
"""Share of samples with a stray mark beside the digit."""


JOIN = 0.02
"""Segment ends closer than this (in the unit box) are one point: where a stroke's pieces meet."""


def _join(points: list[tuple[float, float]], end: tuple[float, float]) -> int:
    """Number of the point ``end`` in ``points``: one already there if it is within JOIN."""
    for number, point in enumerate(points):
        if math.dist(point, end) < JOIN:
            return number
    points.append(end)
    return len(points) - 1


def _glyph_table() -> tuple[torch.Tensor, ...]:
    """All glyphs as segments ``[G, S, 2 ends, 2 coords]``, padded by repeating a segment.

    Also returns each segment end's point number within its glyph ``[G, S, 2]`` (ends that meet
    share one, so that the wobble keeps strokes joined), each glyph's number of segments, and per
    digit the index of its first glyph and the cumulative shares ``[10, V - 1]`` that a sample's
    ``variant`` is compared with to pick one of its glyphs (confusable ones first).
    """
    glyphs, numbers, first, bounds = [], [], [], []
    for digit in range(10):
        common, confusable = GLYPHS[digit], CONFUSABLE.get(digit, [])
        rare = CONFUSABLE_SHARE if confusable else 0.0
        shares = ([rare / max(1, len(confusable))] * len(confusable)
                  + [(1 - rare) / len(common)] * len(common))
        first.append(len(glyphs))
        bounds.append(list(itertools.accumulate(shares))[:-1])
        for strokes in confusable + common:
            points: list[tuple[float, float]] = []
            ends = [(_join(points, p), _join(points, q))
                    for stroke in strokes for p, q in itertools.pairwise(stroke)]
            ends = [(a, b) for a, b in ends if a != b]  # the joins themselves are no segments
            glyphs.append([(points[a], points[b]) for a, b in ends])
            numbers.append(ends)
    longest = max(map(len, glyphs))
    widest = max(map(len, bounds))
    return (
        torch.tensor([segs + segs[:1] * (longest - len(segs)) for segs in glyphs]),
        torch.tensor([ends + ends[:1] * (longest - len(ends)) for ends in numbers]),
        torch.tensor([len(segs) for segs in glyphs]),
        torch.tensor(first),
        torch.tensor([b + [math.inf] * (widest - len(b)) for b in bounds], dtype=torch.float32),
    )


_SEGMENTS, _POINTS, _NUM_SEGMENTS, _FIRST_GLYPH, _VARIANT_BOUNDS = _glyph_table()

PARAM_RANGES: dict[str, tuple[float, float]] = {
    "variant": (0.0, 1.0),  # which glyph of the digit, see _glyph_index
    "height": (15.0, 21.0),  # pixels spanned by the unit box's height
    "aspect": (0.7, 1.25),  # width / height scale
    "slant": (-0.25, 0.5),  # horizontal shear; positive leans the top to the right
    "tan_half_angle": (-0.125, 0.125),  # of the rotation: about +-14 degrees
    "shift_x": (-2.0, 2.0),  # pixels
    "shift_y": (-2.0, 2.0),
    "bow_x": (-0.15, 0.15),  # smooth warp of the unit box, see _warp
    "bow_y": (-0.15, 0.15),
    "taper_x": (-0.2, 0.2),
    "taper_y": (-0.2, 0.2),
    "wobble": (0.0, 0.06),  # largest move of a control point, unit box, see _wobble
    "radius": (0.75, 1.75),  # half the stroke width at the frame's centre, pixels
    "pressure_x": (-0.03, 0.03),  # relative change of the radius per pixel to the right
    "pressure_y": (-0.03, 0.03),  # and per pixel down
    "softness": (0.7, 1.5),  # width of the antialiased edge, pixels
    "noise": (0.0, 0.5),  # amplitude of multiplicative pixel noise
    "gap": (0.0, 1.0),  # below GAP_SHARE: a stroke breaks, see _gap
    "gap_at": (0.0, 1.0),  # where along the glyph's segments
    "gap_width": (0.2, 1.2),  # pixels beyond the stroke's radius cut on either side
    "stray": (0.0, 1.0),  # below STRAY_SHARE: a stray mark, see _stray
    "stray_x": (5.0, 22.0),  # its centre, pixels
    "stray_y": (5.0, 22.0),
    "stray_turn": (-1.0, 1.0),  # tan of half its angle: any direction
    "stray_length": (1.0, 5.0),  # pixels
}
"""Per-sample random parameters, each uniform in its range."""
KEYS = ("noise_key", "wobble_key")
"""Per-sample 32-bit keys of the integer hashes: the pixel noise's and the wobble's."""


def _sample_params(n: int, seed: int) -> dict[str, torch.Tensor]:
    """One row of parameters and keys per sample; row i depends on i alone."""
    gen = torch.Generator().manual_seed(seed)
    uniform = torch.rand(n, len(PARAM_RANGES) + len(KEYS), generator=gen, dtype=torch.float64)
    params = {
        name: (lo + (hi - lo) * uniform[:, j]).float()
        for j, (name, (lo, hi)) in enumerate(PARAM_RANGES.items())
    }
    for j, key in enumerate(KEYS, start=len(PARAM_RANGES)):
        params[key] = (uniform[:, j] * 2**32).long()
    return params


def _hash_uniform(counter: torch.Tensor) -> torch.Tensor:
    """Uniform floats in [0, 1) from a 32-bit integer hash of int64 ``counter``."""
    mask = 0xFFFFFFFF
    x = counter & mask
    x = ((x >> 16) ^ x) * 0x45D9F3B & mask
    x = ((x >> 16) ^ x) * 0x45D9F3B & mask
    x = (x >> 16) ^ x
    return (x & 0xFFFFFF).float() / 2**24


def _wobble(points: torch.Tensor, p: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Offsets (x, y) of each control point ``[C, S, 2]``, up to ``wobble`` either way.

    A hash of the sample's key and the point's number: ends that share a point move together.
    """
    counter = p["wobble_key"][:, None, None] + 2 * points
    amplitude = 2 * p["wobble"][:, None, None]
    return (amplitude * (_hash_uniform(counter) - 0.5),
            amplitude * (_hash_uniform(counter + 1) - 0.5))


def _warp(x: torch.Tensor, y: torch.Tensor, p: dict[str, torch.Tensor]):
    """Bend unit-box coordinates (centred at 0) by a smooth quadratic warp."""
    return (
        x + p["bow_x"] * (y * y) + p["taper_x"] * (x * y),
        y + p["bow_y"] * (x * x) + p["taper_y"] * (x * y),
    )


def _place(segments: torch.Tensor, points: torch.Tensor,
           p: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Map unit-box segment ends ``[C, S, 2, 2]``, their point numbers ``[C, S, 2]`` telling
    which ends are one point, to pixel coordinates (x, y), each ``[C, S, 2]``."""
    wobble_x, wobble_y = _wobble(points, p)
    p = {name: value[:, None, None] for name, value in p.items()}
    x = segments[..., 0] - 0.5 + wobble_x
    y = segments[..., 1] - 0.5 + wobble_y
    x, y = _warp(x, y, p)
    x, y = x * (p["height"] * p["aspect"]), y * p["height"]
    x = x - p["slant"] * y
    cos, sin = _rotation(p["tan_half_angle"])
    centre = (SIZE - 1) / 2
    return (
        cos * x - sin * y + (centre + p["shift_x"]),
        sin * x + cos * y + (centre + p["shift_y"]),
    )


def _rotation(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine of the angle whose half has tangent ``t``, rationally (no trigonometry)."""
    return (1 - t * t) / (1 + t * t), (2 * t) / (1 + t * t)


def _stray(x: torch.Tensor, y: torch.Tensor, p: dict[str, torch.Tensor]):
    """The placed segments with one more: a stray mark for a STRAY_SHARE of the samples, else a
    repeat of the first segment (which draws nothing new)."""
    cos, sin = _rotation(p["stray_turn"])
    half_x, half_y = cos * p["stray_length"] / 2, sin * p["stray_length"] / 2
    mark_x = torch.stack([p["stray_x"] - half_x, p["stray_x"] + half_x], dim=1)
    mark_y = torch.stack([p["stray_y"] - half_y, p["stray_y"] + half_y], dim=1)
    has = (p["stray"] < STRAY_SHARE)[:, None]
    return (torch.cat([x, torch.where(has, mark_x, x[:, 0])[:, None]], dim=1),
            torch.cat([y, torch.where(has, mark_y, y[:, 0])[:, None]], dim=1))


def exact_sqrt(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root of a CPU tensor, the same bytes on every processor."""
    return torch.from_numpy(np.sqrt(x.numpy()))


_GRID = torch.arange(SIZE, dtype=torch.float32)
"""Pixel centres' coordinates along either axis."""


def _distance(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Distance ``[C, SIZE, SIZE]`` from each pixel centre to the nearest segment.

    Splits the offset from a segment into its part across the segment's line and its overshoot
    beyond the segment's ends; both are sums of a per-row and a per-column term. A segment
    shorter than 1e-3 pixels is taken along x (it is a point, whatever its direction).
    """
    ax, ay = x[..., 0, None, None], y[..., 0, None, None]  # [C, S, 1, 1]
    ex, ey = x[..., 1, None, None] - ax, y[..., 1, None, None] - ay
    length = exact_sqrt(ex * ex + ey * ey)
    point = length < 1e-3
    ux = torch.where(point, 1.0, ex / length.clamp_min(1e-3))
    uy = torch.where(point, 0.0, ey / length.clamp_min(1e-3))
    half = length / 2
    dx, dy = _GRID - ax, _GRID[:, None] - ay  # [C, S, 1, SIZE] and [C, S, SIZE, 1]
    across = (dx * uy) - (dy * ux)
    beyond = (dx * ux - half) + (dy * uy)  # signed distance along the line from the midpoint
    beyond.abs_().sub_(half).clamp_min_(0)
    return exact_sqrt(across.square_().add_(beyond.square_()).amin(dim=1))


def _gap(x: torch.Tensor, y: torch.Tensor, glyph: torch.Tensor,
         p: dict[str, torch.Tensor]) -> torch.Tensor:
    """Factor ``[C, SIZE, SIZE]`` on the ink that breaks a stroke where the pen lifted: 0 in a disc
    a little wider than the stroke around a point on one of the glyph's segments, for a
    GAP_SHARE of the samples; 1 elsewhere and for the others."""
    count = _NUM_SEGMENTS[glyph]
    at = p["gap_at"] * count  # the segment's number and the way along it, in one number
    segment = at.long().clamp_max(count - 1)
    t = at - segment
    rows = torch.arange(len(glyph))
    (ax, bx), (ay, by) = x[rows, segment].unbind(1), y[rows, segment].unbind(1)
    dx = _GRID - (ax + t * (bx - ax))[:, None, None]
    dy = _GRID[:, None] - (ay + t * (by - ay))[:, None, None]
    cut_radius = (p["radius"] + p["gap_width"])[:, None, None]
    cut = ((exact_sqrt(dx * dx + dy * dy) - cut_radius) / p["softness"][:, None, None] + 0.5)
    return torch.where((p["gap"] < GAP_SHARE)[:, None, None], cut.clamp(0, 1), 1.0)


def _glyph_index(labels: torch.Tensor, variant: torch.Tensor) -> torch.Tensor:
    """Index into the glyph table of each label's glyph, chosen by ``variant`` in [0, 1)."""
    return _FIRST_GLYPH[labels] + (variant[:, None] >= _VARIANT_BOUNDS[labels]).sum(1)


def _render_chunk(glyph: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    """Render one chunk of samples to uint8 ``[C, SIZE, SIZE]``."""
    used = _NUM_SEGMENTS[glyph].max()  # drop padding none of them need
    x, y = _place(_SEGMENTS[glyph, :used], _POINTS[glyph, :used], p)
    soft, noise = p["softness"][:, None, None], p["noise"][:, None, None]
    centre = (SIZE - 1) / 2
    radius = p["radius"][:, None, None] * (
        1 + p["pressure_x"][:, None, None] * (_GRID - centre)
        + p["pressure_y"][:, None, None] * (_GRID[:, None] - centre)
    )
    ink = ((radius - _distance(*_stray(x, y, p))) / soft + 0.5).clamp(0, 1)
    ink = ink * _gap(x, y, glyph, p)
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
    labels, render_seed = draw_labels(n, seed)
    return render_digits(labels, render_seed), labels.to(torch.uint8)


def draw_labels(n: int, seed: int) -> tuple[torch.Tensor, int]:
    """The int64 labels [n] of ``generate(n, seed)`` and the seed it renders them with."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=gen)
    return labels, int(torch.randint(0, 2**62, (), generator=gen))
