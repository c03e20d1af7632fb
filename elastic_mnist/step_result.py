"""What one step of the loop tells what follows it: the step's agreed loss and accuracy, and what
every rank learned in its one collective (a stop, the skipped, the leavers, an admission,
every rank's own compute time).

A room of its own, below both the loop that makes it (trainer.py) and the report that reads it
(report.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepResult:
    loss: float
    accuracy: float
    samples: int
    stop_requested: bool
    """Every rank asked to stop (or one did, where the others cannot go on without it)."""
    seconds: float = 0.0
    data_wait_s: float = 0.0
    nonfinite_ranks: list[int] = field(default_factory=list)
    """Ranks whose loss or own gradients were NaN or infinite: the step was skipped."""
    checkpoint_failed: bool = False
    """Rank 0 could not save a checkpoint (a write failed, or it refused non-finite weights):
    every rank stops."""
    leavers: list[int] = field(default_factory=list)
    """Ranks that asked to stop while the others go on without them, from the next step."""
    admit: bool = False
    """Rank 0 decided to admit joining nodes: every rank moves to their generation after this
    step."""
    evict_voted: bool = False
    """Some rank voted that the stragglers are evicted (eviction.py)."""
    evicted: list[int] = field(default_factory=list)
    """Ranks the job lets go after this step, as slower than F (``--evict-slower-than``)."""
    compute_s: list[float] = field(default_factory=list)
    """Every rank's own compute seconds of the step, without its wait for the others (pace.py)."""
