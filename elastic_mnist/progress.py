"""Progress for people at a terminal: a live bar on a TTY, a log line every N steps otherwise."""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

log = logging.getLogger(__name__)


class LogLines:
    """Without a TTY (or on ranks other than 0): nothing here; the trainer's log lines suffice."""

    def update(self, epoch: int, step: int, total_steps: int, loss: float,
               samples_per_s: float) -> None:
        pass

    def close(self) -> None:
        pass


class ProgressBar(LogLines):
    """One line redrawn in place: epoch, step, loss, samples/s and ETA."""

    def __init__(self, stream: TextIO = sys.stderr, width: int = 24, min_interval_s: float = 0.1):
        self.stream, self.width, self.min_interval_s = stream, width, min_interval_s
        self._start = time.monotonic()
        self._first_step: int | None = None
        self._last_draw = 0.0

    def update(self, epoch: int, step: int, total_steps: int, loss: float,
               samples_per_s: float) -> None:
        now = time.monotonic()
        if self._first_step is None:
            self._first_step, self._start = step, now
        if now - self._last_draw < self.min_interval_s and step < total_steps:
            return
        self._last_draw = now
        done = step / max(total_steps, 1)
        filled = int(done * self.width)
        steps_run = step - self._first_step
        eta = (now - self._start) / steps_run * (total_steps - step) if steps_run else 0.0
        self.stream.write(
            f"\repoch {epoch} [{'#' * filled}{'.' * (self.width - filled)}] "
            f"step {step}/{total_steps} loss {loss:.4f} {samples_per_s:,.0f} samples/s "
            f"ETA {int(eta // 60)}:{int(eta % 60):02d} ")
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


def progress_display(is_main: bool, stream: TextIO = sys.stderr) -> LogLines:
    return ProgressBar(stream) if is_main and stream.isatty() else LogLines()
