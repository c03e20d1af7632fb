"""``--audit-samples``: every rank's record of the sample indices it used at each step, from which
scripts/check_audit.py checks that every completed epoch used every sample exactly once.

A room of its own, below the writers that hold it (writers.py) and the job that builds it
(duties.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from elastic_mnist.resilience.fence import NO_FENCE, NullFence


class AuditLog:
    """``--audit-samples``: one JSON line per step with the sample indices this rank used,
    written as the rank reaches the step's last collective (scripts/check_audit.py takes, for each
    step, the newest generation's records, so a step cut short and redone counts once). Each
    record passes ``fence`` (a verdict of the last second will do)."""

    def __init__(self, path: Path | None, fence: NullFence = NO_FENCE):
        self.fence = fence
        self.file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a", buffering=1)  # noqa: SIM115 - closed by close()

    def indices(self, micro_batches: list[torch.Tensor]) -> list[int]:
        """The sample indices of this rank's micro-batches, read back from the device at the
        step's start, before it queues a collective (a read behind one waits for the peers)."""
        if self.file is None or not micro_batches:  # they leave the device only for the audit
            return []
        return torch.cat(micro_batches).tolist()

    def record(self, step: int, epoch: int, rank: int, world_size: int,
               indices: list[int], compute_s: float | None = None) -> None:
        """``compute_s``: this rank's own compute seconds of the step (pace.py), from which
        scripts/stragglers.py reads every rank's speed (samples per second of its own work)."""
        if self.file is not None:
            self.fence.check(recent=True)
            self.file.write(json.dumps({"step": step, "epoch": epoch, "rank": rank,
                                        "world_size": world_size, "time": time.time(),
                                        "compute_s": compute_s, "indices": indices}) + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
