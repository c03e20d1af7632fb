"""A peer gone silent, found as fast as a crash.

A crashed process's kernel answers for it: its connections reset, the others' collective fails
at once, and they go on without it in about 1.7 s. A node whose power, NIC, cable or switch port
fails answers nothing: the others' collective just waits, and so does a process that is stopped
(SIGSTOP) or wedged. Before this watch, such a peer was named only at the watchdog's hang verdict
(``--hang-timeout``, 10 s).

Every process raises its pulse every ``PULSE_S`` on its node's board, and one worker of the
node writes the node's pulses into the coordination store (board.py). The watchdog's two
*probers* (its first and last rank, on two nodes wherever the job has two) read the generation's
pulses every ``LOOK_S`` (one ``multi_get`` of one record per node), and where a member's pulse
stood still for ``SILENT_PULSES`` of the prober's own (about 1.5 s) while the prober has been
waiting for its peers for ``STALL_S``, it declares that member hung, as the hang verdict does: the
survivors go on in process without it (membership.py), and its node's other workers kill it if
it still runs (recovery.py). Measured by the prober's own pulse, not its clock: a store that
stalls, or a prober starved of CPU, holds back both.

Both conditions matter. A member whose pulse stood still while steps went on took part in them
(every step's all-reduce needs every rank): it is starved of CPU, not gone, and dropping it
would cost the job a restart of that node. A prober that is itself stepping, saving or
evaluating is not held up by anyone. A node that reaches its peers but not the store is found
the same way (its pulses stop reaching the store while the others wait for it): it is cut off
from the job's coordination, and the others go on without it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from elastic_mnist.errors import first_line
from elastic_mnist.resilience.agreement import PULSE_S, SILENT_PULSES, PulseKey, Pulses, pulse_key
from elastic_mnist.resilience.read_once import ReadOnce

log = logging.getLogger(__name__)

LOOK_S = PULSE_S
"""How often a prober reads the pulses: at 1,000 nodes, two probers read 20,000 records a
second, a quarter of what the store's event loop answers (``make scale``), and only while the
job runs a step, never in a change."""
STALL_S = 1.0
"""How long the prober must have waited for its peers (in a collective, or for its result)
before a silent member is named: more than the steps of a healthy job here (0.05 to 0.5 s), less
than the silence (1.5 s), so that it delays no verdict; and at least ``STALL_STEPS`` of the
slowest recent steps, where steps are slow (many ranks on few cores starve pulse threads too)."""
STALL_STEPS = 2
TOGETHER_PULSES = 3
"""Pulses (of the reader's own) within which the ranks of one node's record fell silent
together."""
SILENT_S = SILENT_PULSES * PULSE_S
"""The silence that names a member, in seconds of the prober's own pulse."""


class GenerationPulses:
    """Which members of one generation are silent now, by their pulses: the generation's
    identities (``known``, read ahead by its watchers as it begins) say where each member's
    pulse is; ``own``, where the reader's is. Read on ``store``, the watchdog's connection (a read
    that a silent store holds there holds the heartbeats, which are bounded, and no declaration
    or fence question)."""

    def __init__(self, store: dist.Store, known: ReadOnce, own: PulseKey):
        self.store, self.known, self.own = store, known, own
        self._pulses: Pulses | None = None

    def __call__(self) -> set[int] | None:
        """The silent members, or None while the generation's identities are not read yet.

        A node's pulses travel in one record: where it stops being written, its ranks fall
        silent together, each counted from its own last pulse in it (a look apart, at most).
        The ranks of a silent one's record that stood still within ``TOGETHER_PULSES`` of it
        are named with it, instead of one now and the others only in the recovery, whose own
        look at the pulses begins anew (1.5 s more, ``make partitions``' rank0-30)."""
        if self._pulses is None:
            if not self.known.ready:
                return None
            self._pulses = Pulses(self.store, {rank: pulse_key(identity) for rank, identity
                                               in self.known.items()}, self.own)
        silent, keys, seen = self._pulses.silent(), self._pulses.keys, self._pulses.seen
        latest: dict[str, int] = {}  # record → when its silent ranks' pulses last moved
        for rank in silent:
            if keys.get(rank) is not None:
                latest[keys[rank][0]] = max(latest.get(keys[rank][0], -1), seen[rank][1])
        if not latest:
            return silent
        records: dict[str, list[int]] = {}
        for rank in seen:
            if keys.get(rank) is not None and keys[rank][0] in latest:
                records.setdefault(keys[rank][0], []).append(rank)
        for record, ranks in records.items():  # only where the whole record stopped: a rank
            # of it whose pulse moves, or stood still later (starved, alive), names nobody more
            if all(seen[rank][1] <= latest[record] + TOGETHER_PULSES for rank in ranks):
                silent |= set(ranks)
        return silent


class SilenceWatch:
    """A prober's watch over its generation's pulses, in a thread of its own."""

    def __init__(self, rank: int, silent: Callable[[], set[int] | None],
                 stalled_s: Callable[[], float | None],
                 declare: Callable[[list[int], str], None], stop: threading.Event,
                 slowest_step_s: Callable[[], float] = lambda: 0.0,
                 cut: Callable[[float | None], tuple[list[int], str]] | None = None):
        """``silent()``: the members whose pulse stopped (None: not known yet);
        ``stalled_s()``: how long this rank has waited for its peers in its current wait (None
        while it does not); ``declare(ranks, reason)``: names them; ``stop``: set when the
        generation watched is over; ``slowest_step_s()``: of the recent steps; ``cut(s)``: the
        ranks of the nodes cut off from their peers, and why, by what the nodes found in the
        ``s`` seconds they have tried (reach.py; None: this wait is too short)."""
        self.rank, self.silent, self.stalled_s = rank, silent, stalled_s
        self.declare, self.stop, self.slowest_step_s = declare, stop, slowest_step_s
        self.cut = cut
        self._thread = threading.Thread(target=self._run, daemon=True, name="watchdog-silence")

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self.stop.wait(LOOK_S):
            try:
                # Read at every look, stalled or not: a member's silence is counted from its
                # last pulse, not from the moment this rank began to wait for it.
                silent = self.silent()
            except RuntimeError as e:  # DistStoreError: the store went; the probe names it
                log.debug("the pulses were not read: %s", first_line(e))
                continue
            silent = sorted((silent or set()) - {self.rank})
            stalled, after = self.stalled_s(), stall_after(self.slowest_step_s())
            if stalled is None or stalled < after:
                self._cut(None)  # a wait begins anew
                continue
            if not silent:  # alive, all of them: cut off from their peers? (reach.py)
                silent, why = self._cut(stalled - after)
                if not silent or self.rank in silent:  # its own node: the other prober says it
                    continue
            else:
                why = (f"no pulse for {SILENT_S:.1f} s: stopped, wedged, or cut off from the "
                       f"coordination store")
            began = time.monotonic()
            self.declare(silent, why)
            log.debug("verdict declared in %.3f s", time.monotonic() - began)
            return

    def _cut(self, trying_s: float | None) -> tuple[list[int], str]:
        """What the nodes found (:attr:`cut`), nothing where it cannot be read."""
        try:
            return self.cut(trying_s) if self.cut is not None else ([], "")
        except Exception as e:  # noqa: BLE001 - StoreSilent, a store error: the probe names it
            log.debug("what the nodes found was not read: %s", first_line(e))
            return [], ""


def stall_after(slowest_step_s: float) -> float:
    """How long a prober waits for its peers before it names one silent or cut off, and a
    node's first worker before it tries the others (reach.py): ``STALL_S``, or ``STALL_STEPS``
    of the slowest recent steps where steps are slow."""
    return max(STALL_S, STALL_STEPS * slowest_step_s)


def kill_stopped_siblings(agent: int, named: Callable[[], set[int]]) -> list[int]:
    """Kills this process's siblings (the other workers of its agent ``agent``) that are stopped
    (SIGSTOP: state T) and named hung, returning their pids: a rank named hung whose process is
    stopped obeys its agent's SIGTERM only when continued, and the agent waits 30 s for it, or
    for ever at the job's end. ``named()``: the pids of the ranks named, on this host, asked
    only where a sibling is stopped (each survivor of a hang looks at its own node in ``/proc``,
    and asks the store nothing otherwise). A process traced (a debugger, py-spy: state t), or
    stopped but not named, is left alone."""
    stopped = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses; the last ")"
            # ends it.
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if len(fields) > 1 and int(fields[1]) == agent and fields[0] == "T":
            stopped.append(int(entry.name))
    if not stopped:
        return []
    try:
        pids = named()
    except RuntimeError as e:  # DistStoreError: a kill is no reason to fail the recovery
        log.warning("could not read which ranks were named hung (%s): a stopped sibling is "
                    "left to its agent", first_line(e))
        return []
    killed = [pid for pid in stopped if pid in pids]
    for pid in killed:
        log.error("killing pid %d, a stopped worker of this node named hung", pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return killed
