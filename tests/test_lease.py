"""One live job per checkpoint folder (elastic_mnist/resilience/lease.py, lease_record.py).

The protocol on real files, with keepers in threads: who may take a lease, who is refused, when a
dead job's lease lapses, --take-over, SLURM's copies, releasing, and launches that race. Real
launches: a SIGKILLed job's folder, blocked and then taken over (below), and a second launch into
a live torchrun job's folder, refused on every rank (killed_run, test_elastic.py).
"""

from __future__ import annotations

import json
import os
import platform
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from launch import cli_cmd, start
from shared_runs import args_for, newest, wait_until
from test_faults import state

from elastic_mnist import distributed
from elastic_mnist.checkpoint import newest_committed_step
from elastic_mnist.checkpointer import Checkpointer
from elastic_mnist.config import TrainConfig
from elastic_mnist.env import DistEnv, Rendezvous
from elastic_mnist.errors import EXIT_LEASE_LOST, EXIT_PREEMPTED, FolderInUse
from elastic_mnist.events import EventLog, read_events
from elastic_mnist.resilience.fence import Fence, FenceClosed, Over
from elastic_mnist.resilience.lease import LeaseHold, LeaseKeeper, checkpoint_folder_lease
from elastic_mnist.resilience.lease_record import LEASE_FILE, JobIdentity, Lease, read_lease

JOB_A = JobIdentity("torchrun:job-a")
JOB_B = JobIdentity("torchrun:job-b")
TIMEOUT = 0.5
"""--lease-timeout of the keepers here: a renewal every 0.1 s."""


def keeper(folder: Path, identity: JobIdentity = JOB_A, lost: list | None = None) -> LeaseKeeper:
    return LeaseKeeper(folder, identity, TIMEOUT,
                       on_lost=lost.append if lost is not None else None)


def held(folder: Path, identity: JobIdentity = JOB_A) -> LeaseKeeper:
    k = keeper(folder, identity)
    k.acquire()
    k.start()
    return k


def test_a_live_job_keeps_another_job_out_and_its_own_processes_in(tmp_path):
    a = held(tmp_path)
    try:
        time.sleep(3 * a.beat_s)
        with pytest.raises(FolderInUse) as refused:
            keeper(tmp_path, JOB_B).acquire()
        message = str(refused.value)
        assert "\n" not in message
        assert f"checkpoint folder {tmp_path} is in use by another job: torchrun job job-a" \
            in message
        assert "last seen" in message and "s ago" in message and "--take-over" in message
        assert read_lease(tmp_path).beat >= 3  # renewed meanwhile
        for _ in range(3):  # its restarts, other nodes, a resize: the same job
            keeper(tmp_path).acquire()
        time.sleep(2 * a.beat_s)  # a renews after them
    finally:
        a.close()
    assert not (tmp_path / LEASE_FILE).exists()  # released as it closed
    keeper(tmp_path, JOB_B).acquire()  # the folder is free at once


def test_nodes_that_share_the_folder_keep_one_lease_until_the_last_leaves(tmp_path):
    nodes = [held(tmp_path) for _ in range(2)]
    time.sleep(3 * nodes[0].beat_s)
    nodes[0].close()  # a node leaves; the other renews on
    time.sleep(2 * nodes[1].beat_s)
    assert read_lease(tmp_path).job == JOB_A.job
    with pytest.raises(FolderInUse):
        keeper(tmp_path, JOB_B).acquire()
    nodes[1].close()
    assert not (tmp_path / LEASE_FILE).exists()


def test_a_job_that_a_restart_may_follow_leaves_its_lease_which_ends_with_its_launch(tmp_path):
    """Stopped by SIGTERM (exit 143; torchrun restarting it, say), the job keeps the folder: its
    restart takes it back, another job is refused while the launch's processes run; a launch on
    the same machine takes it at once when they have ended (elsewhere it lapses)."""
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a launch (keeper and agent) that has ended
    for agent_pid, refused in ((os.getpid(), True), (gone.pid, False)):
        folder = tmp_path / str(agent_pid)
        stopped = LeaseKeeper(folder, JOB_A, 60, agent_pid=agent_pid)
        stopped.acquire()
        stopped.close(release=False)
        assert read_lease(folder).job == JOB_A.job
        LeaseKeeper(folder, JOB_A, 60).acquire()  # its own restart
        elsewhere = LeaseKeeper(folder, JOB_B, 60, machine="another machine")
        with pytest.raises(FolderInUse, match="its lease lapses within"):
            elsewhere.acquire()
        dead = json.loads((folder / LEASE_FILE).read_text())
        dead.update(pid=gone.pid, agent_pid=agent_pid)  # the keeper has ended with its workers
        (folder / LEASE_FILE).write_text(json.dumps(dead))
        here = LeaseKeeper(folder, JOB_B, 60)
        if refused:  # its agent runs: torchrun may restart the workers
            with pytest.raises(FolderInUse, match="--take-over takes the folder from it"):
                here.acquire()
        else:
            here.acquire()
            assert read_lease(folder).job == JOB_B.job


def test_a_dead_jobs_lease_lapses_after_its_timeout_and_two_renewal_periods(tmp_path):
    dead = keeper(tmp_path)
    dead.acquire()  # taken, never renewed: its job was SIGKILLed
    with pytest.raises(FolderInUse):
        keeper(tmp_path, JOB_B).acquire()
    time.sleep(TIMEOUT + 0.05)
    start_taking = time.monotonic()
    b = keeper(tmp_path, JOB_B)
    b.acquire()  # lapsed by the clock, then watched for two renewals: unchanged
    assert 2 * dead.beat_s <= time.monotonic() - start_taking < 2
    assert read_lease(tmp_path).job == JOB_B.job


def test_a_live_keeper_whose_clock_lags_is_not_taken_over(tmp_path):
    """Its renewal times look a minute old, but its counter moves: alive."""
    a = held(tmp_path)
    original = a._content

    def lagging() -> bytes:
        lease = json.loads(original())
        lease["renewed"] -= 60
        return json.dumps(lease).encode()

    a._content = lagging
    try:
        time.sleep(2 * a.beat_s)
        assert read_lease(tmp_path).looks_lapsed()
        with pytest.raises(FolderInUse):
            keeper(tmp_path, JOB_B).acquire()
    finally:
        a.close()


def test_take_over_is_at_once_and_the_job_that_lost_stops_without_writing(tmp_path):
    """The keeper sees it at its next renewal; the job's writers, fenced by the lease, see it at
    their next commit, even before that renewal: a queued checkpoint is not committed (nor
    `latest` moved), no record reaches events.jsonl, and the job leaves with the keeper's line."""
    lost: list[Lease] = []
    a = LeaseKeeper(tmp_path, JOB_A, 60, on_lost=lost.append)  # no renewal before the end
    a.acquire()
    a.start()
    over: list[Over] = []
    fence = Fence(LeaseHold(tmp_path, JOB_A).taken, on_over=over.append)
    saver = Checkpointer(tmp_path, every=1, keep_last=3, restart_generation=0, fence=fence)
    events = EventLog(tmp_path / "events.jsonl", fence)
    saver.maybe_save(lambda: state(1), 1)
    saver.wait()
    events.emit("checkpoint", 1)
    b = keeper(tmp_path, JOB_B)
    b.acquire(take_over=True)
    saver.maybe_save(lambda: state(2), 2)
    with pytest.raises(FenceClosed):
        saver.wait()
    with pytest.raises(FenceClosed):
        events.emit("checkpoint", 2)
    assert [o.status for o in over] == [EXIT_LEASE_LOST, EXIT_LEASE_LOST]
    assert over[0].line == f"checkpoint folder {tmp_path} was taken over by torchrun job job-b " \
        f"on host {platform.node()} (pid {os.getpid()}): this job stops without writing more"
    assert (tmp_path / "latest").read_text() == "step-00000001\n"
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000001.json",
                                                               "step-00000001.pt"]
    assert [e["step"] for e in read_events(tmp_path / "events.jsonl")] == [1]
    events.close()
    a.close(release=False)
    assert not lost  # the writers saw it first

    lost = []
    a = keeper(tmp_path / "renewed", lost=lost)
    a.acquire()
    a.start()
    b = keeper(tmp_path / "renewed", JOB_B)
    b.acquire(take_over=True)
    deadline = time.monotonic() + 5
    while not lost and time.monotonic() < deadline:
        time.sleep(0.02)
    assert lost and lost[0].job == JOB_B.job  # a saw it at its next renewal
    time.sleep(3 * a.beat_s)
    assert read_lease(tmp_path / "renewed").job == JOB_B.job  # and wrote nothing after
    a.close()
    assert read_lease(tmp_path / "renewed").job == JOB_B.job  # nor released what is not its own


def test_two_jobs_with_one_run_id_differ_and_one_jobs_nodes_agree_without_a_rendezvous_id(
        tmp_path):
    """A job is told by a nonce drawn once in its rendezvous store, whatever its run id: two
    multi-node jobs of one run id (two stores) into one folder, the second is refused; the two
    nodes of one job launched without --rdzv_id (torchrun's "none") are both admitted, and so is
    the job's restart, while its store lives."""
    from torch.distributed import TCPStore

    def node(store: TCPStore, run_id: str) -> DistEnv:
        return DistEnv(rank=0, world_size=2, launched=True, run_id=run_id,
                       rendezvous=Rendezvous("127.0.0.1", store.port, run_id or "none"))

    first, second = (TCPStore("127.0.0.1", 0, is_master=True) for _ in range(2))
    job = LeaseKeeper(tmp_path / "same-id", JobIdentity.of(node(first, "job42")), 60)
    job.acquire()
    other = JobIdentity.of(node(second, "job42"))
    assert other.job == job.identity.job and other.nonce != job.identity.nonce
    with pytest.raises(FolderInUse, match="in use by another job of the same rendezvous id "
                                          r"\(another rendezvous store\): torchrun job job42"):
        LeaseKeeper(tmp_path / "same-id", other, 60).acquire()
    LeaseKeeper(tmp_path / "same-id", JobIdentity.of(node(first, "job42")), 60).acquire()

    nodes = [LeaseKeeper(tmp_path / "no-id", JobIdentity.of(node(first, None)), 60)
             for _ in range(2)]
    for n in nodes:
        n.acquire()  # never refused
    assert nodes[0].identity == nodes[1].identity != job.identity
    with pytest.raises(FolderInUse):
        LeaseKeeper(tmp_path / "no-id", JobIdentity.of(node(second, None)), 60).acquire()


def test_a_requeued_copy_takes_over_from_an_older_copy_of_its_job(tmp_path):
    """SLURM keeps the job id (the rendezvous id) and counts the copies."""
    lost: list[Lease] = []
    first = keeper(tmp_path, JobIdentity("torchrun:4242", 0), lost=lost)
    first.acquire()
    first.start()
    requeued = keeper(tmp_path, JobIdentity("torchrun:4242", 1))
    requeued.acquire()  # never refused, even while the first copy still runs
    deadline = time.monotonic() + 5
    while not lost and time.monotonic() < deadline:
        time.sleep(0.02)
    assert lost and lost[0].copy == 1  # the first copy stops
    with pytest.raises(FolderInUse, match="a newer copy of this job"):
        keeper(tmp_path, JobIdentity("torchrun:4242", 0)).acquire()
    first.close()


def test_launches_that_race_for_a_free_folder_get_it_once(tmp_path):
    for round_ in range(10):
        folder = tmp_path / str(round_)
        barrier = threading.Barrier(4)

        def launch(i: int, folder: Path = folder, barrier: threading.Barrier = barrier) -> bool:
            k = keeper(folder, JobIdentity(f"process:{i}"))
            barrier.wait()
            try:
                k.acquire()
                return True
            except FolderInUse:
                return False

        with ThreadPoolExecutor(4) as pool:
            assert sum(pool.map(launch, range(4))) == 1
        assert [p.name for p in folder.iterdir()] == [LEASE_FILE]  # nothing left aside


def test_a_process_without_torchrun_is_a_job_of_its_own():
    alone = DistEnv()
    assert JobIdentity.of(alone) != JobIdentity.of(alone)  # two terminals, two jobs
    launched = DistEnv(rank=1, world_size=2, launched=True, run_id="abc", requeue_count=2)
    assert JobIdentity.of(launched) == JobIdentity("torchrun:abc", 2)
    assert DistEnv.from_environ({"SLURM_RESTART_COUNT": "3"}).requeue_count == 3


def test_node_local_folders_each_get_a_lease_and_a_refusal_anywhere_leaves_none(tmp_path,
                                                                               monkeypatch):
    """Node 0's folder is free, node 1's (seen through the gather) is another job's: every rank
    is refused, and node 0 takes back the lease it had created."""
    cfg = TrainConfig()
    cfg.checkpoint.checkpoint_dir = str(tmp_path / "node0")
    env = DistEnv(rank=0, world_size=2, local_world_size=1, launched=True, run_id="job-a")
    other = (("in use", "checkpoint folder /node1/ckpt is in use by another job: ..."),
             JobIdentity.of(env))
    monkeypatch.setattr(distributed, "all_gather_object", lambda mine, device: [mine, other])
    with pytest.raises(FolderInUse, match="/node1/ckpt is in use"), \
            checkpoint_folder_lease(cfg, env, torch.device("cpu")):
        pass
    assert not (tmp_path / "node0" / LEASE_FILE).exists()
    monkeypatch.setattr(distributed, "all_gather_object",
                        lambda mine, device: [mine, (None, JobIdentity.of(env))])
    with checkpoint_folder_lease(cfg, env, torch.device("cpu")) as hold:
        assert read_lease(tmp_path / "node0").job == "torchrun:job-a"
        hold.ended(EXIT_PREEMPTED)  # a restart may follow: kept
    assert read_lease(tmp_path / "node0").job == "torchrun:job-a"
    with checkpoint_folder_lease(cfg, env, torch.device("cpu")) as hold:
        hold.ended(0)  # finished: released
    assert not (tmp_path / "node0" / LEASE_FILE).exists()


@pytest.mark.slow
def test_a_sigkilled_jobs_folder_is_taken_over_and_resumed(tiny_digits, tmp_path):
    """One process SIGKILLed after its checkpoint of step 2 leaves its lease behind. Seen from
    another machine it holds the folder until it lapses; a launch on this one, where the killed
    process is seen to be gone, takes the folder over at once and resumes from that checkpoint."""
    args = args_for(tiny_digits, tmp_path, "--checkpoint-every", "2", "--run-id", "first")
    proc = start(cli_cmd(*args), log=tmp_path / "first.log")
    wait_until(lambda: newest_committed_step(tmp_path / "ckpt") >= 2, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed = time.time()
    kept = read_lease(tmp_path / "ckpt")
    assert kept is not None and kept.pid == kept.agent_pid == proc.pid
    elsewhere = LeaseKeeper(tmp_path / "ckpt", JOB_B, 15, machine="another machine")
    with pytest.raises(FolderInUse, match=f"run first, a single process .* \\(pid {proc.pid}\\)"
                                          f".*its lease lapses within"):
        elsewhere.acquire()

    log = tmp_path / "resumed.log"
    resumed = start(cli_cmd(*args_for(tiny_digits, tmp_path, "--max-steps", "4")), log=log)
    wait_until(lambda: (read_lease(tmp_path / "ckpt") or kept).pid == resumed.pid, resumed)
    taken = time.time()
    assert resumed.wait(timeout=120) == 0, log.read_text()
    print(f"SIGKILL -> lease taken over by the next launch on this machine {taken - killed:.1f} s "
          f"(its start-up) -> that launch finished {time.time() - taken:.1f} s")
    out = log.read_text()
    assert "taking over the lease of a single process" in out, out
    assert "(its launch has ended)" in out, out
    assert "resumed from" in out and "step-00000002.pt: step 2" in out, out
    assert not (tmp_path / "ckpt" / LEASE_FILE).exists()  # released at the end


@pytest.mark.slow
def test_a_launch_into_a_live_jobs_folder_is_refused_on_every_rank(killed_run, reference_run):
    """Two workers under plain torchrun, launched with another seed into killed_run's folder at
    its step 4: each rank says one line naming the live job and exits 2, before anything is
    written; the live job goes on, through two SIGKILLs and torchrun's restarts of it, and ends
    with the digest of the same job run alone."""
    status, out = (killed_run / "intruder.log").read_text().split("\n", 1)
    assert status == "exit 1"  # torchrun's, after its workers' 2 (its own summary follows)
    refusals = [line for line in out.splitlines()
                if line.startswith("elastic-mnist train: error: checkpoint folder")]
    assert len(refusals) == 2, out  # one line from each rank
    for line in refusals:
        assert f"{killed_run / 'ckpt'} is in use by another job: run killed, torchrun job " \
            in line and "last seen" in line, line
    assert "exitcode: 2" in out and "FolderInUse" not in out  # no worker's traceback
    assert "resumed from" not in out
    assert not (killed_run / "runs" / "intruder").exists()
    assert json.loads((killed_run / "ckpt" / "run.json").read_text())["run_id"] == "killed"
    assert newest(killed_run / "ckpt")["model_digest"] == \
        newest(reference_run / "ckpt")["model_digest"]
