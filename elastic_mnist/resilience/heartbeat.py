"""What each rank's watchdog publishes once a beat (watchdog.py): who and where it is, and where
its training thread stands; who reads them, and what a read that the store does not answer
raises."""

from __future__ import annotations

import sys
import sysconfig
from dataclasses import dataclass, field


@dataclass
class Heartbeat:
    rank: int
    step: int
    beat: int
    busy: str
    host: str
    pid: int
    ppid: int
    where: str = ""
    """The training thread's innermost Python frame: ``file:line function``."""
    waiting: bool = False
    """The training thread is inside :meth:`Watchdog.waiting`: waiting for its peers (in a
    collective, or for a collective's result), not hanging them."""
    node: int = -1
    """Its node, named by the node's first rank (ranks are numbered node by node)."""
    unreachable: list[int] = field(default_factory=list)
    """The nodes its node's first worker could not reach on the data network at its last try
    (reach.py): only while its step waits."""


STDLIB = sysconfig.get_paths()["stdlib"]


def training_thread_position(thread_id: int | None) -> str:
    """Where a thread stands: its innermost frame outside the standard library."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    while frame is not None and frame.f_code.co_filename.startswith(STDLIB):
        frame = frame.f_back
    if frame is None:
        return ""
    code = frame.f_code
    return f"{code.co_filename}:{frame.f_lineno} {code.co_name}"


@dataclass
class Verdict:
    """Why the group is hung, and who hangs it (empty when nobody can tell)."""

    suspects: list[int]
    silent: list[int]
    """Ranks whose heartbeat stopped: not running at all."""
    reason: str
    heartbeats: dict[int, Heartbeat]


class StoreSilent(Exception):
    """The store did not answer in time: its host (rank 0) is stopped or gone."""


class WatchdogClosed(StoreSilent):
    """Closed (its generation over) before a store call began: a verdict meanwhile is dropped."""


def probers(world_size: int) -> list[int]:
    """The ranks that read the heartbeats: the first and the last, on two nodes where it has two."""
    return sorted({0, world_size - 1})
