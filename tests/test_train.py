"""The job end to end: torchrun on CPU with gloo, asserting on what the runs leave behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from launch import REPO, clean_env, cli_cmd, run, torchrun_cmd

pytestmark = pytest.mark.slow

TINY = ["--dataset", "synthetic", "--global-batch-size", "64", "--micro-batch-size", "16",
        "--log-every", "5"]
EXPECTED_TAGS = {"train/loss", "train/accuracy", "test/loss", "test/accuracy", "opt/lr",
                 "perf/samples_per_s", "ckpt/save_ms"}


def train_args(data: Path, work: Path, *extra: str) -> list[str]:
    return ["train", *TINY, "--data-dir", str(data), "--checkpoint-dir", str(work / "ckpt"),
            "--logdir", str(work / "runs"), "--run-id", "test", *extra]


def inspect(checkpoint_dir: Path) -> dict:
    done = run(cli_cmd("inspect", "--checkpoint-dir", str(checkpoint_dir), "--json"))
    assert done.returncode == 0, done.stdout
    return json.loads(done.stdout)


def evaluate(checkpoint_dir: Path) -> dict:
    done = run(cli_cmd("evaluate", "--checkpoint-dir", str(checkpoint_dir), "--json"))
    assert done.returncode == 0, done.stdout
    return json.loads(done.stdout.strip().splitlines()[-1])


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_two_workers_train_checkpoint_log_and_resume(tiny_digits, tmp_path):
    first = run(torchrun_cmd(2, *train_args(tiny_digits, tmp_path, "--epochs", "2")))
    assert first.returncode == 0, first.stdout
    report = inspect(tmp_path / "ckpt")
    steps = [c["step"] for c in report["checkpoints"]]
    assert steps == [20, 10] and all(c["valid"] and c["world_size"] == 2
                                     for c in report["checkpoints"])

    logged = scalars(tmp_path / "runs" / "test")
    assert EXPECTED_TAGS <= set(logged)
    assert [s for s, _ in logged["test/accuracy"]] == [10, 20]
    assert [s for s, _ in logged["train/loss"]] == [5, 10, 15, 20]
    result = evaluate(tmp_path / "ckpt")
    assert result["step"] == 20 and result["accuracy"] > 0.5  # chance is 0.1
    assert result["accuracy"] == pytest.approx(logged["test/accuracy"][-1][1])
    train_log = (tmp_path / "runs" / "test" / "train.log").read_text()
    assert train_log.rstrip().endswith("finished at step 20")  # flushed before the hard exit

    second = run(torchrun_cmd(2, *train_args(tiny_digits, tmp_path, "--epochs", "3")))
    assert second.returncode == 0, second.stdout
    assert "resumed from" in second.stdout and "step 20, epoch 2" in second.stdout
    assert inspect(tmp_path / "ckpt")["checkpoints"][0]["step"] == 30
    logged = scalars(tmp_path / "runs" / "test")
    assert [s for s, _ in logged["test/accuracy"]] == [10, 20, 30]


def test_one_worker_trains_well_above_chance(tiny_digits, tmp_path):
    done = run(torchrun_cmd(1, *train_args(tiny_digits, tmp_path, "--epochs", "3")))
    assert done.returncode == 0, done.stdout
    assert evaluate(tmp_path / "ckpt")["accuracy"] > 0.5


def test_hand_written_allreduce_matches_ddp(tiny_digits, tmp_path):
    params = {}
    for mode in ("ddp", "allreduce"):
        work = tmp_path / mode
        done = run(torchrun_cmd(2, *train_args(tiny_digits, work, "--max-steps", "4",
                                               "--grad-sync", mode)))
        assert done.returncode == 0, done.stdout
        checkpoint = work / "ckpt" / "step-00000004.pt"
        params[mode] = torch.load(checkpoint, weights_only=True)["model"]
    for key, value in params["ddp"].items():
        torch.testing.assert_close(params["allreduce"][key], value, rtol=0, atol=1e-6)


def test_make_train_line_runs_via_jobs_local(tiny_digits, tmp_path):
    """jobs/local.sh is what `make train` runs."""
    env = clean_env(NPROC_PER_NODE="2", PATH=f"{Path(__import__('sys').executable).parent}:"
                    f"{clean_env()['PATH']}")
    args = train_args(tiny_digits, tmp_path, "--max-steps", "3")[1:]  # local.sh adds `train`
    done = run([str(REPO / "jobs" / "local.sh"), *args], env=env)
    assert done.returncode == 0, done.stdout
    assert inspect(tmp_path / "ckpt")["checkpoints"][0]["step"] == 3


def test_synthetic_fallback_is_loud_and_recorded(tiny_digits, tmp_path):
    import shutil

    shutil.copytree(tiny_digits, tmp_path / "data" / "synthetic")  # skips generating 60,000
    done = run(cli_cmd("train", "--data-dir", str(tmp_path / "data"), "--no-download",
                       "--synthetic-fallback", "--max-steps", "1", "--checkpoint-dir",
                       str(tmp_path / "ckpt"), "--logdir", str(tmp_path / "runs"),
                       "--run-id", "fb"))
    assert done.returncode == 0, done.stdout
    assert "SYNTHETIC DIGITS, NOT MNIST" in done.stdout
    assert "SYNTHETIC DIGITS, NOT MNIST" in (tmp_path / "runs" / "fb" / "train.log").read_text()


def test_missing_mnist_without_download_says_what_to_put_where(tmp_path):
    done = run(cli_cmd("train", "--data-dir", str(tmp_path), "--no-download"), cwd=tmp_path)
    assert done.returncode == 2
    line = done.stdout.strip().splitlines()[-1]
    assert "train-images-idx3-ubyte" in line and str(tmp_path / "MNIST" / "raw") in line


def test_corrupt_data_file_is_named(tiny_digits, tmp_path):
    import shutil

    shutil.copytree(tiny_digits, tmp_path / "d")
    labels = tmp_path / "d" / "MNIST" / "raw" / "t10k-labels-idx1-ubyte"
    labels.write_bytes(labels.read_bytes()[:-10])
    done = run(cli_cmd("train", "--dataset", "synthetic", "--data-dir", str(tmp_path / "d")),
               cwd=tmp_path)
    assert done.returncode == 2
    assert "t10k-labels-idx1-ubyte is truncated" in done.stdout.strip().splitlines()[-1]
