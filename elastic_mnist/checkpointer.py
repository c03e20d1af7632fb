"""Saving without stalling training: the checkpointer owns the saving policy (every N steps,
every S seconds, epoch ends, the end), copies the state to CPU memory and commits it from a writer thread in the
format checkpoint.py defines; ranks that do not save hold the null one, which does nothing."""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from elastic_mnist.checkpoint import (
    Manifest,
    checkpoint_name,
    describe_write_failure,
    nonfinite_entries,
    remove_stale_temp_files,
    write_checkpoint,
)
from elastic_mnist.errors import CheckpointWriteError, RefusedToSave
from elastic_mnist.resilience.fence import NO_FENCE, NullFence

log = logging.getLogger(__name__)


def snapshot(obj: Any) -> Any:
    """A deep copy of nested containers with every tensor copied to CPU memory."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot(v) for v in obj)
    return obj


class NullCheckpointer:
    """What ranks that do not write checkpoints get: every method does nothing."""

    last_blocking_ms = 0.0
    last_manifest: Manifest | None = None
    failed = False

    def maybe_save(self, state_fn, step: int, *, epoch_end: bool = False,
                   final: bool = False) -> bool:
        return self.should_save(step, epoch_end=epoch_end, final=final)

    def should_save(self, step: int, *, epoch_end: bool = False, final: bool = False) -> bool:
        return False

    def wait(self) -> None:
        pass

    def close(self) -> None:
        pass


class Checkpointer(NullCheckpointer):
    """Owns the saving policy (every N steps, every S seconds, epoch ends, the end) and writes in
    the background.

    ``maybe_save`` blocks only to copy the state into CPU memory (and, rarely, to wait for the
    previous write); a writer thread serialises, hashes and commits it.
    """

    def __init__(self, directory: Path, *, every: int, keep_last: int, restart_generation: int,
                 every_seconds: float = 0.0,
                 before_write: Callable[[int], None] = lambda step: None,
                 taking_over_at: int | None = None, fence: NullFence = NO_FENCE,
                 clock: Callable[[], float] = time.monotonic):
        """``every``, ``every_seconds``: also save every that many steps, and at the first step
        that ends that many seconds after the last save began (or after this checkpointer was
        made; at once where it takes over), so that a restart redoes a bounded time of training
        whatever the step time (0: neither). ``taking_over_at``: the step at which this rank 0 takes over, in process, from one
        that is gone. Its temp files are kept (its writer may still be finishing), and a
        checkpoint it committed at that step is not written again. Otherwise the temp files a
        writer killed mid-write left are taken back."""
        self.directory = Path(directory)
        self.before_write = before_write
        self.fence = fence
        """Called in the writer thread before each write, with its step (fault injection)."""
        self.every = every
        self.every_seconds = every_seconds
        self.clock = clock
        # A rank 0 that takes over knows nothing of its predecessor's last save: it saves at its
        # first step, so that what a restart redoes stays bounded across the change.
        self._last_save_began = -math.inf if taking_over_at is not None else clock()
        self.keep_last = keep_last
        self.restart_generation = restart_generation
        self.directory.mkdir(parents=True, exist_ok=True)
        if taking_over_at is None:
            remove_stale_temp_files(self.directory)
        self._last_saved_step = -1
        if taking_over_at is not None and (self.directory /
                                           f"{checkpoint_name(taking_over_at)}.json").exists():
            self._last_saved_step = taking_over_at
        self._jobs: queue.Queue = queue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._write_loop, name="checkpoint-writer",
                                        daemon=True)
        self._thread.start()
        self.last_manifest = None
        self.on_commit: Callable[[Manifest, float], None] = lambda manifest, blocking_ms: None
        """Called from the writer thread after each commit, with the save's blocking time."""

    def should_save(self, step: int, *, epoch_end: bool = False, final: bool = False) -> bool:
        if step == self._last_saved_step or step == 0:
            return False
        return final or epoch_end or (self.every > 0 and step % self.every == 0) or self.time_due()

    def time_due(self) -> bool:
        """``every_seconds`` have passed since the last save began."""
        return (self.every_seconds > 0
                and self.clock() - self._last_save_began >= self.every_seconds)

    def maybe_save(self, state_fn, step: int, *, epoch_end: bool = False,
                   final: bool = False) -> bool:
        """Saves the state returned by ``state_fn()`` if the policy says so; True if it did.

        A state that holds non-finite values is refused, not saved: the refusal fails the
        checkpointer as a failed write does (``failed``; ``wait`` raises RefusedToSave), so that
        the next step's flags stop every rank with EXIT_CANNOT_SAVE. A final save has no next
        step: its refusal is raised at once."""
        if not self.should_save(step, epoch_end=epoch_end, final=final):
            return False
        if self.failed and not final:  # said by the step's collective; saving more cannot help
            return False
        start = time.perf_counter()
        self._last_save_began = self.clock()
        self.wait()
        payload = snapshot(state_fn())
        bad = nonfinite_entries(payload)
        if bad:
            self._error = RefusedToSave(f"refusing to save step {step}: {', '.join(bad[:3])} "
                                        f"hold non-finite values")
            if final:
                self.wait()
            return False
        self.last_blocking_ms = (time.perf_counter() - start) * 1e3
        self._idle.clear()
        self._jobs.put((payload, self.last_blocking_ms))
        self._last_saved_step = step
        if final:
            self.wait()
        return True

    @property
    def failed(self) -> bool:
        """A write failed, or a save was refused (the error waits for ``wait``); no checkpoint
        is saved after it."""
        return self._error is not None

    def wait(self) -> None:
        """Blocks until the pending write is committed; re-raises a failure of the writer."""
        self._idle.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        self.wait()
        self._jobs.put(None)
        self._thread.join()

    def _write_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            payload, blocking_ms = job
            step = payload["progress"]["step"]
            try:
                self.before_write(step)
                self.last_manifest = write_checkpoint(
                    self.directory, payload, restart_generation=self.restart_generation,
                    keep_last=self.keep_last, fence=self.fence)
                log.info("checkpoint %s committed (%d bytes, %.1f ms blocking)",
                         self.last_manifest.file, self.last_manifest.bytes, blocking_ms)
                self.on_commit(self.last_manifest, blocking_ms)
            except OSError as e:  # a full or read-only disk: expected, said in one line
                self._error = CheckpointWriteError(describe_write_failure(self.directory, step, e))
            except BaseException as e:  # noqa: BLE001 - handed to the training thread
                self._error = e
            finally:
                self._idle.set()
