#!/usr/bin/env python3
"""Stragglers: what one slow node costs the job, what ``--balance`` wins back, and the ideal.

    scripts/stragglers.py [--factors 1.5,2,4] [--steps 160] [--no-tbf] [--tbf-rate 4mbit]
                          [--cores N] [--period-us US] [--time-share] [--json FILE]
                          [--plot FILE.png]

3 nodes × 2 workers on this machine (chaos.py's Cluster: each node its own torchrun agent through
``jobs/node.sh``, the store served by ``elastic-mnist rendezvous``), synthetic digits, the job's
default steps of GLOBAL_BATCH samples in micro-batches of MICRO_BATCH, ``--audit-samples``. Each
run is clean up to step LEAD_STEP (its own clean rate, from step CLEAN_FROM: past the warm-up),
then node 2 is slowed until the job's last step. For each factor k of ``--factors`` two runs, one
after the other: without mitigation (``--no-balance``) and with ``--balance``, their order
alternated from one factor to the next (no-balance first for the first factor), so that the
machine's drift does not favour one of them. The slowdown:

    k× (cgroup quota) each node runs in a cgroup of its own (scripts/cpu_groups.py), made before
                     it starts, whose CPU bandwidth the kernel holds to ``--cores`` / 3 cores (a
                     machine of its own, the cores shared evenly; all nodes run at once); from
                     LEAD_STEP node 2's quota is cut to 1/k of that: a k times slower machine,
                     throttled by the kernel every period (``--period-us``). Where cgroups cannot be
                     had (not root, no cpu controller), or with ``--time-share``:
    k× (time share)  from the job's first step, each node's workers run only in their window of
                     every PERIOD_S and are stopped (SIGSTOP) for the rest, continued (SIGCONT) at
                     their turn (:class:`TimeShare`); from LEAD_STEP node 2's window is cut to 1/k
                     of itself. Where the machine has as many cores as ranks (``--cores``), every
                     window is the whole period and node 2 is simply stopped for (1 - 1/k) of each
    tbf              (where ``scripts/hosts.py check`` says a link can be slowed: root, network
                     namespaces) each node a host of its own (chaos.py's ``--hosts netns``), the
                     same budgets (or time share), and node 2's data link slowed to
                     ``--tbf-rate`` both ways from LEAD_STEP (``tc tbf``, hosts.Network.slow);
                     one pair of runs. Without it, its row says why

Why budgets and not node 2 alone stopped and continued: on fewer cores than ranks the nodes
compete for them, a node stopped leaves its cores to the others, and the scheduler gives a
process continued after a stop what it missed (see :class:`TimeShare`): slowed so, node 2 was not
slower than its peers. The time share mends that at a price: every collective waits for the
nodes' turns, which adds to the step what machines of their own would not (most of the step:
see the docs' figures), so a slow node costs less there, and less can be won back. A cgroup's
quota is the same duty cycle done by the kernel, with nothing given back and no turns.

Per run, from the audit records (``compute_s``: each rank's own compute seconds of a step) and
events.jsonl: the clean rate (samples/s, steps CLEAN_FROM to LEAD_STEP); the slowed rate, from
SETTLE_STEPS after the slowdown began to the last step, and with ``--balance`` also from the
first ``shares`` record's ``from_step`` (after the rebalance); the seconds from the slowdown to
the first ``straggler`` record; and exactly-once (scripts/check_audit.py, every rank busy in every
step). Each run's rates are also said as a fraction of its own clean rate: the two runs of a
pair ran minutes apart on a machine whose other load moves the clean rate, and the fractions
compare the slowdown, not the load.

The ideal is the job's rate if every rank were busy all through the step's compute at its
speed, a rank's speed being its samples over its own compute seconds in the window (ratio of
sums), S their sum: the clean step's time with its compute, the global batch at the clean S,
replaced by the global batch at the slowed S; the rest of the step (collectives, update, waits)
kept as it was clean, since it does not scale with the ranks' speed. The bare S (the issue's
words), or the clean rate scaled by S's ratio, would count that rest as if it shrank and grew
with the compute: no job reaches the bare S even clean. The speeds are the ``--balance`` run's
after its rebalance: there every rank computes all through the step, as the ideal assumes
(without mitigation the fast ranks wait, and their speed is judged on less work; both runs' are
in ``--json``). Under budgets the rest of the step has a part that does scale with node 2's
slowdown: its workers' share of the collectives (gloo's sums and copies on the CPU) runs at its
quota too, as it would on a slow machine; the ideal keeps it as it was clean, so it is a bound
that shares of compute alone cannot quite reach. Win-back, on the fractions of each run's clean
rate: (balanced − unmitigated) / (ideal − unmitigated), the balanced rate after the rebalance;
the issue's target is at least 0.8.

Output: a markdown table, ``--json FILE`` with every figure, ``--plot FILE.png``: samples/s over
time (10-step windows) of each pair, the slowdown's start, the detection and the rebalance marked.
Exit 1 where the harness failed or a sample was lost or doubled. A pair takes 2 to 4 minutes on
2 cores (4 to 7 in the time share), ``make stragglers`` (3 factors and tbf) about 11;
``--factors 2 --no-tbf`` checks it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import chaos
import check_audit
import cpu_groups
import hosts
import netfaults
from cluster import Cluster, network_hosts, worker_pids
from cpu_groups import CpuGroups
from processes import job_env

from elastic_mnist.events import event_time

NODES, NPROC = 3, 2
VICTIM = 2
"""The node slowed (of 0, 1, 2)."""
GLOBAL_BATCH, MICRO_BATCH = 768, 8
"""The job's default global batch and micro-batch: 96 micro-batches a step, 16 a rank evenly,
fine enough to share in proportion to speed (at 4× the slow node's ranks get 5 or 6)."""
STEPS_PER_EPOCH = 20
CLEAN_FROM = 15
"""The clean window's first step: past start-up, compilation and DDP's buckets."""
LEAD_STEP = 50
"""The step from which node 2 is slowed."""
SETTLE_STEPS = 5
"""Steps after the slowdown began that the slowed window leaves out (steps already under way)."""
PERIOD_S = 0.02
"""The time share's period: several per step (a step's compute is 100-200 ms here, taking turns),
so that every step of every node is cut about alike, and a wait for a node out of its turn is
short."""
DEFAULT_STEPS = 160
DEFAULT_TBF_RATE = netfaults.SLOW_RATE
"""Node 2's data link in the tbf pair: the partitions' slowed link. Each step's gradient sum
sends about 0.4 MB each way through it (netfaults.SLOW_RATE's note); at 20 Mbit/s the job lost
nothing measurable, the waits for the nodes' turns hiding the transfer."""
RATE_WINDOW = 10
"""The plot's rate: over the last this many steps (a step is about a second here)."""
TIMEOUT_S = 600.0
"""A run's whole time at most."""
CGROUP_QUOTA, TIME_SHARE = "cgroup quota", "time share"
"""How the nodes were given their cores and node 2 slowed, as the table says it."""


def windows(nodes: int, nproc: int, cores: int) -> list[tuple[float, float]]:
    """Each node's window of every period, (start, length) as fractions of it: where the cores
    are fewer than the ranks, the nodes take turns, as many at a time as the cores hold (a node
    of ``nproc`` workers needs ``nproc`` of them; one at least), each for an equal slot; else
    every node runs all the period."""
    at_a_time = max(1, cores // nproc)
    slots = -(-nodes // at_a_time)
    return [((n // at_a_time) / slots, 1 / slots) for n in range(nodes)]


class TimeShare:
    """Gives each node its own share of the cores, and slows one k-fold, from outside.

    On a machine of fewer cores than ranks the simulated nodes compete for them: a node slowed
    by stopping it leaves its cores to the others, and the scheduler gives a process continued
    after a stop what it missed (measured: 6 busy loops on 2 cores, 2 of them stopped half of
    every 40 ms, got 0.5 s of CPU in 5 s against the others' 0.75, not half; in a job of 3 × 2
    slowed so, node 2's ranks were as fast as their peers and the job as fast as clean). Here
    each node's workers run only in their window of every PERIOD_S (:func:`windows`) and are
    stopped (SIGSTOP) for the rest, so that no node runs on another's cores, as on machines of
    their own; :meth:`slow` shortens one node's window to 1/k of it. Where the cores are as many
    as the ranks, every window is the whole period and only the slowed node is ever stopped.
    From a thread of its own at a raised priority (where it may: it must keep time on a busy
    machine); :meth:`stop` (or leaving the ``with``) continues every process, whatever ended
    the run. :meth:`duty` says the share of the time a node ran (what the thread kept)."""

    def __init__(self, nodes: list[list[int]], cores: int, nproc: int = NPROC,
                 period_s: float = PERIOD_S):
        self.nodes = [list(pids) for pids in nodes]
        self.period_s = period_s
        self.windows = windows(len(nodes), nproc, cores)
        self.factors = [1.0] * len(nodes)
        self._stopped_s = [0.0] * len(nodes)
        self._stopped_at: list[float | None] = [None] * len(nodes)
        self._marks: dict[int, tuple[float, float]] = {}
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="time-share", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def slow(self, node: int, factor: float) -> None:
        """From the next period on, ``node`` runs 1/``factor`` of its window."""
        if factor < 1:
            raise ValueError(f"a slowdown is a factor of 1 or more, not {factor}")
        with self._lock:
            self.factors[node] = factor
            self._marks[node] = (time.monotonic(), self._stopped(node))

    def events(self) -> list[tuple[float, int, int]]:
        """One period's signals, (offset in seconds, node, signal), in order: a node's stop
        before another's continue at the same instant."""
        out = []
        with self._lock:
            for node, ((start, length), factor) in enumerate(zip(self.windows, self.factors,
                                                                 strict=True)):
                if length >= 1 and factor == 1:
                    continue  # the whole period: never stopped
                out += [(start * self.period_s, node, signal.SIGCONT),
                        ((start + length / factor) * self.period_s, node, signal.SIGSTOP)]
        return sorted(out, key=lambda e: (e[0], e[2] == signal.SIGCONT))

    def _signal(self, node: int, sig: int) -> None:
        for pid in self.nodes[node]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        now = time.monotonic()
        with self._lock:
            if sig == signal.SIGSTOP and self._stopped_at[node] is None:
                self._stopped_at[node] = now
            elif sig == signal.SIGCONT and self._stopped_at[node] is not None:
                self._stopped_s[node] += now - self._stopped_at[node]
                self._stopped_at[node] = None

    def _stopped(self, node: int) -> float:
        since = self._stopped_at[node]
        return self._stopped_s[node] + (0.0 if since is None else time.monotonic() - since)

    def _run(self) -> None:
        with contextlib.suppress(OSError):  # root may raise its priority: it keeps time better
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), -10)
        start = time.monotonic()
        period = 0
        try:
            while not self._done.is_set():
                began = start + period * self.period_s
                for offset, node, sig in self.events():
                    if self._done.wait(max(0.0, began + offset - time.monotonic())):
                        return
                    self._signal(node, sig)
                if self._done.wait(max(0.0, began + self.period_s - time.monotonic())):
                    return
                period = max(period + 1, int((time.monotonic() - start) / self.period_s))
        finally:
            for node in range(len(self.nodes)):
                self._signal(node, signal.SIGCONT)

    def stop(self) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        for node in range(len(self.nodes)):
            self._signal(node, signal.SIGCONT)

    def duty(self, node: int) -> float | None:
        """The share of the time ``node`` ran since :meth:`slow` (since the start if never
        slowed): 1/k of its window's share when the thread kept time."""
        with self._lock:
            began, stopped = self._marks.get(node, (None, 0.0))
            if began is None:
                return None
            elapsed = time.monotonic() - began
            return 1 - (self._stopped(node) - stopped) / elapsed if elapsed > 0 else None


@dataclass
class Run:
    """One job: how it was slowed, and what its records say."""

    name: str
    factor: float | None
    """Node 2's slowdown (its quota or its turn 1/k of itself); None for the tbf runs."""
    balance: bool
    slow_at: float = 0.0
    slow_step: int = 0
    duty: float | None = None
    """Node 2 since its slowdown: the CPU it used as a share of its unslowed budget, or in the
    time share the share of the time it ran (1/k of its window's at most)."""
    figures: dict = field(default_factory=dict)


# --- what the records say ------------------------------------------------------------------------


def step_times(records: list[dict]) -> dict[int, float]:
    """Each completed step's time (its last rank's record, newest generation)."""
    return {step: t for step, (t, _) in chaos.step_times(records).items()}


def rate(times: dict[int, float], first: int, last: int) -> float | None:
    """Samples a second from step ``first``'s end to step ``last``'s."""
    if first not in times or last not in times or last <= first:
        return None
    return (last - first) * GLOBAL_BATCH / (times[last] - times[first])


def speeds(records: list[dict], first: int, last: int) -> dict[int, float]:
    """Each rank's samples a second of its own compute over steps ``first`` < s <= ``last``
    (ratio of sums: a long step weighs what it lasted)."""
    done: dict[int, list[float]] = {}
    for r in records:
        if first < r["step"] <= last and r.get("compute_s"):
            samples, seconds = done.setdefault(r["rank"], [0.0, 0.0])
            done[r["rank"]] = [samples + len(r["indices"]), seconds + r["compute_s"]]
    return {rank: samples / seconds for rank, (samples, seconds) in sorted(done.items())
            if seconds > 0}


def ideal_fraction(clean_rate: float | None, clean_speeds: dict[int, float],
                   slowed_speeds: dict[int, float]) -> float | None:
    """The ideal rate as a fraction of the clean one: the clean step's time with its compute at
    the clean speeds' sum replaced by the same samples at the slowed speeds' sum (the rest of
    the step, its collectives, update and waits, kept as it was)."""
    before, after = sum(clean_speeds.values()), sum(slowed_speeds.values())
    if not clean_rate or not before or not after:
        return None
    return 1 / (1 - clean_rate / before + clean_rate / after)


def win_back(unmitigated: float | None, balanced: float | None,
             ideal: float | None) -> float | None:
    """(balanced − unmitigated) / (ideal − unmitigated): the share of what the slowdown cost
    that --balance won back (None where the slowdown cost nothing measurable)."""
    if None in (unmitigated, balanced, ideal) or ideal - unmitigated <= 0:
        return None
    return (balanced - unmitigated) / (ideal - unmitigated)


def first_event(events: list[dict], kind: str, since: float) -> dict | None:
    return next((e for e in events if e["event"] == kind and event_time(e) >= since), None)


def measure(run: Run, records: list[dict], events: list[dict]) -> dict:
    """A run's figures from its audit records and events (see the module's docstring)."""
    times = step_times(records)
    last = max(times, default=0)
    clean = (CLEAN_FROM, LEAD_STEP)
    slowed = (run.slow_step + SETTLE_STEPS, last)
    straggler = first_event(events, "straggler", run.slow_at)
    shares = first_event(events, "shares", run.slow_at)
    clean_rate = rate(times, *clean)
    clean_speeds = speeds(records, *clean)
    figures = {"clean": clean_rate, "slowed": rate(times, *slowed),
               "clean_speeds": clean_speeds, "slowed_speeds": speeds(records, *slowed),
               "ideal_fraction": ideal_fraction(clean_rate, clean_speeds,
                                                speeds(records, *slowed)),
               "detection_s": None if straggler is None else event_time(straggler) - run.slow_at,
               "named": None if straggler is None else straggler["ranks"],
               "factor_judged": None if straggler is None else straggler["factor"],
               "shares": None if shares is None else shares["shares"],
               "rebalanced_s": None if shares is None else event_time(shares) - run.slow_at,
               "slow_step": run.slow_step, "last_step": last, "duty": run.duty}
    if shares is not None:
        after = (shares["from_step"] + 1, last)
        figures["rebalanced"] = rate(times, *after)
        figures["rebalanced_speeds"] = speeds(records, *after)
        figures["ideal_fraction_rebalanced"] = ideal_fraction(clean_rate, clean_speeds,
                                                              figures["rebalanced_speeds"])
    for key in ("slowed", "rebalanced"):
        if figures.get(key) is not None and clean_rate:
            figures[f"{key}_fraction"] = figures[key] / clean_rate
    return figures


def pair_figures(unmitigated: dict, balanced: dict) -> dict:
    """A pair's win-back, on the fractions of each run's clean rate; the ideal from the
    --balance run's speeds after its rebalance (its whole slowed window where it had none). No
    rebalance, no win-back: the two runs then differ by the machine's drift alone."""
    ideal = balanced.get("ideal_fraction_rebalanced") or balanced.get("ideal_fraction")
    return {"ideal_fraction": ideal,
            "win_back": win_back(unmitigated.get("slowed_fraction"),
                                 balanced.get("rebalanced_fraction"), ideal),
            "win_back_whole": win_back(unmitigated.get("slowed_fraction"),
                                       balanced.get("slowed_fraction"), ideal)}


# --- running a job -------------------------------------------------------------------------------


def train_args(data: Path, shared: Path, steps: int, balance: bool) -> list[str]:
    return ["--dataset", "synthetic", "--data-dir", str(data),
            "--global-batch-size", str(GLOBAL_BATCH), "--micro-batch-size", str(MICRO_BATCH),
            "--epochs", "100000", "--max-steps", str(steps),
            "--checkpoint-dir", str(shared / "ckpt"), "--logdir", str(shared / "runs"),
            "--run-id", "chaos", "--checkpoint-every", "100", "--log-every", "20",
            "--audit-samples", "--device", "cpu", "--balance" if balance else "--no-balance"]


@contextlib.contextmanager
def slowed(run: Run, cluster: Cluster, slower: CpuGroups | TimeShare,
           tbf_rate: str) -> Iterator[None]:
    """Node VICTIM slowed while the block runs: its quota or its window of the time share 1/k of
    itself, or its data link by tc tbf (undone on the way out, whatever ends the block)."""
    run.slow_at = time.time()
    if run.factor is not None:
        slower.slow(VICTIM, run.factor)
        yield
        return
    host = cluster.host_of[VICTIM]
    try:
        cluster.network.slow(host, tbf_rate, "data")
        yield
    finally:
        cluster.network.heal(host, "data")


def run_job(run: Run, root: Path, data: Path, steps: int, env: dict[str, str],
            network: hosts.Network | None, cores: float, tbf_rate: str,
            period_us: int | None) -> dict:
    """One job of 3 × 2, each node its share of the cores from its first step (a cgroup's
    budget of every ``period_us``; None: a time share), node VICTIM slowed from
    LEAD_STEP; its figures and its audit's problems. The groups are removed on the way out,
    whatever ends the run."""
    workdir = root / run.name
    shared = workdir / "shared"
    workdir.mkdir(parents=True)
    observer = chaos.Observer(shared / "runs" / "chaos")
    deadline = time.time() + TIMEOUT_S
    with (CpuGroups(NODES, cores, period_us) if period_us else contextlib.nullcontext()) as groups:
        cluster = Cluster(workdir, train_args(data, shared, steps, run.balance), NODES,
                          "external", env, NPROC, network=network,
                          node_prefix=None if groups is None else groups.prefix)
        try:
            cluster.start_store()
            for _ in range(NODES):
                cluster.start_node()
            chaos.watch_start(observer, deadline)
            workers = [worker_pids(cluster.nodes[n].pid) for n in range(NODES)]
            if groups is not None:
                check_joined(groups, workers)
            with (contextlib.nullcontext(groups) if groups
                  else TimeShare(workers, round(cores))) as slower:
                wait(lambda: observer.step() >= LEAD_STEP, deadline, f"step {LEAD_STEP}")
                run.slow_step = observer.step()
                with slowed(run, cluster, slower, tbf_rate):
                    # node 2's use of its share while its workers are alive to say it
                    wait(lambda: observer.step() >= steps - 1, deadline, f"step {steps - 1}")
                    run.duty = slower.duty(VICTIM) if run.factor is not None else None
                    wait(observer.finished, deadline, "the job's end")
        finally:
            cluster.stop()
    problems = check_audit.check(observer.run_dir, STEPS_PER_EPOCH * GLOBAL_BATCH,
                                 every_rank_busy=True)
    events = observer.events()
    if sum(e["event"] == "start" for e in events) != 1:
        problems.append("the job restarted")
    records = observer.audit()
    return {**measure(run, records, events), "audit": problems,
            "series": series(records, run.slow_at)}


def check_joined(groups: CpuGroups, workers: list[list[int]]) -> None:
    """Every node's workers are in its group (born there: the agent joined it before it forked
    them); else the budgets would not hold them, and the run is the harness's failure."""
    for node, pids in enumerate(workers):
        outside = sorted(set(pids) - set(groups.pids(node)))
        if outside or not pids:
            raise RuntimeError(f"node {node}'s workers {outside or pids} are not in its cgroup")


def wait(done, deadline: float, what: str) -> None:
    while not done():
        if time.time() > deadline:
            raise TimeoutError(f"the job did not reach {what} in time")
        time.sleep(0.05)


def pairs(factors: list[float], tbf: bool) -> list[tuple[str, list[Run]]]:
    """The runs, a pair a slowdown, the order alternated: no-balance first for the first."""
    out = []
    for i, k in enumerate(factors):
        pair = [Run(f"x{k:g}-no-balance", k, False), Run(f"x{k:g}-balance", k, True)]
        out.append((f"{k:g}×", pair if i % 2 == 0 else pair[::-1]))
    if tbf:
        pair = [Run("tbf-no-balance", None, False), Run("tbf-balance", None, True)]
        out.append(("tbf", pair if len(factors) % 2 == 0 else pair[::-1]))
    return out


# --- saying it -----------------------------------------------------------------------------------


def number(value: float | None, spec: str = ".0f", unit: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{unit}"


def table(rows: dict[str, dict], tbf_rate: str) -> str:
    """The pairs as a markdown table: rates in samples/s and as a fraction of the run's own
    clean rate."""
    lines = [("| slowdown of node 2 | clean (samples/s) | without mitigation | with --balance | "
              "after its rebalance | ideal | win-back | detection (s) | shares | exactly once |"),
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for label, row in rows.items():
        what = (f"data link at {tbf_rate} (tc tbf)" if label == "tbf"
                else f"{label} ({row.get('slowed_by', TIME_SHARE)})")
        if "skipped" in row or "error" in row:
            said = row.get("skipped") or f"harness failed: {row['error']}"
            lines.append(f"| {what} | {said} | — | — | — | — | — | — | — | — |")
            continue
        u, b = row["no-balance"], row["balance"]

        def both(key: str, spec: str, r: dict) -> str:
            return (f"{number(r.get(key), spec)} "
                    f"({number(r.get(key + '_fraction'), '.0%')})")

        ideal = row["ideal_fraction"]
        detection = ", ".join(number(r["detection_s"], ".1f") for r in (u, b))
        exact = "yes" if not (u["audit"] or b["audit"]) else "NO"
        lines.append(
            f"| {what} | {number(u['clean'])}, {number(b['clean'])} | "
            f"{both('slowed', '.0f', u)} | {both('slowed', '.0f', b)} | "
            f"{both('rebalanced', '.0f', b)} | {number(ideal, '.0%')} | "
            f"{number(row['win_back'], '.0%')} | {detection} | "
            f"{'even' if not b['shares'] else ', '.join(map(str, b['shares']))} | {exact} |")
    return "\n".join(lines)


def plot(runs: dict[str, dict], path: Path) -> None:
    """Samples/s over time of each pair (10-step windows), seconds from the slowdown's start; the
    slowdown, the detection and the rebalance marked."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    labels = list(runs)
    fig = Figure(figsize=(8, 2.4 * len(labels)), dpi=80)
    FigureCanvasAgg(fig)
    for i, label in enumerate(labels):
        axis = fig.add_subplot(len(labels), 1, i + 1)
        for name, color in (("no-balance", "tab:red"), ("balance", "tab:blue")):
            series = runs[label].get(name, {}).get("series") or []
            axis.plot([t for t, _ in series], [v for _, v in series], color=color, lw=1,
                      label="--balance" if name == "balance" else "without mitigation")
        balanced = runs[label].get("balance", {})
        axis.axvline(0, color="0.3", ls="--", lw=1, label="slowdown")
        for key, style, said in (("detection_s", ":", "straggler named"),
                                 ("rebalanced_s", "-.", "rebalance (shares)")):
            if balanced.get(key) is not None:
                axis.axvline(balanced[key], color="tab:blue", ls=style, lw=1, label=said)
        axis.set_title("node 2's data link slowed (tc tbf)" if label == "tbf"
                       else f"node 2 slowed {label}", fontsize=9, loc="left")
        axis.set_ylabel("samples/s")
        axis.set_ylim(bottom=0)
    fullest = max(fig.axes, key=lambda a: len(a.get_lines()))  # every mark in one legend
    fullest.legend(fontsize=7, loc="lower left", ncol=3, frameon=False)
    fig.axes[-1].set_xlabel("seconds from the slowdown's start")
    fig.tight_layout()
    fig.savefig(path)


def series(records: list[dict], since: float) -> list[tuple[float, float]]:
    """(seconds since ``since``, samples a second over the last RATE_WINDOW steps) at each
    step."""
    times = sorted(step_times(records).values())
    return [(round(t - since, 2), RATE_WINDOW * GLOBAL_BATCH / (t - times[i - RATE_WINDOW]))
            for i, t in enumerate(times) if i >= RATE_WINDOW and t > times[i - RATE_WINDOW]]


# --- the whole ----------------------------------------------------------------------------------


def exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # the finally clauses run: every process continued, stopped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--factors", default="1.5,2,4",
                        help="node 2's slowdowns by time share, comma-separated (1.5,2,4)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                        help=f"each job's steps; node 2 is slowed from step {LEAD_STEP} "
                             f"({DEFAULT_STEPS})")
    parser.add_argument("--no-tbf", dest="tbf", action="store_false",
                        help="leave out the pair with node 2's data link slowed by tc tbf")
    parser.add_argument("--tbf-rate", default=DEFAULT_TBF_RATE,
                        help=f"node 2's data link in the tbf pair, tc's words "
                             f"({DEFAULT_TBF_RATE})")
    parser.add_argument("--cores", type=float, default=0,
                        help="the cores the nodes share (0: this process's, "
                             f"{len(os.sched_getaffinity(0))} here): each node's budget is a "
                             f"{NODES}rd of them; in the time share, fewer than the "
                             f"{NODES * NPROC} ranks: the nodes take turns on them")
    parser.add_argument("--period-us", type=int, default=cpu_groups.PERIOD_US,
                        help="the budgets' period in microseconds: node 2's quota is 1/k of its "
                             f"share of it, at least {cpu_groups.MIN_QUOTA_US} "
                             f"({cpu_groups.PERIOD_US})")
    parser.add_argument("--time-share", action="store_true",
                        help="slow node 2 by the time share even where cgroups can be had")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure here")
    parser.add_argument("--plot", type=Path, default=None,
                        help="samples/s over time of every pair (PNG)")
    args = parser.parse_args(argv)
    try:
        factors = [float(k) for k in args.factors.split(",") if k]
    except ValueError:
        parser.error(f"--factors: numbers, comma-separated, not {args.factors!r}")
    if any(k < 1 for k in factors):
        parser.error("--factors: each a slowdown of 1 or more")
    if args.steps < LEAD_STEP + 60:
        parser.error(f"--steps: at least {LEAD_STEP + 60} (slowed from step {LEAD_STEP})")
    cores = args.cores or len(os.sched_getaffinity(0))
    least = args.period_us * cores / NODES / max(factors, default=1)
    if least < cpu_groups.MIN_QUOTA_US and not args.time_share:
        parser.error(f"--period-us: node 2's quota would be {least:.0f} µs, under the kernel's "
                     f"least, {cpu_groups.MIN_QUOTA_US}: a longer period, or smaller --factors")
    sys.setswitchinterval(0.001)  # the time share's thread takes the GIL within a millisecond
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    root = Path(tempfile.mkdtemp(prefix="stragglers-"))
    env = job_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    data = root / "data"
    subprocess.run([sys.executable, "-m", "elastic_mnist", "synth", "--out", str(data),
                    "--train", str(STEPS_PER_EPOCH * GLOBAL_BATCH), "--test", "256"],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    unavailable = hosts.unavailable() or hosts.capabilities().get("slow")
    plan = pairs(factors, args.tbf and not unavailable)
    no_cgroups = "--time-share" if args.time_share else cpu_groups.unavailable()
    period_us = args.period_us if no_cgroups is None else None
    slowed_by = CGROUP_QUOTA if period_us else TIME_SHARE
    for name in cpu_groups.remove_stale():
        print(f"stragglers: removed a stale cgroup, {name}", flush=True)
    print(f"stragglers: {NODES} nodes × {NPROC} workers, node {VICTIM} slowed from step "
          f"{LEAD_STEP} of {args.steps} by {slowed_by}"
          f"{'' if period_us else f' ({no_cgroups})'}; {len(plan)} pairs; work folder {root}",
          flush=True)
    started = time.time()
    rows: dict[str, dict] = {}
    for label, runs in plan:
        row: dict = {}
        network = None
        try:
            if label == "tbf":
                network = hosts.Network(network_hosts(NODES, "external")).open()
            for run in runs:
                print(f"stragglers: {run.name}", flush=True)
                row["balance" if run.balance else "no-balance"] = run_job(
                    run, root, data, args.steps, env, network, cores, args.tbf_rate, period_us)
        except Exception as e:  # noqa: BLE001 - the harness's failure, said in its row
            row = {"error": f"{type(e).__name__}: {e}"}
        finally:
            if network is not None:
                network.close()
        if "error" not in row:
            row.update(pair_figures(row["no-balance"], row["balance"]))
        row["slowed_by"] = slowed_by
        rows[label] = row
        print(table({label: row}, args.tbf_rate).splitlines()[-1], flush=True)
    if args.tbf and unavailable:
        rows["tbf"] = {"skipped": f"not here: {unavailable}"}
    minutes = (time.time() - started) / 60
    summary = (f"{table(rows, args.tbf_rate)}\n\n{NODES} nodes × {NPROC} workers on one "
               f"machine, steps of {GLOBAL_BATCH} samples in micro-batches of {MICRO_BATCH}, node "
               f"{VICTIM} slowed from step {LEAD_STEP} to the last, {args.steps}; a pair of runs a "
               f"slowdown, one after the other; {minutes:.0f} minutes in all. `make stragglers`.")
    print(summary)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "minutes": minutes,
                                         "steps": args.steps, "tbf_rate": args.tbf_rate},
                                        indent=1))
    if args.plot:
        plot({label: row for label, row in rows.items() if "balance" in row}, args.plot)
    failed = [label for label, row in rows.items() if "error" in row]
    doubled = [label for label, row in rows.items() if "error" not in row and "skipped" not in row
               and (row["no-balance"]["audit"] or row["balance"]["audit"])]
    for label in doubled:
        for key in ("no-balance", "balance"):
            for problem in rows[label][key]["audit"]:
                print(f"stragglers: {label} {key}: {problem}")
    for what, which in (("the harness failed", failed), ("a sample lost or doubled", doubled)):
        if which:
            print(f"stragglers: {what}: {', '.join(which)}")
    return 1 if failed or doubled else 0


if __name__ == "__main__":
    sys.exit(main())
