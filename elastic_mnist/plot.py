"""``elastic-mnist plot RUN_DIR -o run.png``: loss and error rate over steps, restarts marked.

Reads the run's TensorBoard scalars and its events.jsonl, and draws with PIL alone, for a report
or a reader without TensorBoard.
"""

from __future__ import annotations

import math
from pathlib import Path

from PIL import Image, ImageDraw

from elastic_mnist.events import read_events

WIDTH, PANEL_HEIGHT, MARGIN = 960, 300, 60
FLOOR = 1e-4  # the smallest value a log axis shows
# (title, tag under train/ and test/, what is drawn), both panels on a log axis.
PANELS = (("loss (log scale)", "loss", lambda v: v),
          ("error rate = 1 - accuracy (log scale)", "accuracy", lambda v: 1.0 - v))
COLORS = {"train": (31, 119, 180), "test": (255, 127, 14)}
MARK = (150, 150, 150)


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}


def restarts(run_dir: Path) -> list[tuple[int, str]]:
    """(step, label) of every launch after the first, and of every change of world size."""
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    marks: dict[int, list[str]] = {}
    for record in read_events(path):
        if record["event"] == "start" and record.get("restart_generation", 0) > 0:
            label = f"restart g{record['restart_generation']} w={record['world_size']}"
            marks.setdefault(record["step"], []).append(label)
        elif record["event"] == "resize":
            label = f"world {record['old_world_size']}->{record['new_world_size']}"
            marks.setdefault(record["step"], []).append(label)
    return [(step, ", ".join(labels)) for step, labels in sorted(marks.items())]


def plot_run(run_dir: Path, out: Path) -> None:
    scalars = read_scalars(run_dir)
    if "train/loss" not in scalars:
        raise ValueError(f"{run_dir} holds no train/loss scalars; is it a run folder?")
    steps = [s for series in scalars.values() for s, _ in series]
    x_range = (min(steps), max(max(steps), min(steps) + 1))
    canvas = Image.new("RGB", (WIDTH, 2 * PANEL_HEIGHT + MARGIN), "white")
    draw = ImageDraw.Draw(canvas)
    marks = restarts(run_dir)
    for row, (title, tag, to_value) in enumerate(PANELS):
        series = {split: [(step, to_value(v)) for step, v in scalars.get(f"{split}/{tag}", [])]
                  for split in ("train", "test")}
        _panel(draw, row * PANEL_HEIGHT + MARGIN // 2, title, series, x_range, marks)
    canvas.save(out)


def _panel(draw: ImageDraw.ImageDraw, top: int, title: str,
           series: dict[str, list[tuple[int, float]]], x_range: tuple[int, int],
           marks: list[tuple[int, str]]) -> None:
    left, right, bottom = MARGIN, WIDTH - 20, top + PANEL_HEIGHT - 40
    values = [v for points in series.values() for _, v in points] or [FLOOR, 1.0]
    low, high = max(min(values), FLOOR), max(values)
    high = high if high > low else low * 10

    def at(step: float, value: float) -> tuple[float, float]:
        """Linear in steps, logarithmic in values."""
        x = left + (step - x_range[0]) / (x_range[1] - x_range[0]) * (right - left)
        share = math.log(max(value, low) / low) / math.log(high / low)
        return x, bottom - share * (bottom - top - 20)

    draw.rectangle((left, top, right, bottom), outline="black")
    draw.text((left, top - 14), title, fill="black")
    draw.text((4, top + 16), f"{high:.3g}", fill="black")
    draw.text((4, bottom - 10), f"{low:.3g}", fill="black")
    draw.text((left, bottom + 4), str(x_range[0]), fill="black")
    draw.text((right - 40, bottom + 4), f"step {x_range[1]}", fill="black")
    for n, (step, label) in enumerate(marks):
        x, _ = at(step, low)
        for y in range(top, bottom, 8):
            draw.line((x, y, x, min(y + 4, bottom)), fill=MARK)
        draw.text((x + 3, top + 4 + 12 * (n % 4)), label, fill=MARK)
    for n, (split, points) in enumerate(series.items()):
        if len(points) > 1:
            draw.line([at(s, v) for s, v in points], fill=COLORS[split], width=2)
        for s, v in points if len(points) <= 1 else []:
            x, y = at(s, v)
            draw.ellipse((x - 2, y - 2, x + 2, y + 2), fill=COLORS[split])
        draw.text((right - 120 + 60 * n, top - 14), split, fill=COLORS[split])
