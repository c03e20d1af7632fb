"""Resume that loses nothing: SIGKILLs, resizes, world-size invariance, preemption, bad files."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from launch import REPO, cli_cmd, run, torchrun_cmd
from shared_runs import STEPS, args_for, evaluate, newest, once_per_suite

from elastic_mnist.checkpoint import newest_committed_step
from elastic_mnist.data.datasets import load
from elastic_mnist.events import read_events
from elastic_mnist.model import build_model

pytestmark = pytest.mark.slow


def test_random_sigkills_resume_bitwise_identical(killed_run, reference_run):
    """Plain torchrun, whose agent shares its store with the workers: restarts work (they failed
    in 4 of 6 tries before the workers built their group on a store of their own)."""
    text = (killed_run / "run.log").read_text()
    assert text.count("resumed from") >= 2, text
    assert text.count("set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1") == 1, text  # said once
    ours, theirs = newest(killed_run / "ckpt"), newest(reference_run / "ckpt")
    assert ours["step"] == theirs["step"] == STEPS
    assert ours["model_digest"] == theirs["model_digest"]


def test_resize_2_1_2_uses_every_sample_once(resized_run, reference_run):
    audit = run([sys.executable, str(REPO / "scripts" / "check_audit.py"),
                 str(resized_run.run_dir), "--num-samples", "640"])
    assert audit.returncode == 0, audit.stdout
    worlds = {json.loads(line)["world_size"]
              for path in (resized_run.run_dir / "audit").glob("*.jsonl")
              for line in path.read_text().splitlines()}
    assert worlds == {1, 2}
    ours, theirs = evaluate(resized_run.work / "ckpt"), evaluate(reference_run / "ckpt")
    assert ours["step"] == STEPS
    assert abs(ours["accuracy"] - theirs["accuracy"]) <= 0.02
    assert ours["loss"] == pytest.approx(theirs["loss"], rel=0.05)


def test_sigterm_stops_at_an_agreed_step_and_loses_nothing(resized_run):
    logs = [p.log for p in resized_run.preemptions] + [resized_run.last_log]
    for preemption, next_log in zip(resized_run.preemptions, logs[1:]):
        assert preemption.seconds_to_exit < 10
        stops = [int(line.split("stopped at step ")[1].split()[0])
                 for line in preemption.log.splitlines() if "stopped at step" in line]
        assert len(stops) == preemption.world_size and len(set(stops)) == 1, preemption.log
        assert not [line for line in preemption.log.splitlines() if line.startswith("[rank")]
        assert preemption.newest_checkpoint == stops[0]  # saved at the agreed step
        assert re.search(rf"resumed from \S+: step {stops[0]}, ", next_log)  # exactly there


@pytest.fixture(scope="module")
def invariance_digits(tmp_path_factory) -> Path:
    """A larger test split (2,000), to compare accuracies finely."""
    from elastic_mnist.data.datasets import write_synthetic

    root = tmp_path_factory.mktemp("invariance-digits")
    write_synthetic(root, train=64, test=2000, seed=5)
    return root


def test_training_does_not_depend_on_the_world_size(tiny_digits, reference_run,
                                                    invariance_digits, tmp_path):
    """One step agrees to rounding at world sizes 1, 2 and 4 (parameters and BatchNorm running
    statistics); the whole run agrees in accuracy and loss at world sizes 1 and 2."""
    alone = tmp_path / "w1"
    done = run(torchrun_cmd(1, *args_for(tiny_digits, alone, "--checkpoint-every", "1",
                                         "--keep-last", "100")))
    assert done.returncode == 0, done.stdout
    four = tmp_path / "w4"  # four processes on two cores: one step suffices
    done = run(torchrun_cmd(4, *args_for(tiny_digits, four, "--max-steps", "1")))
    assert done.returncode == 0, done.stdout

    def first_step(work: Path) -> tuple[dict, dict]:
        """The model after step 1, and the gradient of each parameter of it (AdamW's first
        moment after one step is 0.1 times the gradient)."""
        payload = torch.load(work / "ckpt" / "step-00000001.pt", weights_only=True)
        names = [name for name, _ in build_model(0).named_parameters()]
        state = payload["optimizer"]["state"]
        return payload["model"], {names[i]: state[i]["exp_avg"] / 0.1 for i in state}

    one, one_grads = first_step(alone)
    for world, work in ((2, reference_run), (4, four)):
        model, grads = first_step(work)
        for key, grad in grads.items():  # the step's gradients, summed in another order
            torch.testing.assert_close(grad, one_grads[key], rtol=0, atol=1e-7,
                                       msg=f"{key}'s gradient at world size {world}")
        for key, value in model.items():
            # AdamW divides a gradient by its own size plus eps (1e-8): where a gradient is
            # about as small as eps, its rounding moves the update by up to the learning rate;
            # everywhere else the parameters agree to rounding, as the statistics do.
            kept = grads[key].abs() > 1e-6 if key in grads else torch.ones_like(value, dtype=bool)
            torch.testing.assert_close(value[kept].float(), one[key][kept].float(), rtol=0,
                                       atol=1e-6, msg=f"{key} at world size {world}")
    test_digits = load(invariance_digits, "synthetic").test
    (loss1, accuracy1), (loss2, accuracy2) = (
        evaluate_in_process(work / "ckpt" / f"step-{STEPS:08d}.pt", test_digits)
        for work in (alone, reference_run))
    assert accuracy1 > 0.5  # chance is 0.1
    assert abs(accuracy2 - accuracy1) <= 0.005
    assert loss2 == pytest.approx(loss1, rel=0.02)


def evaluate_in_process(checkpoint: Path, digits) -> tuple[float, float]:
    from elastic_mnist.env import DistEnv
    from elastic_mnist.model import build_model
    from elastic_mnist.report import evaluate as evaluate_model

    model = build_model(0)
    model.load_state_dict(torch.load(checkpoint, weights_only=True)["model"])
    return evaluate_model(model, digits, torch.device("cpu"), DistEnv())


def test_corrupt_latest_checkpoint_falls_back_to_the_previous(tiny_digits, tmp_path):
    first = run(cli_cmd(*args_for(tiny_digits, tmp_path, "--max-steps", "6",
                                  "--checkpoint-every", "3")))
    assert first.returncode == 0, first.stdout
    latest = tmp_path / "ckpt" / "step-00000006.pt"
    latest.write_bytes(latest.read_bytes()[:1000])
    second = run(cli_cmd(*args_for(tiny_digits, tmp_path, "--max-steps", "8",
                                   "--checkpoint-every", "3")))
    assert second.returncode == 0, second.stdout
    assert "skipping checkpoint" in second.stdout
    assert "step-00000003.pt: step 3" in second.stdout


@pytest.fixture(scope="module")
@once_per_suite
def three_steps(tiny_digits, tmp_path_factory) -> Path:
    """A run of 3 steps, for the tests below to copy and tamper with."""
    work = tmp_path_factory.mktemp("three-steps")
    done = run(cli_cmd(*args_for(tiny_digits, work, "--max-steps", "3")))
    assert done.returncode == 0, done.stdout
    return work


def epoch_scalars(run_dir: Path) -> list[tuple[int, int]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return [(e.step, int(e.value)) for e in acc.Scalars("train/epoch")]


def test_epochs_are_counted_from_1_in_logs_events_and_tensorboard(three_steps, reference_run):
    """An epoch is counted one way wherever progress is said: the epoch of a step, from 1. The
    3-step run ends inside its only epoch (10 steps); the reference run ends 4 whole epochs."""
    (short,) = (three_steps / "runs").iterdir()
    log = (short / "train.log").read_text()
    assert "epoch 1/1 step 2/3 " in log and "epoch 1/1 step 3/3 " in log, log
    assert "epoch 1/1 ends after 3 of its 10 steps at step 3: test loss" in log, log
    assert "epoch 0" not in log, log
    evals = [e for e in read_events(short / "events.jsonl") if e["event"] == "eval"]
    assert [(e["step"], e["epoch"], e["epoch_done"]) for e in evals] == [(3, 1, False)]
    assert epoch_scalars(short) == [(2, 1), (3, 1)]

    full = reference_run / "runs" / "reference"
    log = (full / "train.log").read_text()
    for epoch in range(1, 5):
        assert f"epoch {epoch}/4 step {10 * epoch}/40 " in log, log
        assert f"epoch {epoch}/4 done at step {10 * epoch}: test loss" in log, log
    evals = [e for e in read_events(full / "events.jsonl") if e["event"] == "eval"]
    assert [(e["step"], e["epoch"], e["epoch_done"]) for e in evals] == \
        [(10, 1, True), (20, 2, True), (30, 3, True), (40, 4, True)]
    assert epoch_scalars(full) == [(step, (step + 9) // 10) for step in range(2, 41, 2)]


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
    """Refused before any run file is opened: the run folder keeps its files as they were (no
    new TensorBoard file, nothing more in events.jsonl); train.log alone says why."""
    shutil.copytree(three_steps, tmp_path, dirs_exist_ok=True)
    before = run_files(tmp_path / "runs")
    done = run(cli_cmd(*args_for(tiny_digits, tmp_path, "--max-steps", "6", "--seed", "9")))
    assert done.returncode == 2
    assert "was written with --seed 0, this run has --seed 9: pass --seed 0 to continue" in \
        done.stdout.strip().splitlines()[-1]
    assert run_files(tmp_path / "runs") == before


def run_files(runs: Path) -> dict[str, bytes]:
    """The run folders' files and what they hold, train.log aside."""
    return {str(f.relative_to(runs)): f.read_bytes() for f in sorted(runs.rglob("*"))
            if f.is_file() and f.name != "train.log"}


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
                if line.startswith("elastic-mnist train: error: the ranks would train on")]
    assert len(refusals) == 2, done.stdout  # one line from each rank, no traceback
    assert "DataError" not in done.stdout, done.stdout  # the workers print no traceback
    assert all("rank 0 on" in line and "rank 1 on" in line and "d0" in line and "d1" in line
               for line in refusals), refusals
    assert not (tmp_path / "ckpt").exists() or newest_committed_step(tmp_path / "ckpt") == 0


class _Exploit:
    def __reduce__(self):
        import os

        return (os.system, ("touch pwned",))
