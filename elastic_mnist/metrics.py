"""Where the numbers go: TensorBoard on rank 0, nowhere on the other ranks."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from elastic_mnist.fence import NO_FENCE, NullFence
from elastic_mnist.fsutil import atomic_write_bytes

LAYOUT_SUFFIX = ".layout"
"""The end of the name of the event file that holds a run folder's custom scalars layout."""


class NullMetrics:
    """What ranks that must not write get: every method does nothing."""

    def scalars(self, step: int, values: dict[str, float]) -> None:
        pass

    def text(self, tag: str, text: str, step: int = 0) -> None:
        pass

    def image(self, tag: str, image: torch.Tensor, step: int) -> None:
        pass

    def hparams(self, hparams: dict[str, Any], metric_tags: list[str]) -> None:
        pass

    def layout(self, categories: dict[str, dict[str, list[str]]]) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardMetrics(NullMetrics):
    """Scalars, text, images and hparams in ``run_dir``, one folder for the whole run.

    Opened with ``purge_step``: whatever an earlier launch logged at that step or later (work lost
    with it, since the checkpoint resumed from is older) is hidden, so steps never rewind.
    Scalars and images pass ``fence`` (a verdict of the last second will do), a flush always.
    """

    def __init__(self, run_dir: Path, purge_step: int | None = None,
                 fence: NullFence = NO_FENCE):
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir = run_dir
        self.fence = fence
        self.writer = SummaryWriter(log_dir=str(run_dir), purge_step=purge_step)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.fence.check(recent=True)
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step)

    def text(self, tag: str, text: str, step: int = 0) -> None:
        self.writer.add_text(tag, text, global_step=step)

    def image(self, tag: str, image: torch.Tensor, step: int) -> None:
        self.fence.check(recent=True)
        self.writer.add_image(tag, image, global_step=step, dataformats="HWC")

    def hparams(self, hparams: dict[str, Any], metric_tags: list[str]) -> None:
        """The hparams plugin's entry for this run; its metrics are read from ``metric_tags``.

        Written into the run's own folder (``add_hparams`` would open a new one per call).
        """
        from torch.utils.tensorboard.summary import hparams as hparams_summaries

        for summary in hparams_summaries(hparams, {tag: 0.0 for tag in metric_tags}):
            self.writer.file_writer.add_summary(summary)

    def layout(self, categories: dict[str, dict[str, list[str]]]) -> None:
        """The custom scalars dashboard: ``{category: {chart title: [tag, ...]}}``, each chart
        one plot of its tags' lines.

        Written once per run folder, whole or not at all, into an event file of its own
        (``*.layout``) at step 0: a resumed launch finds it and writes none, and no later
        launch's ``purge_step`` (always above 0) hides it.
        """
        if has_layout(self.run_dir):
            return
        from torch.utils.tensorboard.summary import custom_scalars
        from torch.utils.tensorboard.writer import FileWriter

        with tempfile.TemporaryDirectory() as scratch:
            writer = FileWriter(scratch, filename_suffix=LAYOUT_SUFFIX)
            writer.add_summary(custom_scalars({
                category: {title: ["Multiline", [f"^{re.escape(tag)}$" for tag in tags]]
                           for title, tags in charts.items()}
                for category, charts in categories.items()}), global_step=0)
            writer.close()
            (written,) = Path(scratch).iterdir()
            target = self.run_dir / written.name
            atomic_write_bytes(target, written.read_bytes())
        target.chmod(self.run_dir.stat().st_mode & 0o666)  # readable as the folder is

    def flush(self) -> None:
        self.fence.check()
        self.writer.flush()

    def close(self) -> None:
        self.fence.check()
        self.writer.close()


def flat_hparams(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 0.1}}`` → ``{"optim.lr": 0.1}``, values as the hparams plugin takes."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flat_hparams(value, f"{name}."))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = str(value)
    return flat


def has_layout(run_dir: Path) -> bool:
    return any(run_dir.glob(f"events.out.tfevents.*{LAYOUT_SUFFIX}"))
