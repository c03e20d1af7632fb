import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from launch import clean_env, cli_cmd, run
from shared_runs import command_json

from elastic_mnist.checkpoint import (
    RUN_FILE,
    deserialize,
    list_manifests,
    newest_committed_step,
    newest_valid,
    write_checkpoint,
)
from elastic_mnist.checkpointer import Checkpointer
from elastic_mnist.errors import EXIT_DROPPED, CheckpointError
from elastic_mnist.model import build_model, state_digest
from elastic_mnist.resilience.current import GENERATION_FILE
from elastic_mnist.resilience.fence import Fence, FenceClosed, Over


def payload(step: int, seed: int = 0) -> dict:
    return {"format": 1, "model": build_model(seed).state_dict(), "optimizer": {},
            "progress": {"step": step, "epoch": 0, "cursor": step * 8, "samples_seen": step * 8},
            "rng": {"torch": torch.get_rng_state()}, "config": {}, "data": {},
            "world_size": 2, "run_id": "r"}


def save(directory, step, keep_last=10, seed=0):
    return write_checkpoint(directory, payload(step, seed), restart_generation=0,
                            keep_last=keep_last)


def test_commit_leaves_payload_manifest_and_pointer(tmp_path):
    manifest = save(tmp_path, 7)
    assert (tmp_path / "step-00000007.pt").stat().st_size == manifest.bytes
    on_disk = json.loads((tmp_path / "step-00000007.json").read_text())
    assert on_disk["sha256"] == manifest.sha256 and on_disk["world_size"] == 2
    assert {"step", "epoch", "samples_seen", "world_size", "run_id", "restart_generation",
            "sha256"} <= set(on_disk)
    assert (tmp_path / "latest").read_text().strip() == "step-00000007"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def beside_the_checkpoints(directory) -> None:
    """The files that share the folder with the checkpoints: none of them is one."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / GENERATION_FILE).write_text(json.dumps(
        {"launch": "l", "generation": 9, "kept": "0-1"}))
    (directory / RUN_FILE).write_text(json.dumps({"run_id": "r", "restart_generation": 9}))


def test_keeps_only_the_last_k(tmp_path):
    beside_the_checkpoints(tmp_path)
    for step in (1, 2, 3, 4, 5):
        save(tmp_path, step, keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == [
        "step-00000004.json", "step-00000004.pt", "step-00000005.json", "step-00000005.pt"]
    assert (tmp_path / GENERATION_FILE).exists() and (tmp_path / RUN_FILE).exists()
    assert [m.step for m in list_manifests(tmp_path)] == [5, 4]
    assert newest_valid(tmp_path)[0].step == 5 and newest_committed_step(tmp_path) == 5


def test_a_process_dropped_after_its_commit_prunes_nothing(tmp_path):
    """Pruning deletes checkpoints: it passes the fence too. A rank 0 dropped (frozen, the job
    went on without it) right after its commit leaves the new rank 0's checkpoints alone."""
    save(tmp_path, 1, keep_last=1)
    over: list[Over] = []

    def dropped_once_committed() -> Over | None:
        committed = (tmp_path / "latest").read_text() == "step-00000002\n"
        return Over("rank 0 was dropped", EXIT_DROPPED) if committed else None

    with pytest.raises(FenceClosed):
        write_checkpoint(tmp_path, payload(2), restart_generation=0, keep_last=1,
                         fence=Fence(dropped_once_committed, on_over=over.append))
    assert len(over) == 1
    assert sorted(p.name for p in tmp_path.glob("step-*")) == [
        "step-00000001.json", "step-00000001.pt", "step-00000002.json", "step-00000002.pt"]


@pytest.mark.parametrize("damage", ["flip", "truncate", "no_manifest", "garbage_manifest"])
def test_a_damaged_latest_falls_back_to_the_one_before(tmp_path, damage):
    save(tmp_path, 1)
    save(tmp_path, 2)
    latest = tmp_path / "step-00000002.pt"
    data = bytearray(latest.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
        latest.write_bytes(bytes(data))
    elif damage == "truncate":
        latest.write_bytes(bytes(data[: len(data) // 3]))
    elif damage == "no_manifest":  # a kill between the payload's rename and the manifest's
        (tmp_path / "step-00000002.json").unlink()
    else:
        (tmp_path / "step-00000002.json").write_text("{not json")
    manifest, _ = newest_valid(tmp_path)
    assert manifest.step == 1


def test_nothing_valid_is_none(tmp_path):
    assert newest_valid(tmp_path) is None


class Exploit:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path):
    evil = payload(3)
    evil["extra"] = Exploit()
    manifest = write_checkpoint(tmp_path, evil, restart_generation=0, keep_last=3)
    _, data = newest_valid(tmp_path)
    with pytest.raises(CheckpointError, match="could run code"):
        deserialize(data, manifest.file)
    assert not (tmp_path / "pwned").exists()


def test_background_writer_commits_and_reports_blocking_time(tmp_path):
    model = build_model(0)
    checkpointer = Checkpointer(tmp_path, every=2, keep_last=3, restart_generation=4)
    state = {"step": 0}

    def state_fn():
        return {**payload(state["step"]), "model": model.state_dict()}

    saved = []
    for step in range(1, 6):
        state["step"] = step
        saved.append(checkpointer.maybe_save(state_fn, step, final=step == 5))
    checkpointer.close()
    assert saved == [False, True, False, True, True]
    assert [m.step for m in list_manifests(tmp_path)] == [5, 4, 2]
    assert list_manifests(tmp_path)[0].restart_generation == 4
    assert checkpointer.last_blocking_ms >= 0
    _, data = newest_valid(tmp_path)
    assert state_digest(deserialize(data, "x")["model"]) == state_digest(model.state_dict())


def test_a_save_every_s_seconds_bounds_what_a_restart_redoes_whatever_the_step_time(tmp_path):
    """The default cadence is a clock: steps of 0.5 s, 3 s and 25 s are saved at the first step
    that ends 10 s after the last save began (or after the start): a restart redoes at most 10 s
    and one step."""
    model = build_model(0)
    now = [0.0]
    for step_s, steps, saved_steps in ((0.5, 60, [20, 40, 60]), (3.0, 20, [4, 8, 12, 16, 20]),
                                       (25.0, 10, list(range(1, 11)))):
        folder = tmp_path / str(step_s)
        checkpointer = Checkpointer(folder, every=0, every_seconds=10.0, keep_last=100,
                                    restart_generation=0, clock=lambda: now[0])
        saved = []
        for step in range(1, steps + 1):
            now[0] += step_s
            if checkpointer.maybe_save(
                    lambda step=step: {**payload(step), "model": model.state_dict()}, step):
                saved.append(step)
        checkpointer.close()
        assert saved == saved_steps, step_s
        assert sorted(m.step for m in list_manifests(folder)) == saved_steps
    # A rank 0 that takes over in process at step 7 (its predecessor's saves unknown to it)
    # saves at its first step, then by the clock.
    successor = Checkpointer(tmp_path / "taken", every=0, every_seconds=10.0, keep_last=100,
                             restart_generation=1, clock=lambda: now[0], taking_over_at=7)
    saved = []
    for step in range(8, 30):
        now[0] += 0.5
        if successor.maybe_save(lambda step=step: {**payload(step), "model": model.state_dict()},
                                step):
            saved.append(step)
    successor.close()
    assert saved == [8, 28]


def test_inspect_reports_every_checkpoint(tmp_path):
    beside_the_checkpoints(tmp_path)
    save(tmp_path, 1, seed=1)
    save(tmp_path, 2, seed=2)
    (tmp_path / "step-00000002.pt").write_bytes(b"junk")
    done = run(cli_cmd("inspect", "--checkpoint-dir", str(tmp_path), "--json"))
    assert done.returncode == 0, done.stdout
    report = json.loads(done.stdout)
    rows = {row["step"]: row for row in report["checkpoints"]}
    assert rows[2]["valid"] is False and "truncated" in rows[2]["reason"]
    assert rows[1]["valid"] is True
    assert rows[1]["model_digest"] == state_digest(build_model(1).state_dict())
    assert report["latest"] == "step-00000002"
    assert sorted(rows) == [1, 2]


def test_inspect_names_each_checkpoint_by_an_absolute_path(tmp_path, monkeypatch):
    save(tmp_path / "ckpt", 3)
    monkeypatch.chdir(tmp_path)
    row = command_json("inspect", "--checkpoint-dir", "ckpt")["checkpoints"][0]
    assert row["file"] == "step-00000003.pt" and row["valid"]
    assert Path(row["path"]).is_absolute() and Path(row["path"]) == tmp_path / "ckpt" / row["file"]


def test_a_reader_that_goes_away_is_a_normal_end(tmp_path):
    for step in range(1, 4):
        save(tmp_path, step)
    proc = subprocess.Popen(cli_cmd("inspect", "--checkpoint-dir", str(tmp_path), "--json"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=clean_env())
    proc.stdout.close()  # as `| head` does once it has its lines
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and not err, err


def test_a_resume_with_other_batch_flags_names_the_flags_that_continue_the_run(tmp_path):
    """A folder written under other batch flags (the defaults of an earlier version, say) is
    refused in one line that gives the flags to pass: the batch's, and the learning rate's and
    warm-up's where they differ too, so that the run goes on with its own optimisation."""
    from elastic_mnist.config import TrainConfig
    from elastic_mnist.errors import CheckpointError
    from elastic_mnist.state import check_compatible

    written = TrainConfig()
    written.optim.global_batch_size, written.optim.micro_batch_size = 128, 32
    written.optim.lr, written.optim.warmup_steps = 2e-3, 50
    model = build_model(0)
    payload = {"model": model.state_dict(), "config": written.to_dict()}
    with pytest.raises(CheckpointError) as refused:
        check_compatible(payload, model, TrainConfig(), None, "ckpt/step-00000120.pt")
    assert str(refused.value) == (
        "ckpt/step-00000120.pt was written with --global-batch-size 128 --micro-batch-size 32, "
        "this run has --global-batch-size 768 --micro-batch-size 8: pass --global-batch-size 128 "
        "--micro-batch-size 32 --lr 0.002 --warmup-steps 50 to continue that run, or use "
        "another --checkpoint-dir")
