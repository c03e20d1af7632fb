"""The partition harness's reading and judging, without a network or a launch (milliseconds):
chaos's schedule of network faults, a network fault's heal, how a job's answer is read from its
events, and scripts/partitions.py's targets and table. What the network itself does is
tests/test_hosts.py's; a real run of every case is `make partitions`.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import chaos
import netfaults
import partitions


def test_a_schedule_gives_network_faults_their_seconds_and_process_faults_none():
    faults = chaos.parse_schedule("150:store-outage::30,100:cut-node:2:60,40:kill-node:0,"
                                  "120:cut-data:1")
    assert [(f.step, f.kind, f.node, f.seconds) for f in faults] == [
        (40, "kill-node", 0, None), (100, "cut-node", 2, 60.0),
        (120, "cut-data", 1, netfaults.DEFAULT_SECONDS), (150, "store-outage", None, 30.0)]
    assert faults[1].describe() == "cut-node n2 60 s"
    with pytest.raises(SystemExit, match="only a network fault lasts"):
        chaos.parse_schedule("40:kill-node:0:5")


def test_network_faults_need_hosts_of_their_own(capsys):
    with pytest.raises(SystemExit):
        chaos.main(["--schedule", "100:cut-node:2:5"])
    assert "cut-node is a network fault: it needs --hosts netns" in capsys.readouterr().err


class FakeNetwork:
    def __init__(self):
        self.calls: list[tuple] = []

    def cut(self, host, kind=None, direction="both"):
        self.calls.append(("cut", host, kind, direction))

    def heal(self, host, kind=None):
        self.calls.append(("heal", host))


def test_a_network_fault_heals_by_itself_once():
    network = FakeNetwork()
    hit = netfaults.Strike(network, "cut-out", "node2", 0.05)
    hit.start()
    time.sleep(0.3)
    hit.heal()  # the harness's own heal, after the timer's: nothing more
    assert network.calls == [("cut", "node2", "data", "out"), ("heal", "node2")]
    assert 0.05 <= hit.healed - hit.at < 0.3


def event(kind: str, at: float, **fields) -> dict:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(at))
    return {"event": kind, "time": stamp, **{k: time.strftime(
        "%Y-%m-%dT%H:%M:%S", time.localtime(v)) for k, v in fields.items()}}


def test_the_jobs_answer_is_read_from_its_events():
    def answer(events):
        return netfaults.answer(events, 100.0, 200.0, chaos.event_time)

    base = 1_700_000_000.0
    assert answer([]).recovery == "none"
    shrink = event("shrink", base + 111, detected_time=base + 110, regrouped_time=base + 111)
    grow = event("grow", base + 140)
    read = netfaults.answer([shrink, grow], base + 100, base + 200, chaos.event_time)
    assert (read.recovery, read.noticed - base, read.regrouped - base, read.grows) == (
        "in-process", 110, 111, 1)
    restart = netfaults.answer([event("start", base + 150)], base + 100, base + 200,
                               chaos.event_time)
    assert (restart.recovery, restart.noticed - base) == ("restart", 50 + 100)
    before = netfaults.answer([event("start", base + 50)], base + 100, base + 200,
                              chaos.event_time)
    assert before.recovery == "none"  # the job's own start, before the fault


def record(**fields) -> dict:
    return {"kind": "cut-node", "gap_s": 1.5, "first_step_s": 1.4, "recovery": "in-process",
            "survivors_kept": True, "came_back": True, "grows": 1, "failures": [], **fields}


def test_each_case_is_judged_against_its_target():
    cases = partitions.CASES
    assert cases["cut-60"].met(record())
    assert not cases["cut-60"].met(record(gap_s=10.5))
    assert not cases["cut-60"].met(record(came_back=False))
    assert cases["cut-5"].met(record(gap_s=1.7))
    assert cases["blip"].met(record(gap_s=1.4, recovery="none"))
    assert not cases["blip"].met(record(gap_s=1.4))  # dropped
    assert cases["data-30"].met(record(gap_s=11.9))
    assert not cases["data-30"].met(record(gap_s=11.9, survivors_kept=False))
    assert not cases["store-30"].met(record(gap_s=0.3, recovery="restart"))
    assert cases["slow"].met(record(gap_s=3.0, recovery="none"))
    killed = record(kind="store-kill", gap_s=28.2, came_back=None, grows=0)
    assert cases["store-kill"].met(killed)  # waited for the store, in process
    assert not cases["store-kill"].met({**killed, "recovery": "restart"})
    assert not cases["store-kill"].met({**killed, "survivors_kept": False})
    assert not cases["store-kill"].met({**killed, "gap_s": 61.0})
    assert "| 28.2 | 1.4 | in process | no | — |" in partitions.table({"store-kill": killed})


def test_the_c10d_case_is_cut_60_under_torchs_rendezvous_and_asks_every_agent_to_live(tmp_path):
    """c10d-60 runs chaos as cut-60 does but with --rdzv-backend c10d. Its target: every agent
    lives (each that ended before chaos stopped the nodes ended with 0), the others' first step
    within 2 s and in process, the node back; not the longest wait or the healthy processes, as
    the node's return restarts every worker there."""
    c10d, cut = partitions.CASES["c10d-60"], partitions.CASES["cut-60"]
    argv = partitions.chaos_argv(c10d, tmp_path, "node.sh", 25.0)
    ours = partitions.chaos_argv(cut, tmp_path, "node.sh", 25.0)
    at = argv.index("--rdzv-backend")
    assert (argv[at + 1], ours[at + 1]) == ("c10d", "elastic-mnist")
    assert argv[:at] + argv[at + 2:] == ours[:at] + ours[at + 2:]
    assert "100:cut-node:2:60" in argv and argv[argv.index("--store") + 1] == "external"

    lived = record(gap_s=10.6, first_step_s=1.7, recovery="restart", first_answer="in-process",
                   survivors_kept=False, grows=0, agent_exits={"0": 0, "1": 0, "2": 0},
                   late_writes=[])
    assert partitions.met(c10d, lived)
    assert not cut.met(lived)  # under ours nobody healthy restarts
    for died in ({"0": 0, "1": 0, "2": 1}, {"0": 0, "2": -9}):  # failed; killed by a signal
        assert not partitions.met(c10d, {**lived, "agent_exits": died}), died
    assert not c10d.met({**lived, "first_answer": "restart", "first_step_s": 1.7})
    assert not c10d.met({**lived, "first_step_s": 10.6})
    assert not c10d.met({**lived, "came_back": False})
    row = partitions.table({"c10d-60": lived}).splitlines()[2]
    assert "| 10.6 | 1.7 | in process, then a restart | yes | yes | yes | nothing |" in row
    assert row.endswith("| met |")


def test_chaos_records_a_network_faults_first_answer_beside_its_last():
    """Under c10d a cut node's return restarts every worker after the others went on in
    process: its record says both (first_answer, recovery)."""
    base = 1_700_000_000.0

    class Observer:
        def world_size(self, since):
            return 6

        def finished(self):
            return False

        def events(self):
            return [event("shrink", base + 2, detected_time=base + 1.5, regrouped_time=base + 2),
                    event("start", base + 70)]

        def audit(self):
            return []

    class Healed:
        at, healed, killed = base, base + 60, None

        def heal(self):
            pass

    fault = chaos.Fault(step=100, kind="cut-node", node=2, at=base, size_before=6, seconds=60)
    chaos.watch_network(fault, Healed(), Observer(), deadline=time.time() + 10)
    assert (fault.first_answer, fault.recovery, fault.came_back) == ("in-process", "restart", True)


def test_the_table_says_what_each_case_cost_and_whether_it_met_its_target():
    rows = partitions.table({
        "cut-60": record(gap_s=10.5, first_step_s=10.4, late_writes=[]),
        "store-30": record(kind="store-outage", gap_s=92.5, recovery="restart",
                           survivors_kept=False, failures=["sample audit: FAIL epoch 3"]),
        "rank0-30": record(late_writes=["step-00000045.json: saved in generation 0"]),
        "slow": {"error": "HostsError: ip link add: File exists"},
        "out-30": {"skipped": "Error: Specified qdisc kind is unknown."}}).splitlines()
    assert rows[2] == ("| a node's links cut for 60 s | 10.5 | 10.4 | in process, admitted back "
                       "| no | yes | yes | nothing | ≤ 2 s like a crash, in process, back after "
                       "| NOT MET |")
    assert "| restart, admitted back | yes | yes | NO | nothing | goes on" in rows[3]
    assert rows[4].endswith("| yes | yes | 1 | ≤ 2 s like a crash, in process, back after | "
                            "NOT MET |")  # its target met but for what it wrote after its drop
    assert "harness failed: HostsError: ip link add: File exists" in rows[5]
    assert "| skipped: this machine cannot (Error: Specified qdisc kind is unknown.) |" in rows[6]


def test_what_a_dropped_process_wrote_after_the_others_went_on_is_found(tmp_path):
    """scripts/cutoff.py on a shared folder written by hand: node0's rank 0 dropped at 12:00:10
    (generation 0 → 1). Its checkpoint, events record, TensorBoard record and audit record from
    after that are each found; what it wrote before, and what the survivors wrote after, not."""
    import cutoff
    from torch.utils.tensorboard import SummaryWriter

    run_dir, ckpt = tmp_path / "runs" / "r", tmp_path / "ckpt"
    (run_dir / "audit").mkdir(parents=True)
    ckpt.mkdir()
    at = "2026-12-04T12:00:10.000+00:00"
    t = cutoff.epoch(at)
    shrink = {"event": "shrink", "time": at, "step": 50, "why": "hung", "lost_ranks": [0, 1],
              "lost_hosts": ["node0"], "restart_generation": 1, "regrouped_time": at,
              "writer": "node1/22"}
    lines = [{"event": "checkpoint", "time": "2026-12-04T12:00:05.000+00:00", "step": 40,
              "writer": "node0/11"}, shrink,
             {"event": "checkpoint", "time": "2026-12-04T12:00:20.000+00:00", "step": 60,
              "writer": "node1/22"},
             {"event": "eval", "time": "2026-12-04T12:00:30.000+00:00", "step": 45,
              "writer": "node0/11"}]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    for step, generation, saved in ((40, 0, "12:00:05"), (60, 1, "12:00:20"), (45, 0, "12:00:31")):
        (ckpt / f"step-{step:08d}.json").write_text(json.dumps(
            {"step": step, "restart_generation": generation,
             "saved_at": f"2026-12-04T{saved}.000+00:00"}))
    (run_dir / "audit" / "g0-r1.jsonl").write_text(
        json.dumps({"step": 49, "time": t - 1}) + "\n" + json.dumps({"step": 51, "time": t + 2}))
    writer = SummaryWriter(str(tmp_path / "tb"))
    writer.add_scalar("train/loss", 1.0, 40, walltime=t - 5)
    writer.add_scalar("train/loss", 0.5, 45, walltime=t + 3)
    writer.close()
    (tb,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    tb.rename(run_dir / "events.out.tfevents.1796423237.node0.11.0")

    late = cutoff.late_writes(tmp_path, "r")
    assert [line.split(":")[0] for line in late] == [
        "step-00000045.json", "events.jsonl", "events.out.tfevents.1796423237.node0.11.0",
        "g0-r1.jsonl"], late
    assert "eval at step 45 by node0/11 20.0 s after generation 0" in late[1]
    assert cutoff.main([str(tmp_path), "r"]) == 1
