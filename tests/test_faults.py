"""Faults that are not crashes: a hung rank, non-finite steps, a full or read-only checkpoint folder.

Each is made for real: a worker stopped with SIGSTOP under plain torchrun and under jobs/local.sh,
gradients poisoned through ELASTIC_MNIST_FAULT, a checkpoint writer failing with ENOSPC, a folder
mounted read-only; then what the run left behind is read.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from launch import REPO, clean_env, cli_cmd, run, start, torchrun_cmd
from shared_runs import args_for, inspect, wait_until, workers

from elastic_mnist.checkpoint import newest_committed_step, nonfinite_entries
from elastic_mnist.checkpointer import Checkpointer
from elastic_mnist.errors import (
    EXIT_CANNOT_SAVE,
    EXIT_DIVERGED,
    CheckpointError,
    CheckpointWriteError,
    EnvError,
    report_user_error,
)
from elastic_mnist.events import read_events
from elastic_mnist.resilience import watchdog
from elastic_mnist.resilience.faults import FAULT_VAR, Fault, Faults, parse

sys.path.insert(0, str(REPO / "scripts"))
from check_audit import load_records
from check_audit import main as check_audit

TRACEBACK = "Traceback (most recent call last)"


def audit_records(run_dir: Path) -> list[dict]:
    """Every audit record of the run, with its restart generation (check_audit's reading)."""
    return [{**record, "generation": generation}
            for generation, steps in load_records(run_dir).items()
            for records in steps.values() for record in records]


def stop_worker(proc, rank: int) -> float:
    """SIGSTOPs the worker of ``rank``; returns when."""
    (worker,) = [p for p in workers(proc) if p.environ().get("RANK") == str(rank)]
    worker.send_signal(signal.SIGSTOP)
    return time.time()


def hang_events(run_dir: Path) -> list[dict]:
    return [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "hang"]


# --- the fault injection itself ---------------------------------------------------------------


def test_fault_specs_parse_and_each_fires_once():
    faults = parse("nan-grad@5:1, hang@12:1,disk-full@20")
    assert faults == (Fault("nan-grad", 5, 1), Fault("hang", 12, 1), Fault("disk-full", 20, 0))
    mine = Faults.from_environ(rank=1, restart_count=0, environ={FAULT_VAR: "nan-grad@5:1"})
    assert [mine.fires("nan-grad", 5), mine.fires("nan-grad", 5)] == [True, False]
    assert not Faults.from_environ(0, 0, {FAULT_VAR: "nan-grad@5:1"}).fires("nan-grad", 5)
    restarted = Faults.from_environ(1, 1, {FAULT_VAR: "nan-grad@5:1,hang@6:1,disk-full@7:1"})
    assert restarted.pending == {("nan-grad", 5)}  # the others would strike again forever
    regrouped = Faults.from_environ(1, 0, {FAULT_VAR: "nan-grad@5:1,hang@6:1"}, regrouped=True)
    assert regrouped.pending == {("nan-grad", 5)}


@pytest.mark.parametrize("bad", ["nan-grad", "nan-grad@x", "melt@3", "hang@3:one"])
def test_a_bad_fault_spec_is_one_line(bad):
    with pytest.raises(EnvError, match=FAULT_VAR) as caught:
        Faults.from_environ(0, 0, {FAULT_VAR: bad})
    assert "\n" not in str(caught.value)


# --- a full checkpoint folder, in the writer ----------------------------------------------------


def state(step: int, value: float = 1.0) -> dict:
    return {"format": 1, "model": {"w": torch.full((3,), value)},
            "optimizer": {"state": {0: {"exp_avg": torch.zeros(3)}}, "param_groups": []},
            "progress": {"step": step, "epoch": 0, "cursor": 0, "samples_seen": step},
            "world_size": 1, "run_id": "r", "data": {"fingerprint": "f"}}


def full_disk_at(step: int):
    def before_write(at: int) -> None:
        if at == step:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return before_write


def test_a_full_disk_keeps_the_last_good_checkpoint_and_says_so_in_one_line(tmp_path):
    ckpt = tmp_path / "ckpt"
    saver = Checkpointer(ckpt, every=1, keep_last=3, restart_generation=0,
                         before_write=full_disk_at(2))
    assert saver.maybe_save(lambda: state(1), 1)
    saver.wait()
    saver.maybe_save(lambda: state(2), 2)
    saver._idle.wait()
    assert saver.failed
    assert not saver.maybe_save(lambda: state(3), 3)  # nothing more is tried
    with pytest.raises(CheckpointWriteError) as caught:
        saver.wait()
    message = str(caught.value)
    assert "\n" not in message
    assert f"checkpoint folder {ckpt} is full (No space left on device) saving step 2" in message
    assert "the last good checkpoint is step 1 (step-00000001.pt, named by latest)" in message
    assert (ckpt / "latest").read_text().strip() == "step-00000001"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-00000001.json",
                                                      "step-00000001.pt"]


def test_a_write_that_fails_midway_takes_back_what_it_wrote(tmp_path, monkeypatch):
    from elastic_mnist import checkpoint

    ckpt = tmp_path / "ckpt"
    saver = Checkpointer(ckpt, every=1, keep_last=3, restart_generation=0)
    saver.maybe_save(lambda: state(1), 1)
    saver.wait()
    real = checkpoint.atomic_write_bytes

    def no_room_for_the_manifest(path, data):
        if path.suffix == ".json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(path, data)

    monkeypatch.setattr(checkpoint, "atomic_write_bytes", no_room_for_the_manifest)
    saver.maybe_save(lambda: state(2), 2, final=False)
    with pytest.raises(CheckpointWriteError):
        saver.wait()
    assert not (ckpt / "step-00000002.pt").exists()  # the payload went with the failed commit
    assert newest_committed_step(ckpt) == 1


def test_non_finite_weights_are_never_saved(tmp_path):
    """Refused as a failed write fails: the checkpointer is failed (the next step's flags stop
    every rank), and rank 0's wait says why; a final save, with no step after it, says it at
    once."""
    saver = Checkpointer(tmp_path, every=1, keep_last=3, restart_generation=0)
    assert saver.maybe_save(lambda: state(1, float("nan")), 1) is False
    assert saver.failed
    assert saver.maybe_save(lambda: state(2), 2) is False  # no checkpoint after it
    with pytest.raises(Exception, match=r"refusing to save step 1: model\.w") as refused:
        saver.wait()
    # Rank 0 leaves with the code every other rank leaves with when it cannot save, in one line.
    assert isinstance(refused.value, CheckpointError)  # one line from worker_main, no traceback
    assert report_user_error("train", refused.value) == EXIT_CANNOT_SAVE
    with pytest.raises(CheckpointError, match=r"refusing to save step 3: model\.w"):
        saver.maybe_save(lambda: state(3, float("inf")), 3, final=True)
    assert nonfinite_entries(state(1)) == []
    assert not list(tmp_path.glob("step-*"))


@pytest.mark.slow
def test_weights_gone_non_finite_stop_every_rank_as_a_failed_save_does(tiny_digits, tmp_path):
    """Two workers under plain torchrun, a weight decay no float32 weight survives (1 - lr x
    decay overflows): step 1's loss and gradients are finite, the weights it leaves are not.
    Rank 0 refuses to save them, and the refusal travels in step 2's collective as a failed
    write does: rank 0 says why in one line, every rank leaves with 4, no worker's traceback,
    nothing saved."""
    args = args_for(tiny_digits, tmp_path, "--checkpoint-every", "1", "--lr", "1",
                    "--weight-decay", "1e40", "--warmup-steps", "0", "--max-steps", "4",
                    "--run-id", "refused")
    done = run(torchrun_cmd(2, *args), timeout=120)
    assert done.returncode == 1, done.stdout  # torchrun's, after its workers' statuses
    summary = re.findall(r"rank\s+: (\d+) \(local_rank: \d+\)\n\s+exitcode\s+: (-?\d+)",
                         done.stdout)
    assert sorted(summary) == [("0", str(EXIT_CANNOT_SAVE)), ("1", str(EXIT_CANNOT_SAVE))], \
        done.stdout
    errors = [line for line in done.stdout.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(
        "elastic-mnist train: error: refusing to save step 1: "), done.stdout
    assert errors[0].endswith(" hold non-finite values"), done.stdout
    assert "elastic_mnist/" not in done.stdout.split("ChildFailedError")[0], done.stdout
    assert not list((tmp_path / "ckpt").glob("step-*"))


# --- non-finite steps ---------------------------------------------------------------------------


def test_nonfinite_steps_are_skipped_and_too_many_in_a_row_stop_the_job(tiny_digits, tmp_path):
    """One worker: a NaN step is skipped (no update), the count restarts after a finite step, and
    the third in a row ends the job with one line; every checkpoint written is finite."""
    args = args_for(tiny_digits, tmp_path, "--checkpoint-every", "1", "--keep-last", "20",
                    "--run-id", "nan")
    poisoned = "nan-grad@3,nan-grad@5,nan-grad@6,nan-grad@7"
    done = run(cli_cmd(*args), env=clean_env(**{FAULT_VAR: poisoned}), timeout=120)
    assert done.returncode == EXIT_DIVERGED, done.stdout
    errors = [line for line in done.stdout.splitlines() if "error:" in line]
    expected = ("elastic-mnist train: error: 3 steps in a row (to step 7) had non-finite loss "
                "or gradients (rank(s) 0 at the last); none was applied, and no checkpoint was "
                "written after them (--max-nonfinite-steps 3): lower --lr, or check the data")
    assert errors == [expected], done.stdout
    assert TRACEBACK not in done.stdout
    events = read_events(tmp_path / "runs" / "nan" / "events.jsonl")
    assert [(e["step"], e["rank"], e["in_a_row"]) for e in events if e["event"] == "nonfinite"] \
        == [(3, 0, 1), (5, 0, 1), (6, 0, 2), (7, 0, 3)]
    assert newest_committed_step(tmp_path / "ckpt") == 6
    for step in range(1, 7):
        payload = torch.load(tmp_path / "ckpt" / f"step-{step:08d}.pt", weights_only=True)
        assert nonfinite_entries(payload) == []
        updates = {s["step"].item() for s in payload["optimizer"]["state"].values()}
        assert updates == {step - (step >= 3) - (step >= 5) - (step >= 6)}  # skipped: no update


# --- a hung rank --------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_stalled_then_a_stopped_worker_cost_seconds_under_plain_torchrun(tiny_digits, tmp_path):
    """Plain torchrun, two workers. Attempt 0: rank 1's gradients poisoned at step 3, then its
    training thread stalls at step 12 (a deadlock: its other threads live). Attempt 1: rank 1 is
    SIGSTOPped after step 25. Each time the group restarts within seconds, not --pg-timeout (300 s
    here), and the job finishes with every sample used exactly once. (--hang-timeout 4: the
    default's 10 s is jobs/local.sh's test below.)"""
    args = args_for(tiny_digits, tmp_path, "--checkpoint-every", "5", "--audit-samples",
                    "--pg-timeout", "300", "--hang-timeout", "4", "--run-id", "hung",
                    "--epochs", "8")  # 80 steps
    log = tmp_path / "run.log"
    proc = start(torchrun_cmd(2, *args, max_restarts=2), log=log,
                 env=clean_env(**{FAULT_VAR: "nan-grad@3:1,stall@12:1"}))
    run_dir = tmp_path / "runs" / "hung"
    wait_until(lambda: any(r["generation"] == 1 and r["step"] >= 25
                           for r in audit_records_if_any(run_dir)), proc)
    stopped_at = stop_worker(proc, rank=1)
    assert proc.wait(timeout=240) == 0, log.read_text()

    records = audit_records(run_dir)
    stalled_at = max(r["time"] for r in records if r["generation"] == 0)
    after_stall = min(r["time"] for r in records if r["generation"] == 1) - stalled_at
    after_stop = min(r["time"] for r in records if r["generation"] == 2) - stopped_at
    print(f"plain torchrun: rank 1 stalled -> next step {after_stall:.1f} s; "
          f"SIGSTOP of rank 1 -> next step {after_stop:.1f} s")
    assert after_stall < 90 and after_stop < 90  # the watchdog's doing: --pg-timeout takes 300 s
    stall, stop = hang_events(run_dir)
    assert (stall["rank"], stall["ranks"], stall["last_step"]) == (1, [1], 11)
    assert stall["reason"].startswith("alive, not in a collective: rank 1 at ")
    assert "faults.py" in stall["reason"], stall["reason"]
    assert (stop["rank"], stop["ranks"], stop["reported_by"]) == (1, [1], 0)
    assert stop["reason"] == "no heartbeat (stopped or wedged)" and stop["deadline_s"] == 4.0
    events = read_events(run_dir / "events.jsonl")
    assert [(e["step"], e["ranks"]) for e in events if e["event"] == "nonfinite"] == [(3, [1])]
    assert check_audit([str(run_dir), "--num-samples", "640"]) == 0
    assert all(c["valid"] for c in inspect(tmp_path / "ckpt")["checkpoints"])
    assert TRACEBACK not in log.read_text()


def audit_records_if_any(run_dir: Path) -> list[dict]:
    try:
        return audit_records(run_dir)
    except (OSError, ValueError):  # not there yet, or a line being written
        return []


@pytest.mark.slow
def test_a_full_disk_then_a_stopped_store_host_under_jobs_local_sh(tiny_digits, tmp_path):
    """jobs/local.sh (rank 0's worker serves the group's store): ENOSPC in rank 0's writer at
    step 10 stops both workers with one line; torchrun restarts them from step 5; then rank 0
    itself is SIGSTOPped and rank 1 restarts the group after --hang-timeout (4 s); the job
    finishes."""
    args = args_for(tiny_digits, tmp_path, "--checkpoint-every", "5", "--audit-samples",
                    "--run-id", "local", "--epochs", "8",
                    "--hang-timeout", "4")[1:]  # jobs/local.sh says `train`
    log = tmp_path / "run.log"
    proc = start([str(REPO / "jobs" / "local.sh"), *args], log=log,
                 env=clean_env(**{FAULT_VAR: "disk-full@10", "MAX_RESTARTS": "2",
                                  "NPROC_PER_NODE": "2",
                                  "PATH": f"{Path(sys.executable).parent}{os.pathsep}"
                                          f"{os.environ['PATH']}"}))
    run_dir = tmp_path / "runs" / "local"
    wait_until(lambda: sum(e["event"] == "start"
                           for e in read_events_if_any(run_dir)) == 2, proc)
    wait_until(lambda: newest_committed_step(tmp_path / "ckpt") >= 15, proc)
    stopped_at = stop_worker(proc, rank=0)
    assert proc.wait(timeout=240) == 0, log.read_text()

    out = log.read_text()
    full = [line for line in out.splitlines() if "is full" in line]
    expected = (f"elastic-mnist train: error: checkpoint folder {tmp_path / 'ckpt'} is full (No "
                f"space left on device) saving step 10; the last good checkpoint is step 5 "
                f"(step-00000005.pt, named by latest); nothing half-written was left")
    assert full == [expected], out
    assert TRACEBACK not in out
    starts = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "start"]
    assert [s["resumed_from_step"] for s in starts][:2] == [None, 5]
    (hang,) = hang_events(run_dir)
    assert (hang["rank"], hang["reported_by"]) == (0, 1)
    assert 4.0 <= hang["deadline_s"] < 10.0  # --hang-timeout, or 10 slow steps where longer
    seconds = seconds_to_next_step_after(run_dir, stopped_at, generation=2)
    print(f"jobs/local.sh: SIGSTOP of rank 0 -> next step of the restarted group: {seconds:.1f} s")
    assert seconds < 90, seconds
    assert check_audit([str(run_dir), "--num-samples", "640"]) == 0
    assert not list((tmp_path / "ckpt").glob(".*.tmp"))


def read_events_if_any(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    return read_events(path) if path.exists() else []


def seconds_to_next_step_after(run_dir: Path, stopped_at: float, generation: int) -> float:
    later = [r["time"] for r in audit_records(run_dir) if r["generation"] >= generation]
    return min(later) - stopped_at


# --- a checkpoint folder that cannot be written -------------------------------------------------


@pytest.fixture
def read_only_folder(tmp_path):
    """A folder no process may write into: a read-only tmpfs for root, else mode 0555."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)],
                             capture_output=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=False)


def test_every_node_may_check_a_shared_folder_at_once(tmp_path):
    """Nodes sharing one checkpoint folder all check it as they start: no check trips another."""
    from concurrent.futures import ThreadPoolExecutor

    from elastic_mnist.checkpoint import check_writable

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: check_writable(tmp_path / "ckpt"), range(400)))
    assert list((tmp_path / "ckpt").iterdir()) == []


def test_a_read_only_checkpoint_folder_is_said_before_the_first_step(tiny_digits, tmp_path,
                                                                      read_only_folder):
    ckpt = read_only_folder / "ckpt"
    args = ["train", "--device", "cpu", "--dataset", "synthetic", "--data-dir", str(tiny_digits),
            "--checkpoint-dir", str(ckpt), "--logdir", str(tmp_path / "runs")]
    done = run(cli_cmd(*args), timeout=60)
    assert done.returncode == EXIT_CANNOT_SAVE, done.stdout
    assert done.stdout.strip().splitlines()[-1].startswith(
        f"elastic-mnist train: error: checkpoint folder {ckpt} cannot be written: "), done.stdout
    assert TRACEBACK not in done.stdout
    assert not (tmp_path / "runs").exists()  # stopped before the run began


# --- the watchdog's verdict, on a real store ----------------------------------------------------


class Peer:
    """Rank 1's heartbeats, written into the store as its watchdog would."""

    def __init__(self, store, busy: str = "", beating: bool = True, waiting: bool = True):
        self.store, self.busy, self.beating, self.beat = store, busy, beating, 0
        self.waiting = waiting

    def publish(self) -> None:
        if self.beating:
            self.beat += 1
        self.store.set(f"{watchdog.PREFIX}1", json.dumps(
            {"rank": 1, "step": 7, "beat": self.beat, "busy": self.busy, "host": "h",
             "pid": 1, "ppid": 1, "where": "train.py:1 step", "waiting": self.waiting}))


class GoneStore:
    """The store of a host that is gone: every call fails, as a TCPStore client's does."""

    def set_timeout(self, timeout) -> None:
        pass

    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise RuntimeError("Connection reset by peer")
        return fail


def test_only_the_first_and_last_ranks_probe_and_the_others_follow_their_verdict():
    """Of 5 ranks, 0 and 4 read the heartbeats. Rank 2, past its deadline, looks for their
    verdict: it waits while they beat on and nothing is declared, takes the verdict once
    declared (no table read of its own), and reads the heartbeats itself only when both
    probers' heartbeats stood still between two of its reads (lost with the hang)."""
    import datetime

    from torch.distributed import TCPStore

    from elastic_mnist.env import DistEnv

    assert watchdog.probers(5) == [0, 4] and watchdog.probers(2) == [0, 1]
    store = TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=5))
    dogs = {r: watchdog.Watchdog(DistEnv(rank=r, world_size=5, launched=True), store.clone(),
                                 floor_s=10, report=lambda record: None, beat_s=0.05)
            for r in range(5)}
    try:
        assert [r for r, dog in dogs.items() if dog.prober] == [0, 4]
        for dog in dogs.values():
            dog._publish()
        follower = dogs[2]
        assert follower._probers_verdict() == "wait"  # before its deadline: nothing asked
        follower.last_progress -= 11  # no step for 11 s: past the deadline
        reads = []
        follower._table = lambda: reads.append(1)  # a follower reads no table
        follower.beats = 0  # an even beat: it reads the probers' heartbeats
        assert follower._probers_verdict() == "wait"  # first read: nothing to compare yet
        for r in (0, 4):
            dogs[r]._publish()  # the probers beat on
        assert follower._probers_verdict() == "wait"
        dogs[0]._publish()  # rank 4 stood still: the hung rank, say; rank 0 will declare
        assert follower._probers_verdict() == "wait"
        assert follower._probers_verdict() == "probe"  # both stood still: nobody will
        record = {"rank": 3, "ranks": [3], "last_step": 7, "reported_by": 0, "reason": "r",
                  "silent": {}}
        assert dogs[0]._claim(record)
        follower.beats = 1  # every beat, it looks for the verdict
        assert follower._probers_verdict() == record and reads == []
    finally:
        for dog in dogs.values():
            dog.close()


def verdict_with(peer_busy: str, peer_beating: bool, peer_waiting: bool = True,
                 rank0_waits: bool = True, store_gone: bool = False):
    """Rank 0's watchdog's verdict, rank 1 as ``Peer`` says; rank 0's own training thread is a
    real thread blocked in a host sync that no torch frame shows (as an NCCL rank blocks, the
    collective having returned at once), inside ``waiting()`` when ``rank0_waits``: the step's
    wait, holding the collective's own (``Comm.all_reduce_``), closed before the read."""
    import contextlib
    import datetime
    import threading

    from torch.distributed import TCPStore

    from elastic_mnist.env import DistEnv

    store = TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=5))
    dog = watchdog.Watchdog(DistEnv(rank=0, world_size=2, launched=True),
                            GoneStore() if store_gone else store.clone(), floor_s=0.1,
                            report=lambda record: None, beat_s=0.05, store_host=1)
    dog.step = 7
    peer = Peer(store.clone(), peer_busy, peer_beating, peer_waiting)
    done, blocked = threading.Event(), threading.Event()

    def host_sync() -> None:  # the training thread: blocked outside torch.distributed
        with dog.waiting() if rank0_waits else contextlib.nullcontext():
            with dog.waiting() if rank0_waits else contextlib.nullcontext():
                pass  # the collective, returned at once
            blocked.set()
            done.wait()  # the read of its result

    def beat() -> None:
        while not done.wait(0.02):
            peer.publish()

    training = threading.Thread(target=host_sync)
    training.start()
    dog.training_thread = training.ident
    blocked.wait()
    peer.publish()  # as every rank does before its first step
    thread = threading.Thread(target=beat)
    thread.start()
    try:
        dog._publish()
        return dog._probe()
    finally:
        done.set()
        thread.join()
        training.join()
        dog.close()


def test_the_watchdog_waits_for_a_busy_peer_and_names_a_silent_or_stuck_one():
    assert verdict_with(peer_busy="logging", peer_beating=True) is None
    silent = verdict_with(peer_busy="", peer_beating=False)
    assert (silent.suspects, silent.silent) == ([1], [1])
    stuck = verdict_with(peer_busy="", peer_beating=True, peer_waiting=False)
    assert (stuck.suspects, stuck.silent) == ([1], [])
    assert stuck.reason == "alive, not in a collective: rank 1 at train.py:1 step"
    waiting = verdict_with(peer_busy="", peer_beating=True, peer_waiting=True)
    assert waiting.suspects == []
    assert waiting.reason == "every rank alive and waiting in a collective"


def test_a_rank_blocked_in_a_marked_host_sync_is_waiting_not_hung():
    """NCCL's collectives return at once; a rank blocks later, in the host sync that reads the
    result (``.tolist()``), far from torch.distributed's frames, after the collective's own mark
    has closed inside the step's. Marked as a wait, it is one: only the peer that is not waiting
    is named. Unmarked, it would be named too."""
    stuck = verdict_with(peer_busy="", peer_beating=True, peer_waiting=False)
    assert stuck.suspects == [1]
    assert stuck.heartbeats[0].waiting and "test_faults.py" in stuck.heartbeats[0].where
    unmarked = verdict_with(peer_busy="", peer_beating=True, peer_waiting=False,
                            rank0_waits=False)
    assert unmarked.suspects == [0, 1]


def test_a_rank_stuck_outside_every_collective_when_the_store_goes_names_itself():
    """The store's host left (its verdict: this rank hung): a rank waiting in a collective names
    that host; one whose own training thread stands outside every collective names itself, and
    writes no record blaming the host."""
    waiting = verdict_with(peer_busy="", peer_beating=True, store_gone=True)
    assert waiting.suspects == [1]
    assert waiting.reason == "the store that rank 1 serves does not answer"
    stuck = verdict_with(peer_busy="", peer_beating=True, store_gone=True, rank0_waits=False)
    assert stuck.suspects == [0] and stuck.silent == []
    assert stuck.reason.startswith("alive, not in a collective: rank 0 at ")
    assert stuck.reason.endswith("; the store that rank 1 serves does not answer")


def test_a_dropped_rank_whose_watchdog_finds_a_hang_leaves_as_dropped(monkeypatch, caplog):
    """A frozen rank woken after the survivors went on without it: its watchdog finds its
    peers' heartbeats stopped, or its store gone, and would name itself or nobody (EXIT_HUNG).
    It asks the writers' fence first: dropped, it declares nothing and leaves with the fence's
    one line and status; a fence that cannot tell leaves the verdict as it was (a real hang)."""
    from elastic_mnist.env import DistEnv
    from elastic_mnist.errors import EXIT_DROPPED, EXIT_HUNG, CannotTell
    from elastic_mnist.resilience.fence import Fence, Over

    dropped = Over("rank 0 was dropped from the job at generation 0 (the job is at 1): leaving "
                   "without writing", EXIT_DROPPED)

    def cannot_tell() -> None:
        raise CannotTell("the coordination store does not answer")

    for reason, left, exits in ((lambda: dropped, [dropped], []),
                                (cannot_tell, [], [EXIT_HUNG])):
        exited: list[int] = []
        monkeypatch.setattr(watchdog, "end_process", exited.append)
        fenced: list[Over] = []
        said: list[dict] = []
        handed: list[list[int]] = []
        dog = watchdog.Watchdog(DistEnv(rank=0, world_size=2, launched=True), GoneStore(),
                                floor_s=0.1, report=said.append,
                                go_on_without=lambda ranks, why, to=handed: to.append(ranks),
                                store_host=None, fence=Fence(reason, on_over=fenced.append))
        try:
            dog._declare(watchdog.Verdict([0], [], "alive, not in a collective: rank 0", {}))
        finally:
            dog.close()
        assert (fenced, exited, handed, said) == (left, exits, [], []), reason
    hang_lines = [r for r in caplog.records if r.getMessage().startswith("hang: ")]
    assert len(hang_lines) == 1  # the real hang's alone


def test_a_verdict_reached_as_the_training_thread_closes_the_watchdog_is_dropped(monkeypatch,
                                                                                 caplog):
    """Rank 1 declared the hang first; rank 0's training thread, woken by it, recovers and
    closes rank 0's watchdog (``close(wait=False)``) while that watchdog, at its own deadline,
    asks the fence. The generation is over, and so is its verdict: no second ``hang`` line or
    record, nothing handed on, no exit (whether it closes before the store is asked or just
    after the question)."""
    import json

    from elastic_mnist.env import DistEnv
    from elastic_mnist.resilience.fence import Fence

    class DictStore:
        def __init__(self) -> None:
            self.values: dict[str, bytes] = {}

        def set_timeout(self, timeout) -> None:
            pass

        def set(self, key: str, value: str) -> None:
            self.values[key] = value.encode()

        def compare_set(self, key: str, expected: str, desired: str) -> bytes:
            if self.values.get(key, b"") == expected.encode():
                self.values[key] = desired.encode()
            return self.values[key]

    exited: list[int] = []
    monkeypatch.setattr(watchdog, "end_process", exited.append)
    for closes_during_question in (True, False):
        store = DictStore()
        store.set(watchdog.DECLARED, json.dumps({"reported_by": 1, "last_step": 7}))
        said: list[dict] = []
        handed: list[list[int]] = []
        dogs: list[watchdog.Watchdog] = []

        def recovering(closes=closes_during_question, dogs=dogs) -> None:  # a survivor's
            if closes:
                dogs[0].close(wait=False)

        dog = watchdog.Watchdog(DistEnv(rank=0, world_size=3, launched=True), store,
                                floor_s=0.1, report=said.append,
                                go_on_without=lambda ranks, why, to=handed: to.append(ranks),
                                store_host=None, fence=Fence(recovering))
        dogs.append(dog)
        if not closes_during_question:  # closed between the question and the claim
            monkeypatch.setattr(dog, "_fenced", lambda d=dog: d._calls.shutdown() or False)
            dog._stop.clear()
        try:
            dog._declare(watchdog.Verdict([2], [2], "no heartbeat (stopped or wedged)", {}))
        finally:
            dog.close()
        assert (said, handed, exited) == ([], [], []), closes_during_question
    assert not [r for r in caplog.records if r.getMessage().startswith("hang: ")]


def test_a_dropped_rank_holding_a_failed_save_leaves_as_dropped(tmp_path):
    """Rank 0 refused a save (its next step's flags would have stopped everyone), froze, and the
    survivors went on without it: woken, it leaves as dropped. Its writers' teardown keeps the
    refusal to itself then (the survivors have their own checkpointer), and raises it otherwise."""
    from elastic_mnist.checkpointer import Checkpointer
    from elastic_mnist.errors import RefusedToSave
    from elastic_mnist.writers import Writers

    def refused() -> Writers:
        saver = Checkpointer(tmp_path, every=1, keep_last=3, restart_generation=0)
        state = {"model": {"w": torch.tensor([float("nan")])}, "optimizer": {},
                 "progress": {"step": 1}}
        assert saver.maybe_save(lambda: state, 1) is False and saver.failed
        return Writers(checkpointer=saver)

    refused().close(dropped=True)
    with pytest.raises(RefusedToSave):
        refused().close()
    assert not list(tmp_path.glob("step-*"))


def test_a_heartbeat_says_where_the_training_thread_stands():
    import threading

    release = threading.Event()
    thread = threading.Thread(target=lambda: release.wait())
    thread.start()
    try:
        time.sleep(0.05)
        where = watchdog.training_thread_position(thread.ident)
    finally:
        release.set()
        thread.join()
    assert "test_faults.py:" in where and where.endswith(" <lambda>"), where  # not threading.py


class NcclLikeSum:
    """The loop's ``Comm.all_reduce_`` as it runs on NCCL: its own wait ends at once (the
    collective is only queued), and the rank blocks later, in the read of the result. Records,
    at each read, whether the rank was marked as waiting for its peers."""

    def __init__(self, dog: watchdog.Watchdog):
        self.dog, self.marked_at_reads = dog, []

    def __call__(self, tensor: torch.Tensor) -> NcclLikeSum.Result:
        with self.dog.waiting():
            pass
        return self.Result(tensor, self)

    class Result:
        def __init__(self, tensor: torch.Tensor, sums: NcclLikeSum):
            self.tensor, self.sums = tensor, sums

        def __getitem__(self, index) -> NcclLikeSum.Result:
            return type(self)(self.tensor[index], self.sums)

        def tolist(self) -> list:
            self.sums.marked_at_reads.append(self.sums.dog.waiting_for_peers)
            return self.tensor.tolist()


def test_the_reads_that_block_on_nccl_are_waits(tiny_digits):
    """The step's read of its one collective and the evaluation's read of its totals: a rank
    blocked there waits for its peers (else a stalled peer's verdict names this rank too)."""
    from elastic_mnist.config import TrainConfig
    from elastic_mnist.data.datasets import load
    from elastic_mnist.env import DistEnv
    from elastic_mnist.trainer import Trainer
    from elastic_mnist.writers import Writers

    cfg = TrainConfig()
    cfg.optim.global_batch_size, cfg.optim.micro_batch_size = 64, 32
    dog = watchdog.Watchdog(DistEnv(rank=0, world_size=2, launched=True), GoneStore(),
                            floor_s=10.0, report=lambda record: None)
    trainer = Trainer(cfg, DistEnv(), torch.device("cpu"), load(tiny_digits, "synthetic"),
                      run_id="waits", restart_generation=0, writers=Writers(watchdog=dog))
    sums = trainer.comm.all_reduce_ = NcclLikeSum(dog)
    try:
        trainer.train_step(trainer.global_batch(), stop_requested=False)
        trainer.report.evaluation()
    finally:
        dog.close()
    assert sums.marked_at_reads == [True, True]
    assert not dog.waiting_for_peers
