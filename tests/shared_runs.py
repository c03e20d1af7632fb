"""The suite's expensive runs, each launched once per session and asserted on by several tests.

Every run trains the tiny synthetic digits (640 train, 256 test) for 4 epochs of 10 steps at a
global batch of 64 under real torchrun on CPU:

- ``reference_run``: two workers, uninterrupted, a checkpoint after every step;
- ``killed_run``: two workers, one of them SIGKILLed twice, torchrun restarting them (what it
  listens on before the first kill in listening.json); before the first kill a second launch
  into its folder, with another seed (intruder.log);
- ``resized_run``: two workers preempted by SIGTERM, one worker resuming and preempted in turn, two
  workers finishing, every sample audited; no --run-id given;
- ``interrupted_make_train``: ``make train`` (jobs/local.sh) stopped by a Ctrl-C after its
  checkpoint of step 2: SIGINT to the launch's process group, as a terminal sends it (what it
  listens on before in listening.json).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import io
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from launch import REPO, clean_env, kill_tree, listening, run, start, torchrun_cmd

from elastic_mnist.checkpoint import newest_committed_step
from elastic_mnist.cli import main

FLAGS = ["--device", "cpu", "--dataset", "synthetic", "--global-batch-size", "64",
         "--micro-batch-size", "16", "--log-every", "2", "--epochs", "4",
         "--checkpoint-every-seconds", "0"]
"""Every run here pins the CPU: two workers on a one-GPU machine would otherwise want two GPUs.
Checkpoints follow steps alone: the tests name the steps saved, which a clock would move."""
STEPS = 40
"""Steps of a whole run: 4 epochs of 640 samples at 64 a step."""


def args_for(data: Path, work: Path, *extra: str) -> list[str]:
    return ["train", *FLAGS, "--data-dir", str(data), "--checkpoint-dir", str(work / "ckpt"),
            "--logdir", str(work / "runs"), *extra]


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


def command_json(*argv: str) -> dict:
    """What an ``elastic-mnist ... --json`` command prints, run in this process: the programs
    themselves are run for real in their own tests, these read what a run left behind."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main([*argv, "--json"])
    assert status == 0, out.getvalue()
    return json.loads(out.getvalue())


def inspect(checkpoint_dir: Path) -> dict:
    return command_json("inspect", "--checkpoint-dir", str(checkpoint_dir))


def newest(checkpoint_dir: Path) -> dict:
    return inspect(checkpoint_dir)["checkpoints"][0]


def evaluate(checkpoint_dir: Path, *flags: str) -> dict:
    return command_json("evaluate", "--checkpoint-dir", str(checkpoint_dir), "--device", "cpu",
                        *flags)


def once_per_suite(fixture):
    """A fixture's body run once however many processes run the suite (pytest -n): the
    first process to ask runs it, the others wait for it and take its result, pickled in the
    session's temporary folder, which the processes share. (xdist_group marks cannot do this:
    under pytest 9.2, pytest-xdist 3.8's --dist loadgroup no longer groups, pytest-xdist#1386.)"""

    @functools.wraps(fixture)
    def shared(**fixtures):
        if "PYTEST_XDIST_WORKER" not in os.environ:
            return fixture(**fixtures)
        folder = fixtures["tmp_path_factory"].getbasetemp().parent
        result = folder / f"{fixture.__name__}.pickle"
        with open(folder / f"{fixture.__name__}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released as the file closes
            if result.exists():
                return pickle.loads(result.read_bytes())
            made = fixture(**fixtures)
            result.write_bytes(pickle.dumps(made))
            return made

    return shared


@pytest.fixture(scope="session")
@once_per_suite
def reference_run(tiny_digits, tmp_path_factory) -> Path:
    """The uninterrupted run at world size 2, every step's checkpoint kept."""
    work = tmp_path_factory.mktemp("reference")
    done = run(torchrun_cmd(2, *args_for(tiny_digits, work, "--checkpoint-every", "1",
                                         "--keep-last", str(STEPS), "--run-id", "reference")))
    assert done.returncode == 0, done.stdout
    (work / "run.log").write_text(done.stdout)
    return work


@pytest.fixture(scope="session")
@once_per_suite
def killed_run(tiny_digits, tmp_path_factory) -> Path:
    """A random worker SIGKILLed after the checkpoints of steps 4 and 24; torchrun restarts."""
    work = tmp_path_factory.mktemp("killed")
    log = work / "run.log"
    rng = random.Random(0)
    proc = start(torchrun_cmd(2, *args_for(tiny_digits, work, "--checkpoint-every", "4",
                                           "--run-id", "killed"), max_restarts=3), log=log)
    for at_step in (4, 24):
        wait_until(lambda s=at_step: newest_committed_step(work / "ckpt") >= s, proc)
        if at_step == 4:  # a live two-worker job under plain torchrun: what it listens on
            (work / "listening.json").write_text(json.dumps(listening(proc.pid)))
            intrude(tiny_digits, work, proc)
        rng.choice(workers(proc)).send_signal(signal.SIGKILL)
        time.sleep(rng.uniform(0.0, 0.3))
    assert proc.wait(timeout=240) == 0, log.read_text()
    return work


def intrude(data: Path, work: Path, proc: subprocess.Popen) -> None:
    """Another launch into the folder of the live job ``proc``, with another seed; its output in
    intruder.log. The job's workers are held (SIGSTOP) meanwhile, so that the job is still
    there, at the same step, when the launch looks at the folder (its 40 steps take less time
    than a launch takes to start); its restarts come after."""
    held = workers(proc)
    for worker in held:
        worker.send_signal(signal.SIGSTOP)
    try:
        intruder = run(torchrun_cmd(2, *args_for(data, work, "--seed", "1", "--run-id",
                                                 "intruder")))
    finally:
        for worker in held:
            worker.send_signal(signal.SIGCONT)
    (work / "intruder.log").write_text(f"exit {intruder.returncode}\n{intruder.stdout}")


@dataclass
class Preemption:
    """One SIGTERM of a launch: the world size, and how long the launch took to end."""

    world_size: int
    log: str
    seconds_to_exit: float
    newest_checkpoint: int
    """The step of the newest committed checkpoint once the launch had ended."""


@dataclass
class ResizedRun:
    work: Path
    preemptions: list[Preemption]
    last_log: str

    @property
    def run_dir(self) -> Path:
        (run_dir,) = (self.work / "runs").iterdir()
        return run_dir


@pytest.fixture(scope="session")
@once_per_suite
def resized_run(tiny_digits, tmp_path_factory) -> ResizedRun:
    """World size 2, SIGTERM after step 8; 1, SIGTERM after step 20; 2 to the end."""
    work = tmp_path_factory.mktemp("resized")
    args = args_for(tiny_digits, work, "--checkpoint-every", "4", "--audit-samples")
    preemptions = []
    for nproc, stop_after in ((2, 8), (1, 20)):
        log = work / f"launch-{len(preemptions)}.log"
        proc = start(torchrun_cmd(nproc, *args), log=log)
        wait_until(lambda s=stop_after: newest_committed_step(work / "ckpt") >= s, proc)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # preemption: agreed stop, checkpoint, exit
        proc.wait(timeout=30)
        preemptions.append(Preemption(nproc, log.read_text(), time.monotonic() - sent,
                                      newest_committed_step(work / "ckpt")))
    done = run(torchrun_cmd(2, *args))
    assert done.returncode == 0, done.stdout
    return ResizedRun(work, preemptions, done.stdout)


@dataclass
class Interrupted:
    work: Path
    log: str
    status: int
    seconds_to_exit: float
    """From the SIGINT to the end of make."""


@pytest.fixture(scope="session")
@once_per_suite
def interrupted_make_train(tiny_digits, tmp_path_factory) -> Interrupted:
    """``make train`` with this Python's environment, 1000 steps asked for, Ctrl-C once its
    checkpoint of step 2 is committed."""
    work = tmp_path_factory.mktemp("interrupted")
    train_args = " ".join(FLAGS[:-1] + ["100", "--checkpoint-every", "2"])  # --epochs 100
    cmd = ["make", "-o", ".venv/.installed", "train", f"BIN={Path(sys.executable).parent}",
           f"DATA_DIR={tiny_digits}", f"CHECKPOINT_DIR={work / 'ckpt'}",
           f"LOGDIR={work / 'runs'}", f"TRAIN_ARGS={train_args}"]
    log = work / "make.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=clean_env(NPROC_PER_NODE="2"), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: newest_committed_step(work / "ckpt") >= 2, proc)
        (work / "listening.json").write_text(json.dumps(listening(proc.pid)))
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal sends on Ctrl-C
        status = proc.wait(timeout=60)
        seconds = time.monotonic() - sent
    finally:
        kill_tree(proc.pid)
    return Interrupted(work, log.read_text(), status, seconds)
