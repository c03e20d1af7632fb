"""The job's current generation, for the fence: named in the coordination store, mirrored into
the checkpoint folder, and read back to tell a process whether it is still one of the job's ranks.

Every survivor of a change names the new generation current, with the processes of the last one
that it kept, before the new group is built (so before any of them commits in it). A process
the survivors went on without (a frozen rank woken) finds a later generation that did not keep
it, and leaves without writing (EXIT_DROPPED; fence.py asks :meth:`CurrentGeneration.dropped`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch.distributed as dist

from elastic_mnist.errors import EXIT_DROPPED, CannotTell, first_line
from elastic_mnist.fsutil import atomic_write_bytes
from elastic_mnist.resilience.agreement import Fault, decode_ranks, encode_ranks, generation_key
from elastic_mnist.resilience.fence import Over

log = logging.getLogger(__name__)

CURRENT = "current"
"""The key naming the job's current generation, and the processes of the last one it kept."""
GENERATION_FILE = "generation.json"
"""The same, mirrored into the checkpoint folder with the launch it belongs to: what the fence
decides from when the coordination store does not answer (see :meth:`CurrentGeneration.dropped`)."""


class CurrentGeneration:
    """The job's current generation as one process writes and reads it: on ``store`` (the
    coordination store under the launch's prefix), mirrored into ``folder`` (None: nowhere) for
    the launch ``launch``."""

    def __init__(self, store: dist.Store, folder: Path | None, launch: str):
        self.store, self.folder, self.launch = store, folder, launch

    def publish(self, generation: int, kept: list[int], mirror: bool) -> None:
        """Names ``generation`` the job's current one, with the ranks of the last that it
        ``kept`` (written as their runs, ``"0-4095,4104-7999"``: each node's fence reads the
        record every lease beat, and a list of every kept process was N·W bytes every 3 s):
        every survivor writes the same, before the new group is built, so before any of them
        commits in it; never over a later one. ``mirror``: this process writes the checkpoint
        folder's copy (each node's local rank 0 of the generation)."""
        value = json.dumps({"generation": generation, "kept": encode_ranks(kept)})
        found = ""
        while (found := self.store.compare_set(CURRENT, found, value).decode()) != value:
            if json.loads(found)["generation"] >= generation:
                return
        if mirror:
            self._mirror(generation, json.loads(value))

    def _mirror(self, generation: int, current: dict[str, Any]) -> None:
        """Writes the generation just named into the checkpoint folder (node-local folders
        each get theirs), never over a later one of this launch."""
        if self.folder is None:
            return
        try:
            found = read_generation_file(self.folder)
            if found is not None and found.get("launch") == self.launch \
                    and found["generation"] >= generation:
                return
            atomic_write_bytes(self.folder / GENERATION_FILE,
                               json.dumps({"launch": self.launch, **current}).encode())
        except OSError as e:  # the store's copy is the one asked first
            log.warning("could not mirror generation %d into %s: %s", generation,
                        self.folder / GENERATION_FILE, e.strerror or e)

    def dropped(self, generation: int, rank: int) -> Over | None:
        """Why the process that is ``rank`` of ``generation`` is no longer one of the job's
        ranks (the survivors of a fault went on in a generation without it), or None while it
        is, or is on its way to the current generation as one of the processes it kept, or left
        it of its own accord (its last records are its own).

        When the store does not answer (an outage, or its host gone first as the whole job
        stops), the checkpoint folder's ``GENERATION_FILE`` decides: dropped when it names a
        later generation of this launch that did not keep this process; else CannotTell (a
        commit goes on: the final checkpoint of a job stopped as a whole is written)."""
        store = self.store
        try:
            if not store.check([CURRENT]):
                return None
            current = json.loads(store.get(CURRENT))
            if still_in(current, generation, rank):
                return None
            key = generation_key(generation, "fault")
            fault = Fault(**json.loads(store.get(key))) if store.check([key]) else None
        except RuntimeError as e:  # DistStoreError, DistNetworkError: the store went
            return self.dropped_by_file(generation, rank, first_line(e))
        if fault is not None and fault.why in ("left", "evicted") and rank in fault.suspects:
            return None
        return Over(dropped_line(rank, generation, f"the job is at {current['generation']}"),
                    EXIT_DROPPED)

    def dropped_by_file(self, generation: int, rank: int, error: str) -> Over:
        """Why this process was dropped, as the checkpoint folder's ``GENERATION_FILE`` says it
        while the store does not answer (``error``: how it did not); CannotTell when the file
        does not say so."""
        found = read_generation_file(self.folder) if self.folder is not None else None
        if found is None or found.get("launch") != self.launch \
                or still_in(found, generation, rank):
            raise CannotTell(f"rank {rank} cannot tell whether it is still one of the job's "
                             f"ranks: the coordination store does not answer "
                             f"({error}), and {GENERATION_FILE} names no later "
                             f"generation without it")
        return Over(dropped_line(rank, generation, f"{GENERATION_FILE} says the job is at "
                                 f"{found['generation']}; the coordination store does not "
                                 f"answer"), EXIT_DROPPED)


def dropped_line(rank: int, generation: int, why: str) -> str:
    """The one line a process the job went on without leaves with, whichever thread learns it
    (a writer's fence, the recovery, the watchdog): ``why`` says how it knows."""
    return (f"rank {rank} was dropped from the job at generation {generation} ({why}): leaving "
            f"without writing")


def still_in(current: dict[str, Any], generation: int, rank: int) -> bool:
    """Whether the job's ``current`` generation (``{"generation", "kept"}``) leaves ``rank`` of
    ``generation`` one of its ranks: it is no later, or the next one, which kept it."""
    return current["generation"] <= generation or (
        current["generation"] == generation + 1 and rank in decode_ranks(current["kept"]))


def read_generation_file(folder: Path) -> dict[str, Any] | None:
    """The checkpoint folder's ``GENERATION_FILE``; None when there is none or it is unreadable."""
    try:
        found = json.loads((Path(folder) / GENERATION_FILE).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(found, dict) and isinstance(found.get("generation"), int) \
        and isinstance(found.get("kept"), str)
    return found if ok else None
