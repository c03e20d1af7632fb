"""TensorBoard and events.jsonl tell one true story of a run, across kills and resizes."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from launch import clean_env, cli_cmd, free_port, kill_tree, run
from PIL import Image

from elastic_mnist.events import read_events
from elastic_mnist.job import is_generated_id

TAGS = {"train/loss", "train/accuracy", "test/loss", "test/accuracy", "opt/lr",
        "perf/samples_per_s", "perf/step_ms", "perf/data_wait_pct", "elastic/world_size",
        "elastic/restart_generation", "ckpt/save_ms", "ckpt/bytes"}


def accumulate(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "images": 0,
                                                        "tensors": 0})
    acc.Reload()
    return acc


def assert_clean_curves(acc) -> None:
    assert TAGS <= set(acc.Tags()["scalars"]), TAGS - set(acc.Tags()["scalars"])
    for tag in acc.Tags()["scalars"]:
        steps = [e.step for e in acc.Scalars(tag)]
        assert steps == sorted(set(steps)), (tag, steps)  # strictly increasing
    train_steps = [e.step for e in acc.Scalars("train/loss")]
    assert max(b - a for a, b in itertools.pairwise(train_steps)) <= 2  # --log-every
    assert [e.step for e in acc.Scalars("test/accuracy")] == [10, 20, 30, 40]
    assert "test/predictions" in acc.Tags()["images"]
    assert "_hparams_/experiment" in acc.PluginTagToContent("hparams")


@pytest.fixture(scope="module")
def resized_dir(resized_run) -> Path:
    run_id = json.loads((resized_run.work / "ckpt" / "run.json").read_text())["run_id"]
    assert resized_run.run_dir.name == run_id  # all three launches wrote into one folder
    return resized_run.run_dir


def test_killed_run_has_clean_curves_and_a_true_record(killed_run):
    run_dir = killed_run / "runs" / "killed"
    assert_clean_curves(accumulate(run_dir))
    events = read_events(run_dir / "events.jsonl")
    kinds = [e["event"] for e in events]
    assert kinds[0] == "start" and kinds[-1] == "finish"
    starts = [e for e in events if e["event"] == "start"]
    assert [s["restart_generation"] for s in starts] == [0, 1, 2]
    assert starts[1]["resumed_from_step"] >= 4 and starts[2]["resumed_from_step"] >= 24
    assert all(s["world_size"] == 2 for s in starts)
    assert all({"time", "step"} <= set(e) for e in events)
    checkpoints = [e for e in events if e["event"] == "checkpoint"]
    assert all(e["bytes"] > 0 and e["blocking_ms"] >= 0 for e in checkpoints)
    assert events[-1]["step"] == 40 and events[-1]["test_accuracy"] > 0.5


def test_resized_run_records_the_resize(resized_dir):
    acc = accumulate(resized_dir)
    assert_clean_curves(acc)
    worlds = [int(e.value) for e in acc.Scalars("elastic/world_size")]
    changes = [w for w, _ in itertools.groupby(worlds)]
    assert changes == [2, 1, 2], worlds
    events = read_events(resized_dir / "events.jsonl")
    kinds = [e["event"] for e in events]
    assert kinds.count("start") == 3 and kinds.count("preempted") == 2 and kinds[-1] == "finish"
    resizes = [e for e in events if e["event"] == "resize"]
    preemptions = [e for e in events if e["event"] == "preempted"]
    assert [(e["old_world_size"], e["new_world_size"]) for e in resizes] == [(2, 1), (1, 2)]
    for resize, preempted in zip(resizes, preemptions):
        assert resize["step"] == preempted["step"]  # resumed exactly where it stopped


def test_tensorboard_serves_the_run(resized_dir):
    port = free_port()
    board = subprocess.Popen(
        [str(Path(sys.executable).parent / "tensorboard"), "--logdir", str(resized_dir.parent),
         "--port", str(port), "--host", "127.0.0.1", "--reload_interval", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=clean_env())
    try:
        url = (f"http://127.0.0.1:{port}/data/plugin/scalars/scalars?run={resized_dir.name}"
               f"&tag=train/loss")
        deadline, served = time.monotonic() + 60, None
        while served is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    served = json.loads(response.read())
            except OSError:
                time.sleep(0.5)
        assert served is not None, "TensorBoard did not serve the run within 60 s"
        expected = [e.step for e in accumulate(resized_dir).Scalars("train/loss")]
        assert [step for _, step, _ in served] == expected
    finally:
        kill_tree(board.pid)


def test_plot_draws_the_run(resized_dir, tmp_path):
    done = run(cli_cmd("plot", str(resized_dir), "-o", str(tmp_path / "run.png")))
    assert done.returncode == 0, done.stdout
    image = Image.open(tmp_path / "run.png")
    colors = image.getcolors(maxcolors=image.size[0] * image.size[1])
    assert image.size[0] > 500 and len(colors) > 3


def test_plot_of_a_folder_without_a_run_is_a_clear_error(tmp_path):
    done = run(cli_cmd("plot", str(tmp_path), "-o", str(tmp_path / "x.png")))
    assert done.returncode == 2
    assert "no train/loss" in done.stdout.strip().splitlines()[-1]


def test_standalone_uuids_are_not_run_names():
    assert is_generated_id("2f1c8f4e-6f0e-4c61-9f3d-0c6f3f1b5e21")
    assert not is_generated_id("job-42")

