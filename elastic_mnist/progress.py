"""Progress for people at a terminal: a tqdm bar on a TTY, a log line every N steps otherwise."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import TextIO

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm


class LogLines:
    """Without a TTY (or on ranks other than 0): nothing here; the trainer's log lines suffice."""

    def update(self, epoch: int | str, step: int, total_steps: int, loss: float,
               samples_per_s: float) -> None:
        pass

    def close(self) -> None:
        pass


class ProgressBar(LogLines):
    """tqdm's bar: epoch, step of total, ETA, and as postfix the loss, samples/s and world size.

    A launch has one world size, so it is given once; a resumed launch's bar starts at the step
    it resumed from. While the bar is open, log lines to the console are printed above it.
    """

    def __init__(self, total_steps: int, initial_step: int, world_size: int,
                 stream: TextIO = sys.stderr):
        self.world_size = world_size
        # A terminal that reports no size (some container and CI ptys) would get no bar at all
        # from tqdm: it gets the numbers without the bar.
        size = {"dynamic_ncols": True} if _has_size(stream) else {"ncols": 0, "nrows": 20}
        self.bar = tqdm(total=total_steps, initial=initial_step, file=stream, unit="step",
                        **size)
        self._redirect = contextlib.ExitStack()
        self._redirect.enter_context(logging_redirect_tqdm([logging.getLogger()]))

    def update(self, epoch: int | str, step: int, total_steps: int, loss: float,
               samples_per_s: float) -> None:
        """``epoch`` as the trainer labels it: ``N/E``, the epoch of ``step`` counted from 1."""
        self.bar.set_description_str(f"epoch {epoch}", refresh=False)
        self.bar.set_postfix_str(f"loss {loss:.4f}, {samples_per_s:,.0f} samples/s, "
                                 f"world {self.world_size}", refresh=False)
        self.bar.update(step - self.bar.n)

    def close(self) -> None:
        self.bar.close()
        self._redirect.close()


def _has_size(stream: TextIO) -> bool:
    try:
        return os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, OSError, ValueError):
        return True  # not a real terminal: tqdm's defaults


def progress_display(is_main: bool, total_steps: int, initial_step: int, world_size: int,
                     stream: TextIO = sys.stderr) -> LogLines:
    if is_main and stream.isatty():
        return ProgressBar(total_steps, initial_step, world_size, stream)
    return LogLines()
