"""SIGTERM/SIGINT become a request to stop at the next step boundary that all ranks agree on."""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Iterator

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Set by a signal handler; the training loop all-reduces it every step."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""

    def _handle(self, signum: int, frame: object) -> None:
        if not self.requested:
            self.signal_name = signal.Signals(signum).name
            # A Ctrl-C is answered by one line at the stop (job.report_stop), said by rank 0.
            log.log(logging.DEBUG if signum == signal.SIGINT else logging.WARNING,
                    "%s received: stopping at the next step boundary, after a checkpoint",
                    self.signal_name)
        self.requested = True


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """Installs the handlers for the duration of the block and puts the old ones back."""
    request = StopRequest()
    previous = {sig: signal.signal(sig, request._handle) for sig in STOP_SIGNALS}
    try:
        yield request
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
