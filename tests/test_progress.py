"""The progress bar: tqdm on rank 0 at a terminal, nothing drawn anywhere else."""

from __future__ import annotations

import io
import logging
import os
import pty
import re
import sys
import time

from elastic_mnist.progress import LogLines, ProgressBar, progress_display


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def segments(text: str) -> list[str]:
    """What a terminal would show as separate line states: redraws (\\r) and lines (\\n)."""
    return [s.strip() for s in re.split(r"[\r\n]", text) if s.strip()]


def test_bar_shows_epoch_step_loss_rate_world_and_eta_from_the_resumed_step():
    terminal = FakeTerminal()
    bar = progress_display(True, total_steps=100, initial_step=30, world_size=3, stream=terminal)
    assert isinstance(bar, ProgressBar)
    assert "30/100" in segments(terminal.getvalue())[0]  # a resumed launch starts where it was
    for step in (32, 34):
        time.sleep(0.12)  # tqdm redraws at most every 0.1 s
        bar.update("2/4", step, 100, 0.25, 1234.0)  # as the trainer labels the epoch
    bar.close()
    last = segments(terminal.getvalue())[-1]
    for part in ("epoch 2/4", "34/100", "loss 0.2500", "1,234 samples/s", "world 3"):
        assert part in last, last
    assert re.search(r"\d\d:\d\d<\d\d:\d\d", last), last  # elapsed < ETA, both known


def read_available(fd: int) -> str:
    """Everything written to the pty so far: one read may return only its first chunk."""
    import select

    chunks = []
    while select.select([fd], [], [], 0.2)[0]:
        chunks.append(os.read(fd, 65536))
    return b"".join(chunks).decode()


def test_a_real_terminal_that_reports_no_size_still_shows_the_numbers():
    leader, follower = pty.openpty()  # a fresh pty is 0x0, as some container and CI ptys are
    with os.fdopen(follower, "w") as terminal:
        assert os.get_terminal_size(terminal.fileno()).columns == 0
        bar = progress_display(True, 100, 10, 2, stream=terminal)
        bar.update(1, 20, 100, 0.5, 1000.0)
        bar.close()
        shown = read_available(leader)
    os.close(leader)
    assert "20/100" in shown and "world 2" in shown, shown


def test_without_a_terminal_or_off_rank_0_nothing_is_drawn():
    pipe, terminal = io.StringIO(), FakeTerminal()
    for display in (progress_display(True, 100, 0, 2, stream=pipe),
                    progress_display(False, 100, 0, 2, stream=terminal)):
        assert type(display) is LogLines
        display.update(1, 10, 100, 0.5, 1000.0)
        display.close()
    assert pipe.getvalue() == "" and terminal.getvalue() == ""


def test_log_lines_print_above_the_bar_not_inside_it(monkeypatch):
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    console = logging.StreamHandler(terminal)
    root = logging.getLogger()
    root.addHandler(console)
    try:
        bar = progress_display(True, 100, 0, 2, stream=terminal)
        bar.update(1, 10, 100, 0.5, 1000.0)
        logging.getLogger("elastic_mnist.trainer").warning("a line of the log")
        bar.update(1, 11, 100, 0.5, 1000.0)
        bar.close()
        assert console in root.handlers  # the console handler is back once the bar is gone
    finally:
        root.removeHandler(console)
    shown = segments(terminal.getvalue())
    assert "a line of the log" in shown, shown
    assert "11/100" in shown[-1]  # and the bar redrawn below it
