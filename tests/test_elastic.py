"""Resume that loses nothing: SIGKILLs, resizes, world-size invariance, preemption, bad files."""

from __future__ import annotations

import json
import random
import shutil
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from launch import REPO, cli_cmd, kill_tree, run, start, torchrun_cmd

from elastic_mnist.checkpoint import newest_committed_step

pytestmark = pytest.mark.slow

FLAGS = ["--dataset", "synthetic", "--global-batch-size", "64", "--micro-batch-size", "16",
         "--log-every", "5", "--epochs", "4", "--checkpoint-every", "3", "--run-id", "elastic"]


def args_for(data: Path, work: Path, *extra: str) -> list[str]:
    return ["train", *FLAGS, "--data-dir", str(data), "--checkpoint-dir", str(work / "ckpt"),
            "--logdir", str(work / "runs"), *extra]


def newest(checkpoint_dir: Path) -> dict:
    done = run(cli_cmd("inspect", "--checkpoint-dir", str(checkpoint_dir), "--json"))
    assert done.returncode == 0, done.stdout
    return json.loads(done.stdout)["checkpoints"][0]


def evaluate(checkpoint_dir: Path) -> dict:
    done = run(cli_cmd("evaluate", "--checkpoint-dir", str(checkpoint_dir), "--json"))
    assert done.returncode == 0, done.stdout
    return json.loads(done.stdout.strip().splitlines()[-1])


def wait_until(predicate, proc, timeout=120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the job ended (exit {proc.returncode}) before the fault")
        if time.monotonic() > deadline:
            kill_tree(proc.pid)
            raise AssertionError("timed out waiting for the job")
        time.sleep(0.02)


def workers(proc) -> list[psutil.Process]:
    return [p for p in psutil.Process(proc.pid).children(recursive=True)
            if "elastic_mnist" in " ".join(p.cmdline())]


@pytest.fixture(scope="module")
def reference(tiny_digits, tmp_path_factory) -> Path:
    """The uninterrupted run at world size 2."""
    work = tmp_path_factory.mktemp("reference")
    done = run(torchrun_cmd(2, *args_for(tiny_digits, work)))
    assert done.returncode == 0, done.stdout
    return work


def test_random_sigkills_resume_bitwise_identical(tiny_digits, reference, tmp_path):
    rng = random.Random(0)
    log = tmp_path / "chaos.log"
    proc = start(torchrun_cmd(2, *args_for(tiny_digits, tmp_path), max_restarts=3), log=log)
    for at_step in (4, 22):
        wait_until(lambda s=at_step: newest_committed_step(tmp_path / "ckpt") >= s, proc)
        victim = rng.choice(workers(proc))
        victim.send_signal(signal.SIGKILL)
        time.sleep(rng.uniform(0.0, 0.3))
    assert proc.wait(timeout=240) == 0, log.read_text()
    text = log.read_text()
    assert text.count("resumed from") >= 2, text
    ours, theirs = newest(tmp_path / "ckpt"), newest(reference / "ckpt")
    assert ours["step"] == theirs["step"] == 40
    assert ours["model_digest"] == theirs["model_digest"]


def test_resize_2_1_2_uses_every_sample_once(tiny_digits, reference, tmp_path):
    log = tmp_path / "launch.log"
    for nproc, stop_after in ((2, 8), (1, 20), (2, None)):
        proc = start(torchrun_cmd(nproc, *args_for(tiny_digits, tmp_path, "--audit-samples")),
                     log=log)
        if stop_after is None:
            assert proc.wait(timeout=240) == 0, log.read_text()
            break
        wait_until(lambda s=stop_after: newest_committed_step(tmp_path / "ckpt") >= s, proc)
        proc.send_signal(signal.SIGTERM)  # preemption: agreed stop, checkpoint, exit
        proc.wait(timeout=30)
    audit = run([sys.executable, str(REPO / "scripts" / "check_audit.py"),
                 str(tmp_path / "runs" / "elastic"), "--num-samples", "640"])
    assert audit.returncode == 0, audit.stdout
    worlds = {json.loads(line)["world_size"]
              for path in (tmp_path / "runs" / "elastic" / "audit").glob("*.jsonl")
              for line in path.read_text().splitlines()}
    assert worlds == {1, 2}
    ours, theirs = evaluate(tmp_path / "ckpt"), evaluate(reference / "ckpt")
    assert ours["step"] == 40
    assert abs(ours["accuracy"] - theirs["accuracy"]) <= 0.02
    assert ours["loss"] == pytest.approx(theirs["loss"], rel=0.05)


def test_sigterm_stops_at_an_agreed_step_and_loses_nothing(tiny_digits, tmp_path):
    log = tmp_path / "run.log"
    proc = start(torchrun_cmd(2, *args_for(tiny_digits, tmp_path, "--epochs", "100")), log=log)
    wait_until(lambda: newest_committed_step(tmp_path / "ckpt") >= 3, proc)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert time.monotonic() - sent < 10
    text = log.read_text()
    stops = [int(line.split("stopped at step ")[1].split()[0])
             for line in text.splitlines() if "stopped at step" in line]
    assert len(stops) == 2 and len(set(stops)) == 1, text  # both ranks, the same step
    assert newest_committed_step(tmp_path / "ckpt") == stops[0]
    assert not [line for line in text.splitlines() if line.startswith("[rank")], text  # no trace
    again = run(torchrun_cmd(2, *args_for(tiny_digits, tmp_path, "--epochs", "100",
                                          "--max-steps", str(stops[0] + 2))))
    assert again.returncode == 0, again.stdout
    assert f"step {stops[0]}, epoch" in again.stdout  # resumed exactly there


@pytest.fixture(scope="module")
def invariance_digits(tmp_path_factory) -> Path:
    from elastic_mnist.data.datasets import write_synthetic

    root = tmp_path_factory.mktemp("invariance-digits")
    write_synthetic(root, train=640, test=2000, seed=5)
    return root


def test_training_does_not_depend_on_the_world_size(invariance_digits, tmp_path):
    """One step agrees to rounding at world sizes 1, 2 and 4 (parameters and BatchNorm running
    statistics); 150 steps agree in accuracy and loss at world sizes 1 and 2."""
    one_step, long_run = {}, {}
    for world in (1, 2, 4):
        work = tmp_path / f"w{world}"
        done = run(torchrun_cmd(world, *args_for(invariance_digits, work / "one",
                                                 "--max-steps", "1")))
        assert done.returncode == 0, done.stdout
        one_step[world] = torch.load(work / "one" / "ckpt" / "step-00000001.pt",
                                     weights_only=True)["model"]
        if world == 4:  # four processes on two cores: its one step suffices
            continue
        done = run(torchrun_cmd(world, *args_for(invariance_digits, work / "long",
                                                 "--max-steps", "150", "--epochs", "100")),
                   timeout=400)
        assert done.returncode == 0, done.stdout
        long_run[world] = evaluate(work / "long" / "ckpt")
    for world in (2, 4):
        for key, value in one_step[1].items():
            torch.testing.assert_close(one_step[world][key].float(), value.float(),
                                       rtol=0, atol=1e-6, msg=f"{key} at world size {world}")
    assert abs(long_run[2]["accuracy"] - long_run[1]["accuracy"]) <= 0.005
    assert long_run[2]["loss"] == pytest.approx(long_run[1]["loss"], rel=0.02)


def test_corrupt_latest_checkpoint_falls_back_to_the_previous(tiny_digits, tmp_path):
    first = run(cli_cmd(*args_for(tiny_digits, tmp_path, "--max-steps", "6")))
    assert first.returncode == 0, first.stdout
    latest = tmp_path / "ckpt" / "step-00000006.pt"
    latest.write_bytes(latest.read_bytes()[:1000])
    second = run(cli_cmd(*args_for(tiny_digits, tmp_path, "--max-steps", "8")))
    assert second.returncode == 0, second.stdout
    assert "skipping checkpoint" in second.stdout
    assert "step-00000003.pt: step 3" in second.stdout


@pytest.fixture(scope="module")
def three_steps(tiny_digits, tmp_path_factory) -> Path:
    """A run of 3 steps, for the tests below to copy and tamper with."""
    work = tmp_path_factory.mktemp("three-steps")
    done = run(cli_cmd(*args_for(tiny_digits, work, "--max-steps", "3")))
    assert done.returncode == 0, done.stdout
    return work


def test_a_checkpoint_that_would_run_code_stops_the_job(tiny_digits, three_steps, tmp_path):
    from elastic_mnist.checkpoint import write_checkpoint

    shutil.copytree(three_steps, tmp_path, dirs_exist_ok=True)
    payload = torch.load(tmp_path / "ckpt" / "step-00000003.pt", weights_only=True)
    payload["progress"]["step"] = 4
    payload["hook"] = _Exploit()
    write_checkpoint(tmp_path / "ckpt", payload, restart_generation=9, keep_last=5)
    done = run(cli_cmd(*args_for(tiny_digits, tmp_path, "--max-steps", "6")), cwd=tmp_path)
    assert done.returncode == 2
    assert "could run code" in done.stdout.strip().splitlines()[-1]
    assert not (tmp_path / "pwned").exists()


def test_a_checkpoint_of_another_config_names_the_mismatch(tiny_digits, three_steps, tmp_path):
    shutil.copytree(three_steps, tmp_path, dirs_exist_ok=True)
    done = run(cli_cmd(*args_for(tiny_digits, tmp_path, "--max-steps", "6", "--seed", "9")))
    assert done.returncode == 2
    assert "--seed=0" in done.stdout.strip().splitlines()[-1]


def test_a_resume_onto_other_digits_is_refused(three_steps, tmp_path):
    from elastic_mnist.data.datasets import write_synthetic

    shutil.copytree(three_steps, tmp_path, dirs_exist_ok=True)
    other = tmp_path / "other-digits"
    write_synthetic(other, train=640, test=256, seed=4)  # the same kind and count, other bytes
    done = run(cli_cmd(*args_for(other, tmp_path, "--max-steps", "6")))
    assert done.returncode == 2
    line = done.stdout.strip().splitlines()[-1]
    assert "trained on other digits (fingerprint" in line and str(other) in line, line
    assert newest(tmp_path / "ckpt")["step"] == 3


def test_ranks_that_see_other_digits_stop_before_the_first_step(tiny_digits, tmp_path):
    """Node-local data folders that differ: each worker picks its folder by LOCAL_RANK."""
    from elastic_mnist.data.datasets import write_synthetic

    write_synthetic(tmp_path / "d1", train=640, test=256, seed=4)
    shutil.copytree(tiny_digits, tmp_path / "d0")
    worker = " ".join([sys.executable, "-m", "elastic_mnist",
                       *args_for(tmp_path / "d$LOCAL_RANK", tmp_path)])
    cmd = torchrun_cmd(2)[:-2] + ["--no-python", "sh", "-c", f"exec {worker}"]
    done = run(cmd)
    assert done.returncode != 0
    refusals = [line for line in done.stdout.splitlines()
                if line.startswith("elastic-mnist train: error: the ranks would train on different")]
    assert len(refusals) == 2, done.stdout  # one line from each rank, no traceback
    assert "DataError" not in done.stdout, done.stdout  # the workers print no traceback
    assert all("rank 0 on" in line and "rank 1 on" in line and "d0" in line and "d1" in line
               for line in refusals), refusals
    assert not (tmp_path / "ckpt").exists() or newest_committed_step(tmp_path / "ckpt") == 0


class _Exploit:
    def __reduce__(self):
        import os

        return (os.system, ("touch pwned",))
