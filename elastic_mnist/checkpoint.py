"""Checkpoints that can be trusted: durable writes, verified loads, a policy owned in one place.

On disk, under ``--checkpoint-dir``::

    step-00000120.pt     the payload (torch.save of plain data and tensors)
    step-00000120.json   its manifest, written after the payload: the commit record
    latest               name of the newest committed checkpoint, moved last
    run.json             the run id and the restart generation of the job using this folder
    lease.json           which live job uses this folder (elastic_mnist/resilience/lease.py)
    generation.json      the job's current generation, for the fence (resilience/current.py)

A payload without a manifest was never committed and is ignored. A payload whose sha256 differs
from its manifest's is skipped with a warning, and the one before it is used.
"""

from __future__ import annotations

import datetime
import errno
import hashlib
import io
import json
import logging
import os
import pickle
import queue
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from elastic_mnist.data.order import epoch_number
from elastic_mnist.errors import (
    CheckpointError,
    CheckpointWriteError,
    InvalidCheckpoint,
    RefusedToSave,
)
from elastic_mnist.fsutil import TEMP_SUFFIX, atomic_write_bytes
from elastic_mnist.resilience.fence import NO_FENCE, NullFence

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
POINTER = "latest"
RUN_FILE = "run.json"


@dataclass(frozen=True)
class Manifest:
    """What a checkpoint holds, readable without loading it."""

    file: str
    step: int
    epoch: int
    cursor: int
    samples_seen: int
    world_size: int
    run_id: str
    restart_generation: int
    sha256: str
    bytes: int
    saved_at: str
    format: int = FORMAT_VERSION
    data_fingerprint: str = ""
    """Of the digits it was trained on (data/fingerprint.py); empty in older checkpoints."""

    @property
    def name(self) -> str:
        return Path(self.file).stem

    @property
    def epoch_number(self) -> int:
        """The epoch of this step counted from 1, as logs say it; ``epoch`` is the index of the
        epoch the data cursor is in (the epochs completed before it)."""
        return epoch_number(self.step, self.epoch, self.cursor)


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def payload_bytes(payload: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()


def write_checkpoint(directory: Path, payload: dict[str, Any], *, restart_generation: int,
                     keep_last: int, fence: NullFence = NO_FENCE) -> Manifest:
    """Commits ``payload`` durably: payload, then manifest, then the pointer; then prunes.
    ``fence`` is asked before each of the three is put in place, and before pruning (fence.py):
    a process the job went on without deletes nothing of it."""
    directory = Path(directory)
    data = payload_bytes(payload)
    progress = payload["progress"]
    name = checkpoint_name(progress["step"])
    manifest = Manifest(
        file=f"{name}.pt",
        step=progress["step"],
        epoch=progress["epoch"],
        cursor=progress["cursor"],
        samples_seen=progress["samples_seen"],
        world_size=payload["world_size"],
        run_id=payload["run_id"],
        restart_generation=restart_generation,
        sha256=hashlib.sha256(data).hexdigest(),
        bytes=len(data),
        saved_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
        data_fingerprint=payload["data"].get("fingerprint", ""),
    )
    written: list[Path] = []
    try:
        for path, content in ((directory / manifest.file, data),
                              (directory / f"{name}.json",
                               json.dumps(asdict(manifest), indent=2).encode()),
                              (directory / POINTER, f"{name}\n".encode())):
            fence.check()
            atomic_write_bytes(path, content)
            written.append(path)
    except BaseException:
        # Not committed until the pointer moved: take the new files back, so that what is left
        # is the previous checkpoint, named by the pointer (a full disk must not cost space).
        for path in written:
            path.unlink(missing_ok=True)
        raise
    fence.check()
    prune(directory, keep_last)
    return manifest


def nonfinite_entries(payload: dict[str, Any]) -> list[str]:
    """Names of the model's and optimizer's tensors that hold NaN or infinity."""
    found = []
    for section in ("model", "optimizer"):
        stack: list[tuple[str, Any]] = [(section, payload[section])]
        while stack:
            name, value = stack.pop()
            if isinstance(value, dict):
                stack.extend((f"{name}.{key}", item) for key, item in value.items())
            elif isinstance(value, (list, tuple)):
                stack.extend((f"{name}.{i}", item) for i, item in enumerate(value))
            elif (isinstance(value, torch.Tensor) and value.is_floating_point()
                  and not bool(torch.isfinite(value).all())):
                found.append(name)
    return sorted(found)


def check_writable(directory: Path) -> None:
    """Creates ``directory`` and writes a file into it; CheckpointWriteError, in one line, if
    either fails: found at start-up, not at the first save."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe.", dir=directory)  # one per process
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise unwritable(directory, e) from None


def unwritable(directory: Path, error: OSError) -> CheckpointWriteError:
    """The one line that says why the checkpoint folder cannot be written."""
    return CheckpointWriteError(f"checkpoint folder {directory} cannot be written: "
                                f"{error.strerror or error}")


def describe_write_failure(directory: Path, step: int, error: OSError) -> str:
    """What a failed save means for the user: which folder, why, and what is safe on disk."""
    last = newest_committed_step(directory)
    kept = (f"the last good checkpoint is step {last} ({checkpoint_name(last)}.pt, named by "
            f"{POINTER})" if last else "no checkpoint had been committed yet")
    reason = error.strerror or str(error)
    state = "is full" if error.errno in (errno.ENOSPC, errno.EDQUOT) else "cannot be written"
    return (f"checkpoint folder {directory} {state} ({reason}) saving step {step}; {kept}; "
            f"nothing half-written was left")


def prune(directory: Path, keep_last: int) -> None:
    """Removes all but the newest ``keep_last`` committed checkpoints."""
    for manifest_path in sorted(Path(directory).glob("step-*.json"))[:-keep_last]:
        manifest_path.with_suffix(".pt").unlink(missing_ok=True)
        manifest_path.unlink(missing_ok=True)


def remove_stale_temp_files(directory: Path) -> None:
    """Temp files left by a writer that was killed mid-write."""
    for tmp in Path(directory).glob(f".*{TEMP_SUFFIX}"):
        tmp.unlink(missing_ok=True)


def newest_committed_step(directory: Path) -> int:
    """The step of the newest committed checkpoint (its manifest written), 0 if none; read from
    the file names alone, cheap enough to poll."""
    steps = [int(path.stem.split("-")[1]) for path in Path(directory).glob("step-*.json")]
    return max(steps, default=0)


def list_manifests(directory: Path) -> list[Manifest | tuple[Path, str]]:
    """Every manifest in ``directory``, newest first; unreadable ones as (path, reason)."""
    found: list[Manifest | tuple[Path, str]] = []
    for path in sorted(Path(directory).glob("step-*.json"), reverse=True):
        try:
            found.append(Manifest(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError) as e:
            found.append((path, f"unreadable manifest: {e}"))
    return found


def read_verified(directory: Path, manifest: Manifest) -> bytes:
    """The payload's bytes, checked against the manifest; InvalidCheckpoint if they differ."""
    path = Path(directory) / manifest.file
    try:
        data = path.read_bytes()
    except OSError as e:
        raise InvalidCheckpoint(f"{path}: {e.strerror}") from None
    if len(data) != manifest.bytes:
        raise InvalidCheckpoint(f"{path} is truncated or corrupt: {len(data)} bytes, "
                                f"the manifest says {manifest.bytes}")
    if hashlib.sha256(data).hexdigest() != manifest.sha256:
        raise InvalidCheckpoint(f"{path} is corrupt: its sha256 differs from the manifest's")
    return data


def deserialize(data: bytes, source: str) -> dict[str, Any]:
    """Loads a payload with ``weights_only=True``: plain data and tensors, never code."""
    try:
        payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        reason = str(e).strip().splitlines()[0]
        raise CheckpointError(f"refused {source}: it holds pickled objects that could run code, "
                              f"and only tensors and plain data are loaded ({reason})") from None
    except Exception as e:  # noqa: BLE001 - any other failure means an unusable file
        raise InvalidCheckpoint(f"{source} cannot be read: {e}") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"refused {source}: not an elastic-mnist checkpoint of format "
                              f"{FORMAT_VERSION}")
    return payload


def newest_valid(directory: Path) -> tuple[Manifest, bytes] | None:
    """The newest checkpoint whose payload matches its manifest, skipping the others loudly."""
    for entry in list_manifests(directory):
        if not isinstance(entry, Manifest):
            log.warning("skipping %s: %s", *entry)
            continue
        try:
            return entry, read_verified(directory, entry)
        except InvalidCheckpoint as e:
            log.warning("skipping checkpoint: %s; falling back to the one before", e)
    return None


# --- the run's identity, kept beside its checkpoints ------------------------------------------


def read_run_file(directory: Path) -> dict[str, Any]:
    try:
        return json.loads((Path(directory) / RUN_FILE).read_text())
    except (OSError, ValueError):
        return {}


def write_run_file(directory: Path, run_id: str, generation: int) -> None:
    record = {"run_id": run_id, "restart_generation": generation}
    atomic_write_bytes(Path(directory) / RUN_FILE, json.dumps(record, indent=2).encode())


# --- saving without stalling training ---------------------------------------------------------


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
    """Owns the saving policy (every N steps, epoch ends, the end) and writes in the background.

    ``maybe_save`` blocks only to copy the state into CPU memory (and, rarely, to wait for the
    previous write); a writer thread serialises, hashes and commits it.
    """

    def __init__(self, directory: Path, *, every: int, keep_last: int, restart_generation: int,
                 before_write: Callable[[int], None] = lambda step: None,
                 taking_over_at: int | None = None, fence: NullFence = NO_FENCE):
        """``taking_over_at``: the step at which this rank 0 takes over, in process, from one
        that is gone. Its temp files are kept (its writer may still be finishing), and a
        checkpoint it committed at that step is not written again. Otherwise the temp files a
        writer killed mid-write left are taken back."""
        self.directory = Path(directory)
        self.before_write = before_write
        self.fence = fence
        """Called in the writer thread before each write, with its step (fault injection)."""
        self.every = every
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
        return final or epoch_end or (self.every > 0 and step % self.every == 0)

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
