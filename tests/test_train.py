"""The job end to end: torchrun on CPU with gloo, asserting on what the runs leave behind."""

from __future__ import annotations

import re
import shutil
import signal
from pathlib import Path

import pytest
import torch
from launch import REPO, clean_env, cli_cmd, run, torchrun_cmd
from shared_runs import STEPS, args_for, evaluate, inspect

pytestmark = pytest.mark.slow

EXPECTED_TAGS = {"train/loss", "train/accuracy", "test/loss", "test/accuracy", "opt/lr",
                 "perf/samples_per_s", "ckpt/save_ms"}


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_two_workers_train_checkpoint_log_and_resume(tiny_digits, reference_run, tmp_path):
    report = inspect(reference_run / "ckpt")
    steps = [c["step"] for c in report["checkpoints"]]
    assert steps == list(range(STEPS, 0, -1)) and all(c["valid"] and c["world_size"] == 2
                                                      for c in report["checkpoints"])
    logged = scalars(reference_run / "runs" / "reference")
    assert EXPECTED_TAGS <= set(logged)
    assert [s for s, _ in logged["test/accuracy"]] == [10, 20, 30, 40]
    assert [s for s, _ in logged["train/loss"]] == list(range(2, STEPS + 1, 2))
    result = evaluate(reference_run / "ckpt")
    assert result["step"] == STEPS and result["accuracy"] > 0.5  # chance is 0.1
    assert result["accuracy"] == pytest.approx(logged["test/accuracy"][-1][1])
    *_, finished, where = (reference_run / "runs" / "reference" / "train.log").read_text() \
        .rstrip().splitlines()  # flushed before the exit
    assert finished.endswith(f"finished at step {STEPS}")
    assert "each step: 4 micro-batches of 16 (--global-batch-size 64), 2 per rank at world " \
           "size 2" in (reference_run / "run.log").read_text()
    assert where.endswith(f"checkpoints in {reference_run / 'ckpt'}/ (newest: "
                          f"step-{STEPS:08d}.pt); TensorBoard events, events.jsonl and train.log "
                          f"in {reference_run / 'runs' / 'reference'}/; look at them with: "
                          f"tensorboard --logdir {reference_run / 'runs'}")

    shutil.copytree(reference_run, tmp_path, dirs_exist_ok=True)
    more = run(torchrun_cmd(2, *args_for(tiny_digits, tmp_path, "--epochs", "5",
                                         "--run-id", "reference", "--keep-last", "3")))
    assert more.returncode == 0, more.stdout
    assert f"step-{STEPS:08d}.pt: step {STEPS}, 0 of 640 samples into epoch 5/5" in more.stdout
    assert [c["step"] for c in inspect(tmp_path / "ckpt")["checkpoints"]] == [50, 40, 39]
    logged = scalars(tmp_path / "runs" / "reference")
    assert [s for s, _ in logged["test/accuracy"]] == [10, 20, 30, 40, 50]


def test_hand_written_allreduce_matches_ddp(tiny_digits, reference_run, tmp_path):
    done = run(torchrun_cmd(2, *args_for(tiny_digits, tmp_path, "--max-steps", "4",
                                         "--grad-sync", "allreduce")))
    assert done.returncode == 0, done.stdout
    ddp, allreduce = (torch.load(work / "ckpt" / "step-00000004.pt", weights_only=True)["model"]
                      for work in (reference_run, tmp_path))  # in warm-up: the same learning rates
    for key, value in ddp.items():
        torch.testing.assert_close(allreduce[key], value, rtol=0, atol=1e-6)


def test_make_train_line_runs_via_jobs_local(tiny_digits, tmp_path):
    """jobs/local.sh is what `make train` runs."""
    env = clean_env(NPROC_PER_NODE="2", PATH=f"{Path(__import__('sys').executable).parent}:"
                    f"{clean_env()['PATH']}")
    args = args_for(tiny_digits, tmp_path, "--max-steps", "3")[1:]  # local.sh adds `train`
    done = run([str(REPO / "jobs" / "local.sh"), *args], env=env)
    assert done.returncode == 0, done.stdout
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in done.stdout  # set: nothing to warn about
    (said,) = [text for text in done.stdout.splitlines() if "recovered by a restart" in text]
    assert "INFO faults are recovered by a restart: one node" in said  # --standalone
    assert inspect(tmp_path / "ckpt")["checkpoints"][0]["step"] == 3


def test_ctrl_c_on_make_train_ends_with_one_line_and_a_checkpoint(interrupted_make_train):
    """SIGINT to make's process group, as a terminal sends it: within 10 s the job has stopped at
    one step with its checkpoint, and the last line says where, that it is saved and what resumes
    it; no traceback, no error line of make's; make itself ends by the SIGINT it got."""
    run_ = interrupted_make_train
    ckpt = run_.work / "ckpt"
    print(f"make train: SIGINT -> make ended {run_.seconds_to_exit:.1f} s")
    assert run_.status == -signal.SIGINT, run_.log
    assert run_.seconds_to_exit < 10, run_.seconds_to_exit
    assert "Traceback" not in run_.log and "make: ***" not in run_.log, run_.log
    stops = [line for line in run_.log.splitlines() if "stopped at step" in line]
    assert len(stops) == 1 and run_.log.rstrip().endswith(stops[0]), run_.log  # one, the last
    found = re.search(r"\[rank 0\] WARNING stopped at step (\d+) after Ctrl-C; checkpoint saved: "
                      r"(\S+); resume with: make train (.*)$", stops[0])
    assert found, stops[0]
    step = int(found.group(1))
    assert found.group(2) == str(ckpt / f"step-{step:08d}.pt")
    assert f"CHECKPOINT_DIR={ckpt}" in found.group(3) and "TRAIN_ARGS=" in found.group(3)
    newest_checkpoint = inspect(ckpt)["checkpoints"][0]
    assert newest_checkpoint["step"] == step >= 2 and newest_checkpoint["valid"]
    assert not (ckpt / "lease.json").exists()  # the folder is free for the resume


def test_synthetic_fallback_is_loud_and_recorded(tiny_digits, tmp_path):

    shutil.copytree(tiny_digits, tmp_path / "data" / "synthetic")  # skips generating 60,000
    done = run(cli_cmd("train", "--device", "cpu", "--data-dir", str(tmp_path / "data"),
                       "--no-download", "--synthetic-fallback", "--max-steps", "1",
                       "--checkpoint-dir", str(tmp_path / "ckpt"), "--logdir",
                       str(tmp_path / "runs"), "--run-id", "fb"))
    assert done.returncode == 0, done.stdout
    assert done.stdout.count("SYNTHETIC DIGITS, NOT MNIST") == 1, done.stdout  # said once
    assert "SYNTHETIC DIGITS, NOT MNIST" in (tmp_path / "runs" / "fb" / "train.log").read_text()
    assert ("synthetic digits stand in for MNIST, which cannot be had: MNIST not found in "
            f"{tmp_path / 'data' / 'MNIST' / 'raw'} and downloading is off") in done.stdout


def test_missing_mnist_without_download_says_what_to_put_where(tmp_path):
    done = run(cli_cmd("train", "--device", "cpu", "--data-dir", str(tmp_path), "--no-download"),
               cwd=tmp_path)
    assert done.returncode == 2
    line = done.stdout.strip().splitlines()[-1]
    assert "train-images-idx3-ubyte" in line and str(tmp_path / "MNIST" / "raw") in line


def test_corrupt_data_file_is_named(tiny_digits, tmp_path):

    shutil.copytree(tiny_digits, tmp_path / "d")
    labels = tmp_path / "d" / "MNIST" / "raw" / "t10k-labels-idx1-ubyte"
    labels.write_bytes(labels.read_bytes()[:-10])
    done = run(cli_cmd("train", "--device", "cpu", "--dataset", "synthetic", "--data-dir",
                       str(tmp_path / "d")),
               cwd=tmp_path)
    assert done.returncode == 2
    assert "t10k-labels-idx1-ubyte is truncated" in done.stdout.strip().splitlines()[-1]
