"""``elastic-mnist plot RUN_DIR -o run.png``: a run's curves for a report, restarts marked.

Reads the run's TensorBoard scalars and its events.jsonl and draws them with matplotlib (Agg, no
pyplot): loss and error rate on log axes, throughput with the world size as a step line, and on
every panel a line at each change of membership (dashed: a restart; dotted: the survivors going
on in process), labelled with its generation and the world size before and after. Only the
``plot`` command imports this module, so only it loads matplotlib.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import LogFormatter, MaxNLocator

from elastic_mnist.events import read_events

FORMATS = {".png": {}, ".svg": {"Date": None}, ".pdf": {"CreationDate": None}}
"""What ``-o`` may end with, and the metadata that would make each file differ at every run."""
STYLE = {"svg.fonttype": "none",  # text stays text in an SVG: searchable, editable
         "font.size": 9, "axes.titlesize": 10, "axes.titleweight": "bold",
         "axes.titlelocation": "left", "axes.spines.top": False, "legend.fontsize": 8,
         "legend.frameon": False}
TRAIN, TEST, RATE, WORLD, RESTART = "tab:blue", "tab:orange", "tab:green", "0.35", "tab:red"
IN_PROCESS = "tab:purple"
LINES = {False: ("--", RESTART, "restart (generation, world size before\u2192after)"),
         True: (":", IN_PROCESS, "in process (generation, world size before\u2192after)")}
"""Line style, colour and legend of a restart and of a change recovered in process."""


@dataclass
class Restart:
    """A new generation: by a restart (a ``start`` record), or in process (a ``shrink`` or a
    ``grow``)."""

    step: int
    generation: int
    world_before: int | None
    world_after: int
    in_process: bool = False

    @property
    def label(self) -> str:
        before = "?" if self.world_before is None else self.world_before
        return f"g{self.generation}, world {before}\u2192{self.world_after}"


@dataclass
class RunRecord:
    """What events.jsonl says: each generation's start (step, world size) and the final
    accuracy."""

    starts: list[tuple[int, int]]
    restarts: list[Restart]
    final_accuracy: float | None


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}


def read_record(run_dir: Path) -> RunRecord:
    """Every launch after the first is a restart, every shrink or grow a change in process; a resize
    record names the old world size when no earlier start does."""
    path = run_dir / "events.jsonl"
    records = read_events(path) if path.exists() else []
    resized_from = {r["step"]: r["old_world_size"] for r in records if r["event"] == "resize"}
    starts, restarts, world, accuracy = [], [], None, None
    for r in records:
        if r["event"] == "start":
            if r.get("restart_generation", 0) > 0:
                before = world if world is not None else resized_from.get(r["step"])
                restarts.append(Restart(r["step"], r["restart_generation"], before,
                                        r["world_size"]))
            starts.append((r["step"], r["world_size"]))
            world = r["world_size"]
        elif r["event"] in ("shrink", "grow"):
            restarts.append(Restart(r["step"], r["restart_generation"], r["old_world_size"],
                                    r["new_world_size"], in_process=True))
            starts.append((r["step"], r["new_world_size"]))
            world = r["new_world_size"]
        elif r["event"] == "finish":
            accuracy = r.get("test_accuracy")
    return RunRecord(starts, restarts, accuracy)


def plot_run(run_dir: Path, out: Path) -> None:
    """Raises ValueError for an output it cannot write or a folder that holds no run."""
    if out.suffix.lower() not in FORMATS:
        raise ValueError(f"cannot write {out.name}: the output must end with "
                         f"{', '.join(FORMATS)}")
    if not out.parent.is_dir():
        raise ValueError(f"{out.parent} is not a folder")
    scalars = read_scalars(run_dir)
    if "train/loss" not in scalars:
        raise ValueError(f"{run_dir} holds no train/loss scalars; is it a run folder?")
    with matplotlib.rc_context(STYLE):
        figure = draw(run_dir.name, scalars, read_record(run_dir))
        figure.savefig(out, dpi=150, metadata=FORMATS[out.suffix.lower()])


def draw(run_id: str, scalars: dict[str, list[tuple[int, float]]], record: RunRecord) -> Figure:
    figure = Figure(figsize=(10, 8.5), layout="constrained")
    FigureCanvasAgg(figure)
    loss, error, rate = figure.subplots(3, 1, sharex=True, height_ratios=(3, 3, 2))
    last_step = max(step for series in scalars.values() for step, _ in series)

    loss.set(title="loss", yscale="log", ylabel="cross-entropy")
    error.set(title="error rate = 1 \u2212 accuracy", yscale="log", ylabel="error rate")
    for axes, formatter in ((loss, Decimal), (error, Percent)):
        axes.yaxis.set_major_formatter(formatter())
        axes.yaxis.set_minor_formatter(formatter(minor_thresholds=(2, 0.5)))
    for split, color, style in (("train", TRAIN, "-"), ("test", TEST, "o-")):
        _line(loss, scalars.get(f"{split}/loss"), style, color, split)
        _line(error, [(s, 1.0 - v) for s, v in scalars.get(f"{split}/accuracy", [])], style,
              color, split)

    _line(rate, scalars.get("perf/samples_per_s"), "-", RATE, "samples/s")
    rate.set(title="throughput and world size", ylabel="samples/s", xlabel="optimizer step",
             xlim=(0, last_step))
    rate.set_ylim(bottom=0)
    world = rate.twinx()
    world_steps = record.starts or [(s, v) for s, v in scalars.get("elastic/world_size", [])]
    if world_steps:
        steps, sizes = zip(*[*world_steps, (last_step, world_steps[-1][1])])
        world.step(steps, sizes, where="post", color=WORLD, linewidth=2, label="world size")
        world.set_ylim(0, max(sizes) + 1)
    world.set_ylabel("world size (processes)")
    world.yaxis.set_major_locator(MaxNLocator(integer=True))
    world.spines["top"].set_visible(False)

    for axes in (loss, error, rate):
        axes.grid(True, which="major", alpha=0.5)
        axes.grid(True, which="minor", alpha=0.15)
        for restart in record.restarts:
            style, color, label = LINES[restart.in_process]
            axes.axvline(restart.step, color=color, linestyle=style, linewidth=1,
                         label="_" if axes is not loss else label)
    _label_restarts(loss, record.restarts)
    _legend(loss)
    _legend(error)
    handles, labels = rate.get_legend_handles_labels()
    extra_handles, extra_labels = world.get_legend_handles_labels()
    _legend(rate, handles + extra_handles, labels + extra_labels)

    launches = len(record.starts) - sum(r.in_process for r in record.restarts)
    title = f"run {run_id}" + (f": {launches} launches" if launches else "")
    if record.final_accuracy is not None:
        title += f", final test accuracy {100 * record.final_accuracy:.2f}%"
    figure.suptitle(title, fontweight="bold")
    return figure


def _line(axes, points: list[tuple[int, float]] | None, style: str, color: str,
          label: str) -> None:
    """Values a log axis cannot show (an error rate of 0) leave a gap, not a plunge to its floor."""
    if not points:
        return
    log_axis = axes.get_yscale() == "log"
    steps = [s for s, _ in points]
    values = [v if v > 0 or not log_axis else float("nan") for _, v in points]
    axes.plot(steps, values, style, color=color, label=label, linewidth=1.5, markersize=4)


def _label_restarts(axes, restarts: list[Restart]) -> None:
    """Each restart's label beside its line, near the top, on rows that do not collide."""
    by_step: dict[int, list[Restart]] = {}
    for restart in restarts:
        by_step.setdefault(restart.step, []).append(restart)
    for row, (step, changes) in enumerate(by_step.items()):
        axes.annotate(", ".join(r.label for r in changes), xy=(step, 1.0),
                      xycoords=("data", "axes fraction"),
                      xytext=(4, -12 - 13 * (row % 3)), textcoords="offset points",
                      color=LINES[changes[-1].in_process][1], fontsize=8, ha="left", va="center",
                      bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none",
                            "alpha": 0.85})


def _legend(axes, handles=None, labels=None) -> None:
    """One entry per label (every restart line carries the same one)."""
    if handles is None:
        handles, labels = axes.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    if unique:  # above the panel, right of its title
        axes.legend(unique.values(), unique.keys(), loc="lower right", bbox_to_anchor=(1, 1),
                    ncols=len(unique), borderaxespad=0.2)


class Decimal(LogFormatter):
    """A log axis's labels as plain numbers (0.2, 1, 2), not 2×10⁻¹."""

    def _num_to_string(self, x: float, vmin: float, vmax: float) -> str:
        return f"{x:g}"


class Percent(LogFormatter):
    def _num_to_string(self, x: float, vmin: float, vmax: float) -> str:
        return f"{100 * x:g}%"
