"""scripts/stragglers.py's arithmetic, its time share and its CPU budgets, without a launch
(about a second): the nodes' windows, one period's signals, the ideal and the win-back from
fabricated audit records and events, the table, the time share on a child that sleeps, and a
busy child held to a quarter of a core by its cgroup (scripts/cpu_groups.py; skipped where
cgroups cannot be had). A real run is `make stragglers`.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import cpu_groups
import stragglers
from stragglers import GLOBAL_BATCH, LEAD_STEP, Run


def test_the_nodes_take_turns_where_the_cores_are_fewer_than_the_ranks():
    third = 1 / 3
    assert stragglers.windows(3, 2, 2) == [(0.0, third), (third, third), (2 * third, third)]
    assert stragglers.windows(3, 2, 4) == [(0.0, 0.5), (0.0, 0.5), (0.5, 0.5)]
    assert stragglers.windows(3, 2, 6) == [(0.0, 1.0)] * 3
    assert stragglers.windows(3, 2, 1) == stragglers.windows(3, 2, 2)  # a node at a time


def test_a_slowed_node_runs_a_kth_of_its_window_and_one_stops_before_the_next_goes_on():
    share = stragglers.TimeShare([[11], [12], [13]], cores=2, period_s=0.03)
    share.slow(2, 2.0)
    got = [(round(offset, 4), node, sig) for offset, node, sig in share.events()]
    assert got == [(0.0, 0, signal.SIGCONT), (0.01, 0, signal.SIGSTOP),
                   (0.01, 1, signal.SIGCONT), (0.02, 1, signal.SIGSTOP),
                   (0.02, 2, signal.SIGCONT), (0.025, 2, signal.SIGSTOP)]
    alone = stragglers.TimeShare([[11], [12], [13]], cores=6, period_s=0.04)
    assert alone.events() == []  # cores enough: nobody is stopped
    alone.slow(2, 4.0)
    assert [(round(o, 4), n) for o, n, _ in alone.events()] == [(0.0, 2), (0.01, 2)]
    with pytest.raises(ValueError, match="factor of 1 or more"):
        alone.slow(2, 0.5)


def test_the_time_share_stops_a_child_for_its_share_and_continues_it_at_the_end():
    child = subprocess.Popen(["sleep", "30"])
    try:
        with stragglers.TimeShare([[child.pid]], cores=1, period_s=0.02) as share:
            share.slow(0, 2.0)
            time.sleep(0.5)
            duty = share.duty(0)
        assert 0.2 < duty < 0.8  # half, give or take a busy machine's lateness
        assert psutil.Process(child.pid).status() != psutil.STATUS_STOPPED
    finally:
        child.kill()
        child.wait()


def test_a_cgroup_holds_a_busy_child_to_its_quota_and_is_removed_after():
    why = cpu_groups.unavailable()
    if why:
        pytest.skip(f"no CPU budgets here: {why}")
    groups = cpu_groups.CpuGroups(nodes=1, cores=0.25, period_us=20_000,
                                  name=f"em-stragglers-{os.getpid()}-test")
    with groups:
        child = subprocess.Popen([*groups.prefix(0), "sh", "-c", "while :; do :; done"])
        try:
            time.sleep(0.1)
            assert groups.pids(0) == [child.pid]  # born in its group: sh wrote itself there
            busy = psutil.Process(child.pid)
            before, began = sum(busy.cpu_times()[:2]), time.monotonic()
            time.sleep(1.0)
            cores = (sum(busy.cpu_times()[:2]) - before) / (time.monotonic() - began)
            assert 0.12 < cores < 0.3  # a quarter; less where the machine is busier still
            groups.slow(0, 2.0)
            assert groups.quota(0) == pytest.approx(0.125)
        finally:
            child.kill()
            child.wait()
    assert not any(g.exists() for g in groups.groups)


def test_the_groups_of_a_harness_that_died_are_removed():
    why = cpu_groups.unavailable()
    if why:
        pytest.skip(f"no CPU budgets here: {why}")
    dead = subprocess.Popen(["true"])
    dead.wait()
    groups = cpu_groups.CpuGroups(nodes=2, cores=1, name=f"em-stragglers-{dead.pid}")
    groups.__enter__()  # left behind, as by a harness killed outright
    try:
        removed = cpu_groups.remove_stale()
        assert {g.name for g in groups.groups} <= set(removed)
        assert not any(g.exists() for g in groups.groups)
    finally:
        groups.close()


def records(slow_from: int, last: int, slow_ranks: dict[int, float],
            step_s: float = 0.1, slowed_step_s: float = 0.2) -> list[dict]:
    """Six ranks of 128 samples a step, 0.05 s of compute each; from ``slow_from`` the ranks of
    ``slow_ranks`` that many times slower and the step ``slowed_step_s`` long."""
    out, t = [], 1000.0
    for step in range(1, last + 1):
        t += step_s if step < slow_from else slowed_step_s
        for rank in range(6):
            slow = slow_ranks.get(rank, 1.0) if step >= slow_from else 1.0
            out.append({"step": step, "epoch": 0, "rank": rank, "world_size": 6, "time": t,
                        "generation": 0, "compute_s": 0.05 * slow,
                        "indices": list(range(GLOBAL_BATCH // 6))})
    return out


def at(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat()


def test_rates_speeds_and_the_ideal_keep_the_rest_of_the_step_as_it_was():
    made = records(LEAD_STEP + 1, 150, {4: 2.0, 5: 2.0})
    clean = stragglers.speeds(made, 15, LEAD_STEP)
    assert clean == pytest.approx({r: 128 / 0.05 for r in range(6)})
    slowed = stragglers.speeds(made, 60, 150)
    assert slowed[5] == pytest.approx(128 / 0.1)
    # Clean: 7,680 samples/s (768 in 0.1 s), of which the compute 768 / 15,360 = 0.05 s. Slowed
    # sums 4 + 2 / 2 = 5 of the 6 speeds: the compute 0.06 s, the rest still 0.05.
    clean_rate = stragglers.rate(stragglers.step_times(made), 15, LEAD_STEP)
    assert clean_rate == pytest.approx(7680)
    assert stragglers.ideal_fraction(clean_rate, clean, slowed) == pytest.approx(0.1 / 0.11)
    assert stragglers.win_back(0.5, 0.8, 0.9) == pytest.approx(0.75)
    assert stragglers.win_back(0.9, 0.9, 0.9) is None  # nothing lost: nothing to win back


def test_a_run_is_measured_from_its_records_and_events():
    made = records(LEAD_STEP + 1, 150, {4: 2.0, 5: 2.0})
    times = stragglers.step_times(made)
    run = Run("x2-balance", 2.0, True, slow_at=times[LEAD_STEP], slow_step=LEAD_STEP)
    events = [{"event": "start", "time": at(990.0)},
              {"event": "straggler", "step": 70, "time": at(times[70]), "ranks": [4, 5],
               "factor": 2.0},
              {"event": "shares", "step": 70, "from_step": 71, "time": at(times[70]),
               "shares": [20, 20, 20, 20, 8, 8]}]
    figures = stragglers.measure(run, made, events)
    assert figures["clean"] == pytest.approx(7680)
    assert figures["slowed"] == pytest.approx(3840)
    assert figures["slowed_fraction"] == pytest.approx(0.5)
    assert figures["rebalanced"] == pytest.approx(3840)
    assert figures["detection_s"] == pytest.approx(20 * 0.2, abs=1e-3)
    assert figures["named"] == [4, 5] and figures["shares"] == [20, 20, 20, 20, 8, 8]
    pair = stragglers.pair_figures({"slowed_fraction": 0.5},
                                   {**figures, "rebalanced_fraction": 0.8})
    assert pair["ideal_fraction"] == pytest.approx(0.1 / 0.11)
    assert pair["win_back"] == pytest.approx(0.3 / (0.1 / 0.11 - 0.5))
    unchanged = stragglers.pair_figures({"slowed_fraction": 0.8},
                                        {"slowed_fraction": 0.75, "ideal_fraction": 1.0})
    assert unchanged["win_back"] is None  # nothing rebalanced: nothing won or lost by it


def test_the_table_says_every_pair_and_why_a_row_is_missing():
    run = {"clean": 900.0, "slowed": 450.0, "slowed_fraction": 0.5, "detection_s": 12.5,
           "shares": None, "audit": []}
    balanced = {**run, "slowed": 700.0, "slowed_fraction": 0.78, "rebalanced": 720.0,
                "rebalanced_fraction": 0.8, "shares": [20, 20, 20, 20, 8, 8]}
    rows = {"2×": {"no-balance": run, "balance": balanced, "ideal_fraction": 0.84,
                   "win_back": 0.88},
            "4×": {"no-balance": run, "balance": balanced, "ideal_fraction": 0.84,
                   "win_back": 0.88, "slowed_by": stragglers.CGROUP_QUOTA},
            "tbf": {"skipped": "not here: no tc"}}
    lines = stragglers.table(rows, "20mbit").splitlines()
    assert lines[2] == ("| 2× (time share) | 900, 900 | 450 (50%) | 700 (78%) | 720 (80%) | "
                        "84% | 88% | 12.5, 12.5 | 20, 20, 20, 20, 8, 8 | yes |")
    assert lines[3].startswith("| 4× (cgroup quota) | 900, 900 |")
    assert lines[4].startswith("| data link at 20mbit (tc tbf) | not here: no tc |")
