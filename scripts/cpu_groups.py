"""CPU budgets for simulated nodes: each node a cgroup of its own whose CPU bandwidth (a quota of
CPU time every period) the kernel enforces, so that nodes sharing one machine each run as on a
machine of a fixed size, all at once, and one of them can be made k times slower.

    with CpuGroups(nodes=3, cores=2) as groups:      # or None from CpuGroups.unavailable()
        Popen([*groups.prefix(0), "bash", "jobs/node.sh", ...])   # the node joins its group
        groups.slow(2, 4.0)                           # node 2: a quarter of its budget

cgroup v1's cpu controller (``cpu.cfs_period_us``, ``cpu.cfs_quota_us``) or cgroup v2's
(``cpu.max``, at the hierarchy's root, ``+cpu`` in its ``cgroup.subtree_control``); root only.
The groups are named ``em-stragglers-<pid>-node<N>`` (``<pid>``: the harness's), made at the
hierarchy's root; leaving the ``with`` moves whatever is left in them to the root group and
removes them, and :func:`remove_stale` removes those of harnesses no longer alive (one killed
outright).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path
from typing import Self

import psutil

PREFIX = "em-stragglers"
PERIOD_US = 6_000
"""The quota's period: a node that has spent its quota waits for the next one, and its peers
with it where they wait for its answer in a collective; the shorter, the nearer to a machine
that is slower all the time (at 20 ms a 4× slower node lengthened the step's collectives and
update by 0.087 s, at 6 ms by 0.056). 6 ms is the shortest at which a third of 2 cores cut 4×
is still the kernel's least quota."""
MIN_QUOTA_US = 1_000
"""The kernel's smallest quota."""


def hierarchy() -> tuple[str, Path] | None:
    """("v1" or "v2", the root of the hierarchy that holds the cpu controller), None where there
    is none this process may use."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            _, where, kind, options, *_ = line.split()
            if kind == "cgroup" and "cpu" in options.split(","):
                return "v1", Path(where)
        for line in Path("/proc/self/mounts").read_text().splitlines():
            _, where, kind, *_ = line.split()
            if kind == "cgroup2" and "cpu" in (Path(where) / "cgroup.controllers").read_text(
                    ).split():
                return "v2", Path(where)
    return None


def unavailable() -> str | None:
    """Why no CPU budgets can be had here, in a few words; None where they can."""
    if os.geteuid() != 0:
        return "not root"
    found = hierarchy()
    if found is None:
        return "no cgroup cpu controller"
    version, root = found
    probe = root / f"{PREFIX}-{os.getpid()}-probe"
    try:
        if version == "v2":
            enable_cpu(root)
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        return f"cgroups: {e.strerror}"
    return None


def enable_cpu(root: Path) -> None:
    """cgroup v2: the cpu controller handed down to the root's children."""
    control = root / "cgroup.subtree_control"
    if "cpu" not in control.read_text().split():
        control.write_text("+cpu")


def remove_stale() -> list[str]:
    """Removes the groups of harnesses no longer alive; their names."""
    found = hierarchy()
    if found is None:
        return []
    removed = []
    for group in found[1].glob(f"{PREFIX}-*"):
        match = re.fullmatch(rf"{PREFIX}-(\d+)-.*", group.name)
        if match and not psutil.pid_exists(int(match[1])):
            remove(group, found[1])
            removed.append(group.name)
    return removed


def remove(group: Path, root: Path, timeout_s: float = 10.0) -> None:
    """Moves every process left in ``group`` to the root group, then removes it (a process
    that is exiting may keep it busy a moment)."""
    deadline = time.monotonic() + timeout_s
    while group.exists():
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):  # gone meanwhile
                (root / "cgroup.procs").write_text(pid)
        try:
            group.rmdir()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class CpuGroups:
    """A cgroup per node, each with ``cores / nodes`` of the machine's CPU time (a node of a
    machine of its own, the machine's cores shared evenly); :meth:`slow` cuts a node's quota to
    1/k of its budget: a k times slower machine, throttled by the kernel every period. Unlike
    stopping and continuing a node from outside, nothing is given back later (CFS gives a
    process continued after SIGSTOP what it missed, where the nodes compete for too few cores),
    and the nodes run at once: nobody waits for another's turn."""

    def __init__(self, nodes: int, cores: float, period_us: int = PERIOD_US,
                 name: str | None = None):
        found = hierarchy()
        if found is None:
            raise OSError("no cgroup cpu controller")
        self.version, self.root = found
        self.period_us = period_us
        self.budget_us = max(MIN_QUOTA_US, round(period_us * cores / nodes))
        """Each node's CPU microseconds a period, unslowed."""
        name = name or f"{PREFIX}-{os.getpid()}"
        self.groups = [self.root / f"{name}-node{n}" for n in range(nodes)]
        self.factors = [1.0] * nodes
        self._marks: dict[int, tuple[float, float]] = {}

    def __enter__(self) -> Self:
        with contextlib.ExitStack() as undo:
            undo.callback(self.close)  # whatever ends the making, no group is left half made
            if self.version == "v2":
                enable_cpu(self.root)
            for node, group in enumerate(self.groups):
                group.mkdir()
                self._set_quota(node, self.budget_us)
            undo.pop_all()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Every group removed, whatever is left in it moved to the root group."""
        for group in self.groups:
            remove(group, self.root)

    def prefix(self, node: int) -> list[str]:
        """A command prefix that puts the command into ``node``'s group before it runs (its
        children, forked later, are born in it): ``sh`` writes its pid to the group and execs
        the rest, so the command's pid is the Popen's."""
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.groups[node] / "cgroup.procs")]

    def join(self, node: int, pid: int) -> None:
        """Moves process ``pid`` (all its threads) into ``node``'s group."""
        (self.groups[node] / "cgroup.procs").write_text(str(pid))

    def slow(self, node: int, factor: float) -> None:
        """From the next period on, ``node`` has 1/``factor`` of its budget."""
        if factor < 1:
            raise ValueError(f"a slowdown is a factor of 1 or more, not {factor}")
        self._set_quota(node, max(MIN_QUOTA_US, round(self.budget_us / factor)))
        self.factors[node] = factor
        self._marks[node] = (time.monotonic(), self.cpu_s(node))

    def quota(self, node: int) -> float:
        """``node``'s quota in cores."""
        if self.version == "v2":
            quota, period = (self.groups[node] / "cpu.max").read_text().split()
        else:
            quota = (self.groups[node] / "cpu.cfs_quota_us").read_text()
            period = (self.groups[node] / "cpu.cfs_period_us").read_text()
        return int(quota) / int(period)

    def _set_quota(self, node: int, quota_us: int) -> None:
        group = self.groups[node]
        if self.version == "v2":
            (group / "cpu.max").write_text(f"{quota_us} {self.period_us}")
        else:  # the period first: a quota over the old period may be refused
            (group / "cpu.cfs_period_us").write_text(str(self.period_us))
            (group / "cpu.cfs_quota_us").write_text(str(quota_us))

    def pids(self, node: int) -> list[int]:
        return [int(p) for p in (self.groups[node] / "cgroup.procs").read_text().split()]

    def cpu_s(self, node: int) -> float:
        """CPU seconds the processes now in ``node``'s group have used (those that ended are
        not counted)."""
        total = 0.0
        for pid in self.pids(node):
            with contextlib.suppress(psutil.Error):
                times = psutil.Process(pid).cpu_times()
                total += times.user + times.system
        return total

    def duty(self, node: int) -> float | None:
        """The cores ``node`` used since :meth:`slow`, as a share of its unslowed budget: 1/k at
        most."""
        began, used = self._marks.get(node, (None, 0.0))
        if began is None:
            return None
        elapsed = time.monotonic() - began
        budget = self.budget_us / self.period_us
        return (self.cpu_s(node) - used) / elapsed / budget if elapsed > 0 else None
