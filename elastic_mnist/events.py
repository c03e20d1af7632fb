"""``<run dir>/events.jsonl``: the run's story, one JSON object per line, for tools and tests.

Rank 0 appends ``start``, ``resize``, ``shrink``, ``grow``, ``checkpoint``, ``eval``,
``nonfinite``, ``hang``, ``straggler``, ``straggler_recovered``, ``shares``, ``preempted``,
``left`` and ``finish`` records, each with a UTC timestamp and the step, and flushes every
line: a kill loses nothing already said. Other ranks get a log that writes nothing. Each
record's ``writer`` names the process that wrote it (``host/pid``): one the job went on without
writes none after that (fence.py), which ``make partitions`` checks.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import threading
import time
from pathlib import Path
from typing import Any

from elastic_mnist.resilience.fence import NO_FENCE, NullFence


def utc_now() -> str:
    return utc_time(time.time())


def utc_time(seconds: float) -> str:
    """``time.time()``'s seconds as the records write times: UTC, ISO 8601, milliseconds."""
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).isoformat(
        timespec="milliseconds")


def event_time(record: dict[str, Any], key: str = "time") -> float:
    """A record's time (or another of its times), in seconds since the epoch."""
    return datetime.datetime.fromisoformat(record[key]).timestamp()


class NullEventLog:
    """What ranks that must not write get."""

    def emit(self, event: str, step: int, **fields: Any) -> None:
        pass

    def close(self) -> None:
        pass


class EventLog(NullEventLog):
    """Append-only, line-flushed and fsynced, safe to call from the checkpoint writer thread;
    each record passes ``fence`` first (fence.py)."""

    def __init__(self, path: Path, fence: NullFence = NO_FENCE):
        self.fence = fence
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - closed by close()
        self._lock = threading.Lock()

    def emit(self, event: str, step: int, **fields: Any) -> None:
        self.fence.check()  # before the time is taken: a check may wait (fence.py's ASK_S)
        line = json.dumps({"event": event, "time": utc_now(), "step": step, **fields,
                           "writer": f"{platform.node()}/{os.getpid()}"})
        with self._lock:
            self._file.write(line + "\n")
            os.fsync(self._file.fileno())

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_events(path: Path) -> list[dict[str, Any]]:
    """The records of an events.jsonl, skipping a last line cut short by a kill."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records
