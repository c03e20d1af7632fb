"""Several torchrun agents on loopback: a node frozen, leaving or lost while the others go on in the
same processes, rank 0's duties moving, the exit barrier released, and the in-process path
ending where the restart path would, to the bit. Each run is the chaos harness's
(scripts/chaos.py), which fails unless the job finished, every completed epoch used every sample
once, every checkpoint is valid, and every fault of an in-process kind was recovered in process
by the same worker processes; the tests read what it left behind."""

from __future__ import annotations

import itertools
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from launch import REPO, clean_env, cli_cmd, free_port, kill_tree, run, torchrun_cmd
from shared_runs import inspect, newest
from test_dashboards import accumulate

from elastic_mnist.errors import EXIT_DROPPED
from elastic_mnist.events import read_events
from elastic_mnist.resilience.faults import FAULT_VAR
from elastic_mnist.resilience.torchrun_agents import arrive_at_exit_barrier, rendezvous_round

sys.path.insert(0, str(REPO / "scripts"))
import chaos

pytestmark = pytest.mark.slow


def records(workdir: Path, kind: str | None = None) -> list[dict]:
    events = read_events(workdir / "shared" / "runs" / "chaos" / "events.jsonl")
    return [e for e in events if kind is None or e["event"] == kind]


def two_plain_agents(tmp_path: Path, port: int, args: list[str], env: dict[str, str],
                     *rdzv_id: str, nproc: tuple[int, int] = (1, 1),
                     ) -> tuple[list[subprocess.Popen], Callable[[], str]]:
    """The README's plain torchrun line on two nodes of ``nproc`` workers (one each by default;
    node 0's agent serves the store), each agent logging to tmp_path/agent<i>.log; and a reader
    of both logs."""
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
         f"--nproc_per_node={nproc[i]}",
         "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", *rdzv_id,
         f"--rdzv_conf=is_host={str(host).lower()}", "--monitor_interval=0.2",
         "-m", "elastic_mnist", *args],
        env=env, stdout=(tmp_path / f"agent{i}.log").open("w"), stderr=subprocess.STDOUT,
        start_new_session=True) for i, host in enumerate((True, False))]

    def logs() -> str:
        return "\n".join((tmp_path / f"agent{i}.log").read_text() for i in (0, 1))

    return agents, logs


def wake(frozen: psutil.Process, agent: subprocess.Popen, log: Path,
         logs: Callable[[], str]) -> str:
    """Continues a worker stopped by SIGSTOP and waits for its agent to fail; returns what the
    agent logged from then on (the woken worker's lines, torchrun's summary)."""
    assert frozen.status() == psutil.STATUS_STOPPED, logs()
    frozen_at = len(log.read_text())
    frozen.send_signal(signal.SIGCONT)
    assert agent.wait(timeout=60) != 0, logs()
    return log.read_text()[frozen_at:]


def test_survivors_of_a_frozen_node_go_on_in_process_as_a_restart_would(tmp_path):
    """The README's plain torchrun line (node 0's agent serves the store), 3 nodes of one worker.
    Node 2's worker stops (SIGSTOP): no peer can kill it, and its agent sees it running. The
    others name it by its silence (its pulse stood still 1.5 s while they waited, well before
    --hang-timeout) and go on without it in their own processes; their
    agents exit as soon as they finish (the exit barrier released for node 2's agent, which
    waits for its frozen worker forever); and their end is bitwise that of the same run stopped
    at the agreed step and restarted at world size 2."""
    work = tmp_path / "chaos"
    status = chaos.main(["--launch", "torchrun", "--store", "agent", "--nodes", "3",
                         "--start-nodes", "3", "--steps", "40", "--schedule", "8:hang-worker:2",
                         "--hang-timeout", "3", "--checkpoint-every", "1", "--keep-last", "100",
                         "--no-reference", "--workdir", str(work), "--json",
                         str(work / "faults.json")])
    assert status == 0
    report = json.loads((work / "faults.json").read_text())
    (fault,) = report["faults"]
    assert (fault["recovery"], fault["survivors_kept"]) == ("in-process", True)  # same pids
    assert fault["steps_redone"] <= 1
    assert sorted(report["exit_after_last_step_s"]) == ["0", "1"]
    assert all(s is not None for s in report["exit_after_last_step_s"].values())  # not 300 s
    assert [s["world_size"] for s in records(work, "start")] == [3]
    (hang,) = records(work, "hang")
    (shrink,) = records(work, "shrink")
    assert hang["ranks"] == [2] and hang["reported_by"] in (0, 1)
    assert hang["reason"].startswith("no pulse") and hang["waited_s"] < 3, hang  # 3: the deadline
    assert (shrink["why"], shrink["lost_ranks"], shrink["old_world_size"],
            shrink["new_world_size"], shrink["restart_generation"]) == ("hung", [2], 3, 2, 1)
    assert shrink["detection_to_step_s"] > 0
    saved = {c["step"]: c["model_digest"] for c in inspect(work / "shared" / "ckpt")["checkpoints"]}
    assert shrink["model_digest"] == saved[shrink["step"]]  # the agreed state: the saved one

    # The same run, stopped at the agreed step and restarted by torchrun at world size 2.
    again = tmp_path / "restarted"
    (again / "ckpt").mkdir(parents=True)
    for part in (".pt", ".json"):
        name = f"step-{shrink['step']:08d}{part}"
        shutil.copy(work / "shared" / "ckpt" / name, again / "ckpt" / name)
    args = [arg.replace(str(work / "shared"), str(again))
            for arg in json.loads((work / "train_args.json").read_text())]
    done = run(torchrun_cmd(2, "train", *args))
    assert done.returncode == 0, done.stdout
    assert f"resumed from {again / 'ckpt'}/step-{shrink['step']:08d}.pt: step {shrink['step']}," \
        in done.stdout
    ours, theirs = newest(work / "shared" / "ckpt"), newest(again / "ckpt")
    assert ours["step"] == theirs["step"] == 40
    assert ours["model_digest"] == theirs["model_digest"]


def test_nodes_lost_in_every_phase_of_the_recovery_cost_seconds_in_process(tmp_path, monkeypatch):
    """5 nodes of one worker (the README's plain torchrun line, the store served apart). At step
    8, rank 4 kills its node (faults.py: its agent, then itself). Inside the recovery, in each
    of its phases, another node is lost, and the survivors begin the next round at once:

    - rank 3 checks in BUSY_S late, alive (as one still evaluating or saving would), and is
      waited for, not dropped;
    - rank 2's node is killed just after it checked in (counted among the survivors, so that the
      new group waits for it);
    - rank 1 stops (SIGSTOP) as that group is created (the others wait for it in gloo's
      rendezvous, which no timeout but the group's ends);
    - in the next round's group of ranks 0 and 3, rank 0 stops as they take the agreed state.

    The survivor goes on in its own process within seconds, one ``shrink`` record naming every
    rank lost, 5 -> 1, no fallback."""
    from elastic_mnist.resilience.faults import BUSY_S

    # The phases' faults strike in any recovery that begins at step 7 or later: a rank that
    # notices the loss before it completed step 7 begins it in step 7, the others in step 8.
    monkeypatch.setenv(FAULT_VAR, "die@8:4,busy@7:3,die-agreeing@7:2,freeze-recovering@7:1,"
                                  "freeze-adopting@7:0")
    work = tmp_path / "chaos"
    status = chaos.main(["--launch", "torchrun", "--store", "external", "--nodes", "5",
                         "--start-nodes", "5", "--steps", "30", "--faults", "0",
                         "--hang-timeout", "7", "--no-reference", "--workdir", str(work),
                         "--json", str(work / "faults.json")])
    assert status == 0
    # --hang-timeout 7: the close waits half the change's bound (7 s) for the busy rank, 3 s
    # late; at 5 a loaded machine (the suite's two workers) once took rank 3 past it.
    assert [s["world_size"] for s in records(work, "start")] == [5]  # never restarted
    assert records(work, "fallback") == []
    (shrink,) = records(work, "shrink")
    assert (shrink["lost_ranks"], shrink["old_world_size"], shrink["new_world_size"]) == \
        ([0, 1, 2, 4], 5, 1)
    # The agreed step is the last survivor's: 7, or 6 where it noticed the first loss before
    # its step 7 completed (rank 4 dies as step 8 begins, and a ring's last chunk may still be
    # on its way) and the rank that held step 7 (0) was lost as it handed it over.
    assert shrink["step"] in (6, 7)
    # The busy rank was waited for; each later loss cost a pulse's silence (about 1.5 s), not
    # a bound: at most 2 s a loss.
    assert BUSY_S < shrink["detection_to_step_s"] < BUSY_S + 2 * 2 + 1, shrink


def test_a_node_leaving_and_rank_0_lost_under_jobs_node_sh(tmp_path):
    """jobs/node.sh, the store served by `elastic-mnist rendezvous`, 3 nodes of one worker. Node
    2's agent is SIGTERMed: its worker leaves after a second's grace, the others go on. Node 0,
    rank 0's, is SIGKILLed: the last one takes rank 0's duties in its own process (TensorBoard
    in the same run folder, events.jsonl, the checkpoints). A new node then grows the job back, in
    process under our rendezvous (node.sh's): the survivor keeps its process."""
    work = tmp_path / "chaos"
    status = chaos.main(["--nodes", "3", "--start-nodes", "3", "--store", "external",
                         "--steps", "400", "--schedule", "6:leave:2,12:kill-node:0,18:join",
                         "--no-reference", "--workdir", str(work), "--json",
                         str(work / "faults.json")])
    assert status == 0
    leave, kill, join = json.loads((work / "faults.json").read_text())["faults"]
    assert [f["recovery"] for f in (leave, kill, join)] == ["in-process"] * 3
    assert leave["survivors_kept"] and kill["survivors_kept"] and join["survivors_kept"]
    left, died = records(work, "shrink")
    assert (left["why"], left["lost_ranks"], left["old_world_size"], left["new_world_size"]) == \
        ("left", [2], 3, 2)
    assert left["steps_redone"] == 0  # the node left at a step boundary
    assert (died["why"], died["lost_ranks"], died["new_world_size"]) == ("died", [0], 1)
    starts = records(work, "start")
    assert [(s["world_size"], s["restart_generation"]) for s in starts] == [(3, 0)]
    (grow,) = records(work, "grow")
    assert (grow["old_world_size"], grow["new_world_size"], grow["joined_ranks"],
            grow["restart_generation"]) == (1, 2, [1], 3)

    # Rank 0's duties moved: the records after the kill come from the last survivor, the
    # dashboards go on in the one run folder, every step once, the world size as it was.
    after = [e for e in records(work) if e["time"] > died["time"]]
    assert {"eval", "checkpoint"} <= {e["event"] for e in after}
    acc = accumulate(work / "shared" / "runs" / "chaos")
    for tag in acc.Tags()["scalars"]:
        steps = [e.step for e in acc.Scalars(tag)]
        assert steps == sorted(set(steps)), (tag, steps)  # nothing lost or doubled
    worlds = [int(e.value) for e in acc.Scalars("elastic/world_size")]
    assert [w for w, _ in itertools.groupby(worlds)] == [3, 2, 1, 2], worlds
    generations = {json.loads(p.read_text())["restart_generation"]
                   for p in (work / "shared" / "ckpt").glob("step-*.json")}
    assert generations <= {2, 3} and 3 in generations  # written after the kill, and the join


def test_a_peer_frozen_as_ddp_regroups_its_buckets_costs_seconds_not_the_groups_timeout(tiny_digits,
                                                                           tmp_path):
    """DDP regroups its buckets once, at its second step, by a blocking broadcast from rank 0
    that no timeout but the group's ends. Two plain torchrun agents of one worker; rank 0
    freezes (SIGSTOP) as it begins step 2, and rank 1, waiting in that broadcast, names it
    (by its silence, or at --hang-timeout at the latest) and goes on alone in its own process,
    not after --pg-timeout (300 s)."""
    from shared_runs import args_for

    port = free_port()
    args = args_for(tiny_digits, tmp_path, "--run-id", "regroup", "--epochs", "1",
                    "--hang-timeout", "2", "--pg-timeout", "300")
    env = clean_env(**{FAULT_VAR: "hang@2:0"})
    agents, logs = two_plain_agents(tmp_path, port, args, env, "--rdzv_id=regroup")

    try:
        deadline = time.monotonic() + 90
        while all(agent.poll() is None for agent in agents):  # the survivor's agent ends
            assert time.monotonic() < deadline, logs()
            time.sleep(0.2)
        assert [agent.returncode for agent in agents if agent.poll() is not None] == [0], logs()
    finally:
        for agent in agents:
            kill_tree(agent.pid)
    events = read_events(tmp_path / "runs" / "regroup" / "events.jsonl")
    (hang,) = [e for e in events if e["event"] == "hang"]
    (shrink,) = [e for e in events if e["event"] == "shrink"]
    assert (hang["ranks"], hang["reported_by"]) == ([0], 1)
    assert (shrink["why"], shrink["lost_ranks"], shrink["step"], shrink["new_world_size"]) == \
        ("hung", [0], 1, 1)
    assert max(e["step"] for e in events if e["event"] == "checkpoint") == 10


@pytest.mark.parametrize("store_host", ["first", "last"])
def test_a_run_without_faults_leaves_the_exit_barrier_to_the_agents(tiny_digits, tmp_path,
                                                                    store_host):
    """The README's two-node plain torchrun line (node 0's agent serves the store), nothing
    lost, the store's host started first or last: rank 0 arrives at the exit barrier for no
    agent (an arrival for a live one opens it early, and the store's host may then exit while
    the other agent still watches its workers), and every torchrun exits 0."""
    from shared_runs import args_for

    port = free_port()
    args = args_for(tiny_digits, tmp_path, "--run-id", "calm", "--max-steps", "3",
                    "--checkpoint-every", "0")
    order = (True, False) if store_host == "first" else (False, True)
    agents = []
    for i, host in enumerate(order):
        agents.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
             "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=calm",
             f"--rdzv_conf=join_timeout=60,last_call_timeout=2,is_host={str(host).lower()}",
             "--monitor_interval=0.2", "-m", "elastic_mnist", *args],
            env=clean_env(), stdout=(tmp_path / f"agent{i}.log").open("w"),
            stderr=subprocess.STDOUT, start_new_session=True))
        time.sleep(0.5)

    def logs() -> str:
        return "\n".join((tmp_path / f"agent{i}.log").read_text() for i in (0, 1))

    try:
        assert [agent.wait(timeout=120) for agent in agents] == [0, 0], logs()
    finally:
        for agent in agents:
            kill_tree(agent.pid)
    assert "arrived at the exit barrier" not in logs()
    (start,) = [e for e in read_events(tmp_path / "runs" / "calm" / "events.jsonl")
                if e["event"] == "start"]
    assert (start["world_size"], start["recovery"]) == (2, "in-process")


@pytest.mark.long
def test_a_wrapper_that_hides_the_agent_is_named_at_start(tiny_digits, tmp_path):
    """A wrapper between torchrun's agent and the worker, one that forks (`torchrun --no-python
    bash -c "...; python -m elastic_mnist train ..."`, as `nsys profile` or a site's wrapper
    script): the worker's parent is the wrapper, whose command line names no rendezvous, so
    faults are recovered by a restart. The node's first worker says so at start, naming why."""
    import shlex

    from shared_runs import args_for

    port = free_port()
    worker = shlex.join([sys.executable, "-m", "elastic_mnist", *args_for(
        tiny_digits, tmp_path, "--run-id", "wrapped", "--max-steps", "1")])
    done = run([sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2",
                "--nproc_per_node=2", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                "--rdzv_id=wrapped", "--rdzv_conf=last_call_timeout=1", "--monitor_interval=0.2",
                "--no-python", "bash", "-c", f"{worker}; exit $?"], timeout=120)
    assert done.returncode == 0, done.stdout
    said = [line for line in done.stdout.splitlines() if "recovered by a restart" in line]
    assert len(said) == 1 and "[rank 0] WARNING" in said[0], done.stdout
    assert "the worker's parent (pid " in said[0] and ", `bash`) is not a torchrun agent whose " \
        "--rdzv_endpoint it can read" in said[0]


@pytest.mark.long
def test_what_survivors_rely_on_from_torchrun_and_gloo(tmp_path):
    """Two plain torchrun agents, one worker each (tests/programs/frozen_peer.py): rank 1 freezes.

    - gloo cannot abort a collective blocked on a frozen peer: the backend's abort changes
      nothing, a wait's own timeout gives up on it, the collective fails at the group's timeout;
    - an agent whose workers finished waits at the exit barrier for every agent of its
      rendezvous round, and one that is gone never arrives; arriving for it lets it exit."""
    port = free_port()
    env = clean_env(LOGLEVEL="INFO", GROUP_TIMEOUT_S="3")

    def agent(is_host: bool, log: Path) -> subprocess.Popen:
        conf = f"join_timeout=60,last_call_timeout=1,is_host={str(is_host).lower()}"
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
             "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=facts",
             f"--rdzv_conf={conf}", "--monitor_interval=0.2",
             str(REPO / "tests" / "programs" / "frozen_peer.py")],
            env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
            start_new_session=True)

    first, second = agent(True, tmp_path / "a.log"), agent(False, tmp_path / "b.log")
    try:
        deadline = time.monotonic() + 120
        while "Waiting 300 seconds for other agents" not in (tmp_path / "a.log").read_text():
            assert first.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "a.log").read_text()
            time.sleep(0.1)
        seen = next(json.loads(line[line.index("{"):])
                    for line in (tmp_path / "a.log").read_text().splitlines()
                    if "completed_after_abort" in line)
        assert seen["completed_after_abort"] is False
        assert 1.0 <= seen["wait_timeout_s"] < seen["returned_s"]
        assert seen["returned_s"] >= 3.0  # not before the group's timeout

        kill_tree(second.pid)  # the frozen node is gone for good: it never arrives
        time.sleep(2)
        assert first.poll() is None  # still waiting, up to exit_barrier_timeout (300 s)
        from torch.distributed import TCPStore

        store = TCPStore("127.0.0.1", port, is_master=False)
        arrive_at_exit_barrier(store, "facts", rendezvous_round(store, "facts"), 1, agents=2)
        assert first.wait(timeout=30) == 0
    finally:
        for proc in (first, second):
            kill_tree(proc.pid)


def test_a_port_in_use_for_the_store_is_a_clear_error():
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = run(cli_cmd("rendezvous", "--host", "127.0.0.1", "--port", str(port)),
                   timeout=60)
    assert done.returncode == 2
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("elastic-mnist rendezvous: error:") and str(port) in line


def test_a_dropped_rank_0_that_wakes_leaves_without_writing(tiny_digits, tmp_path):
    """Two plain torchrun agents of one worker, into one folder, without --rdzv_id (both nodes
    admitted by the lease: one job). Rank 0 freezes (SIGSTOP) as its writer is about to commit
    step 3's checkpoint; rank 1 names it after --hang-timeout and goes on alone, as rank 0, in
    its own process, to the end. Woken (SIGCONT), the old rank 0 leaves with one line and the
    dropped status, and nothing of it reaches the folders: not its queued checkpoint, nor
    `latest`, nor a record of the generation that is over, nor TensorBoard, nor the lease."""
    from shared_runs import args_for

    port = free_port()
    args = args_for(tiny_digits, tmp_path, "--run-id", "fenced", "--epochs", "1",
                    "--checkpoint-every", "1", "--keep-last", "100", "--hang-timeout", "2")
    env = clean_env(**{FAULT_VAR: "hang-save@3"})
    agents, logs = two_plain_agents(tmp_path, port, args, env)  # no --rdzv_id

    def folders() -> dict[str, bytes]:
        return {str(path.relative_to(tmp_path)): path.read_bytes()
                for path in sorted((tmp_path / "ckpt").rglob("*"))
                + sorted((tmp_path / "runs").rglob("*")) if path.is_file()}

    try:
        assert agents[1].wait(timeout=90) == 0, logs()  # the survivor's agent ends
        (frozen,) = psutil.Process(agents[0].pid).children()
        left = folders()
        woken = wake(frozen, agents[0], tmp_path / "agent0.log", logs)
    finally:
        for agent in agents:
            kill_tree(agent.pid)
    assert f"exitcode  : {EXIT_DROPPED}" in woken, woken  # torchrun's summary of it
    said = [line for line in woken.splitlines() if "[rank 0]" in line]
    assert len(said) == 1, woken
    assert "ERROR rank 0 was dropped from the job at generation 0 (the job is at 1): leaving " \
        "without writing" in said[0], woken
    now = folders()
    train_log = "runs/fenced/train.log"  # where the one line also goes
    assert now.pop(train_log).startswith(left.pop(train_log))
    assert now == left  # nothing else of it, not a byte
    events = read_events(tmp_path / "runs" / "fenced" / "events.jsonl")
    (shrink,) = [e for e in events if e["event"] == "shrink"]
    assert (shrink["lost_ranks"], shrink["restart_generation"]) == ([0], 1)
    assert (tmp_path / "ckpt" / "latest").read_text() == "step-00000010\n"
    assert all(json.loads(p.read_text())["restart_generation"] == 1
               for p in (tmp_path / "ckpt").glob("step-*.json")
               if int(p.stem.split("-")[1]) >= 3)  # the survivor's, from the frozen step on


def test_a_dropped_rank_that_wakes_while_the_job_goes_on_leaves_with_one_line(tiny_digits,
                                                                               tmp_path):
    """Two plain torchrun agents, of two workers and of one. Rank 2, node 1's only worker (a
    sibling would kill it: stopped, it obeys its agent only when continued), freezes (SIGSTOP)
    as it begins step 3; ranks 0 and 1 name it by its silence and go on without it in their own
    processes. Woken while they still train, its recovery finds the membership
    closed without it: it leaves with one line and the dropped status, not a given-up
    recovery's (7) nor a hang's (124), and writes no ``fallback`` record."""
    from shared_runs import args_for

    port = free_port()
    args = args_for(tiny_digits, tmp_path, "--run-id", "woken", "--hang-timeout", "2")
    env = clean_env(**{FAULT_VAR: "hang@3:2"})
    agents, logs = two_plain_agents(tmp_path, port, args, env, "--rdzv_id=woken", nproc=(2, 1))
    run_dir = tmp_path / "runs" / "woken"

    def shrunk() -> bool:
        path = run_dir / "events.jsonl"
        return path.exists() and any(e["event"] == "shrink" for e in read_events(path))

    try:
        deadline = time.monotonic() + 90
        while not shrunk():
            assert agents[0].poll() is None and time.monotonic() < deadline, logs()
            time.sleep(0.05)
        (frozen,) = [p for p in psutil.Process(agents[1].pid).children()
                     if p.environ().get("RANK") == "2"]
        woken = wake(frozen, agents[1], tmp_path / "agent1.log", logs)
    finally:
        for agent in agents:
            kill_tree(agent.pid)
    # torchrun's summary of it.
    assert re.search(rf"rank\s+: 2 \(local_rank: 0\)\n\s+exitcode\s+: {EXIT_DROPPED} ", woken), \
        woken
    said = [line for line in woken.splitlines() if "[rank 2]" in line]
    assert len(said) == 1, woken
    assert "ERROR rank 2 was dropped from the job at generation 0 (the job is at 1): leaving " \
        "without writing" in said[0], woken
    events = read_events(run_dir / "events.jsonl")
    assert [e["event"] for e in events if e["event"] in ("fallback", "hang", "shrink")][:2] == \
        ["hang", "shrink"]
    assert not [e for e in events if e["event"] == "fallback"]
