"""Logging with the rank in every line: progress from rank 0, only trouble from the others."""

from __future__ import annotations

import logging
import sys

from elastic_mnist.env import DistEnv


def setup_logging(env: DistEnv, logfile: str | None = None) -> None:
    fmt = logging.Formatter(f"%(asctime)s [rank {env.rank}] %(levelname)s %(message)s",
                            datefmt="%H:%M:%S")
    root = logging.getLogger()
    root.handlers.clear()
    stream = logging.StreamHandler(sys.stderr)
    stream.setFormatter(fmt)
    root.addHandler(stream)
    root.setLevel(logging.INFO if env.is_main else logging.WARNING)


def add_file_handler(path: str) -> None:
    """Also keeps this process's log lines in ``path`` (the run's own record)."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.getLogger().handlers[0].formatter)
    logging.getLogger().addHandler(handler)
