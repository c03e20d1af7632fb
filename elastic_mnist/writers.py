"""What the loop writes through, for one generation of the group: a bundle built whole.

The job (duties.py's ``Duties``) builds one bundle at the start and a new one after each change of
membership (``duties.after(change)``), handed to the Trainer whole (``Trainer.take``): once a resume
is checked against the run (before it, no run file is opened), then as the answer to its change.
Nobody sets a trainer's writers one by one from outside. Ranks that must not
write hold the null ones, which do nothing. Threads that report (the checkpoint writer's commits,
the watchdog's hang) write through the objects of their bundle, never through the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic_mnist.audit import AuditLog
from elastic_mnist.checkpointer import NullCheckpointer
from elastic_mnist.errors import CheckpointError
from elastic_mnist.events import NullEventLog
from elastic_mnist.metrics import NullMetrics
from elastic_mnist.progress import LogLines
from elastic_mnist.resilience.faults import Faults
from elastic_mnist.resilience.watchdog import NullWatchdog


@dataclass
class Writers:
    """One generation's writers; every field defaults to the one that does nothing."""

    metrics: NullMetrics = field(default_factory=NullMetrics)
    """TensorBoard scalars, images, text (rank 0)."""
    checkpointer: NullCheckpointer = field(default_factory=NullCheckpointer)
    """The saving policy and the writer thread (rank 0)."""
    audit: AuditLog = field(default_factory=lambda: AuditLog(None))
    """``--audit-samples``: the sample indices of every step (every rank)."""
    events: NullEventLog = field(default_factory=NullEventLog)
    """events.jsonl (rank 0)."""
    display: LogLines = field(default_factory=LogLines)
    """The progress bar on a TTY (rank 0)."""
    watchdog: NullWatchdog = field(default_factory=NullWatchdog)
    """This generation's progress watchdog (every rank, where there is a store to beat on)."""
    faults: Faults = field(default_factory=Faults)
    """Injected faults, for tests (faults.py)."""

    def close(self, dropped: bool = False) -> None:
        """The files of the writers that outlive the loop: checkpoints, display, dashboards,
        audit (events.jsonl stays open for the job's last records). ``dropped``: the job went on
        without this process, which leaves with that one line; a failed save it still holds is
        not its to say any more (the survivors have their own checkpointer)."""
        try:
            self.checkpointer.close()
        except CheckpointError:
            if not dropped:
                raise
        self.display.close()
        self.metrics.close()
        self.audit.close()
