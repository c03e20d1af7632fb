"""Where the numbers go: TensorBoard on rank 0, nowhere on the other ranks."""

from __future__ import annotations

import io
import itertools
import os
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

import torch

from elastic_mnist.fsutil import atomic_write_bytes
from elastic_mnist.resilience.fence import NO_FENCE, NullFence

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
    """Scalars, text, images and hparams in ``run_dir``, one folder for the whole run, one event
    file per writer.

    Opened with ``purge_step``: whatever an earlier launch logged at that step or later (work lost
    with it, since the checkpoint resumed from is older) is hidden, so steps never rewind.

    Every record passes ``fence`` (fence.py) in the thread that logs it and is then in the file
    at once: no thread of the writer's own writes or flushes later, behind the fence's back, as
    SummaryWriter's does, and nothing waits in a buffer for a process that the fence ends. Records
    of every step (scalars, images) may reuse a verdict of the last second.
    """

    def __init__(self, run_dir: Path, purge_step: int | None = None,
                 fence: NullFence = NO_FENCE):
        self.run_dir = run_dir
        self.fence = fence
        self._lock = threading.Lock()
        fence.check()
        run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(run_dir / event_file_name(), "ab")  # noqa: SIM115 - closed by close()
        self._write(record(file_version="brain.Event:2"))
        if purge_step is not None:  # as SummaryWriter marks a restart: TensorBoard hides the rest
            from tensorboard.compat.proto.event_pb2 import SessionLog

            self._write(record(step=purge_step, file_version="brain.Event:2"))
            self._write(record(step=purge_step, session_log=SessionLog(status=SessionLog.START)))

    def _write(self, framed: bytes) -> None:
        with self._lock:
            self._file.write(framed)
            self._file.flush()

    def _summary(self, summary: Any, step: int | None = None) -> None:
        self._write(record(summary=summary) if step is None else record(summary=summary, step=step))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        from torch.utils.tensorboard.summary import scalar

        self.fence.check(recent=True)
        self._write(b"".join(record(summary=scalar(tag, value), step=step)
                             for tag, value in values.items()))  # one write and flush

    def text(self, tag: str, text: str, step: int = 0) -> None:
        from torch.utils.tensorboard.summary import text as text_summary

        self.fence.check()
        self._summary(text_summary(tag, text), step)

    def image(self, tag: str, image: torch.Tensor, step: int) -> None:
        from torch.utils.tensorboard.summary import image as image_summary

        self.fence.check(recent=True)
        self._summary(image_summary(tag, image, dataformats="HWC"), step)

    def hparams(self, hparams: dict[str, Any], metric_tags: list[str]) -> None:
        """The hparams plugin's entry for this run; its metrics are read from ``metric_tags``.

        Written into the run's own folder (``add_hparams`` would open a new one per call).
        """
        from torch.utils.tensorboard.summary import hparams as hparams_summaries

        self.fence.check()
        self._write(b"".join(record(summary=summary) for summary in
                             hparams_summaries(hparams, {tag: 0.0 for tag in metric_tags})))

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

        summary = custom_scalars({
            category: {title: ["Multiline", [f"^{re.escape(tag)}$" for tag in tags]]
                       for title, tags in charts.items()}
            for category, charts in categories.items()})
        content = record(file_version="brain.Event:2") + record(summary=summary, step=0)
        target = self.run_dir / event_file_name(LAYOUT_SUFFIX)
        self.fence.check()
        atomic_write_bytes(target, content)
        target.chmod(self.run_dir.stat().st_mode & 0o666)  # readable as the folder is

    def flush(self) -> None:
        """Every record is in the file already: only the fence is asked (a verdict of the
        last second will do, as for every record)."""
        self.fence.check(recent=True)

    def close(self) -> None:
        """Writes nothing: every record is in the file already."""
        with self._lock:
            self._file.close()


def record(**fields: Any) -> bytes:
    """One event of TensorBoard's event files (``Event``'s ``fields``), timed now, framed as its
    writers frame it."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.record_writer import RecordWriter

    framed = io.BytesIO()
    RecordWriter(framed).write(Event(wall_time=time.time(), **fields).SerializeToString())
    return framed.getvalue()


def event_file_name(suffix: str = "") -> str:
    """A new event file's name, as TensorBoard's writers name them (TensorBoard reads a run's
    files in the order of their names: of their creation)."""
    return (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
            f"{os.getpid()}.{next(_FILE_NUMBERS)}{suffix}")


_FILE_NUMBERS = itertools.count()


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
