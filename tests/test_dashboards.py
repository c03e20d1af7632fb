"""TensorBoard and events.jsonl tell one true story of a run, across kills and resizes."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import torch
from launch import REPO, clean_env, free_port, kill_tree
from PIL import Image

from elastic_mnist.cli import main
from elastic_mnist.errors import EXIT_DROPPED
from elastic_mnist.events import read_events
from elastic_mnist.job import DASHBOARD, is_generated_id

TAGS = {"train/loss", "train/accuracy", "test/loss", "test/accuracy", "opt/lr",
        "perf/samples_per_s", "perf/step_ms", "perf/data_wait_pct", "elastic/world_size",
        "elastic/restart_generation", "ckpt/save_ms", "ckpt/bytes", "train/nonfinite_steps",
        "train/epoch", "pace/slowest_compute_s", "pace/median_compute_s", "pace/wait_share"}
RESIZED_RESTARTS = ["g1, world 2\u21921", "g2, world 1\u21922"]
"""The plot's labels of resized_run's two restarts: generation, world size before and after."""


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


@pytest.fixture(scope="module")
def board(resized_dir):
    """TensorBoard serving resized_run's logdir; yields a GET of its HTTP API as JSON."""
    port = free_port()
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "tensorboard"), "--logdir", str(resized_dir.parent),
         "--port", str(port), "--host", "127.0.0.1", "--reload_interval", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=clean_env())

    def get(path: str, **query: str):
        url = f"http://127.0.0.1:{port}{path}?{urllib.parse.urlencode(query)}"
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    return json.loads(response.read())
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"TensorBoard did not serve {url} within 60 s") from None
                time.sleep(0.5)

    try:
        yield get
    finally:
        kill_tree(server.pid)


def test_tensorboard_serves_the_run(resized_dir, board):
    served = board("/data/plugin/scalars/scalars", run=resized_dir.name, tag="train/loss")
    expected = [e.step for e in accumulate(resized_dir).Scalars("train/loss")]
    assert [step for _, step, _ in served] == expected


def test_tensorboard_opens_the_custom_scalars_layout_once_after_restarts(resized_dir, board):
    deadline = time.monotonic() + 30
    while not (layout := board("/data/plugin/custom_scalars/layout")):
        assert time.monotonic() < deadline, "no custom scalars layout served within 30 s"
        time.sleep(0.5)
    # Three launches wrote into this folder: every category once, in order, as the job wrote it.
    served = {category["title"]: {chart["title"]: [tag.strip("^$") for tag in
                                                   chart["multiline"]["tag"]]
                                  for chart in category["chart"]}
              for category in layout["category"]}
    assert [c["title"] for c in layout["category"]] == ["loss", "accuracy", "elastic",
                                                         "throughput", "checkpoints", "pace"]
    assert served == DASHBOARD
    charted = [tag for charts in served.values() for tags in charts.values() for tag in tags]
    # Each once, the learning rate and the epoch (a step's label, not a curve) aside.
    assert sorted(charted) == sorted(TAGS - {"opt/lr", "train/epoch"})
    assert served["loss"]["train and test loss"] == ["train/loss", "test/loss"]
    assert served["accuracy"] == {"train and test accuracy": ["train/accuracy", "test/accuracy"]}
    # Every chart's tag pattern finds its one tag in the run, with points.
    for chart in (c for category in layout["category"] for c in category["chart"]):
        for pattern in chart["multiline"]["tag"]:
            found = board("/data/plugin/custom_scalars/scalars", run=resized_dir.name,
                          tag=pattern)
            assert list(found["tag_to_events"]) == [pattern.strip("^$")], (pattern, found)
            assert found["tag_to_events"][pattern.strip("^$")], pattern


def test_each_run_folder_holds_one_layout_whatever_its_restarts(killed_run, resized_dir):
    for run_dir in (killed_run / "runs" / "killed", resized_dir):
        starts = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "start"]
        assert len(starts) == 3
        assert len(list(run_dir.glob("events.out.tfevents.*.layout"))) == 1, run_dir


def test_layout_is_written_once_and_whole_readable_as_the_folder(tmp_path):
    from tensorboard.plugins.custom_scalar import layout_pb2

    from elastic_mnist.metrics import TensorBoardMetrics

    for purge_step in (1, 30):  # a fresh launch, then one resumed from step 29
        metrics = TensorBoardMetrics(tmp_path, purge_step=purge_step)
        metrics.layout({"loss": {"train and test loss": ["train/loss", "test/loss"]}})
        metrics.close()
    (written,) = tmp_path.glob("events.out.tfevents.*.layout")
    assert written.stat().st_mode & 0o777 == tmp_path.stat().st_mode & 0o666
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left
    (event,) = accumulate(tmp_path).Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(event.tensor_proto.string_val[0])
    assert event.step == 0 and [c.title for c in layout.category] == ["loss"]
    assert list(layout.category[0].chart[0].multiline.tag) == ["^train/loss$", "^test/loss$"]


def test_tensorboard_writes_nothing_once_the_fence_is_over(tmp_path, monkeypatch):
    """A rank 0 dropped from the job (or whose folder was taken over) writes nothing more into
    TensorBoard's folder, by any path: scalars, images, text, hparams, the layout, a flush, its
    close; and no thread of the writer's own writes behind the fence's back (SummaryWriter's
    flushes from one): what passed the fence is in the file at once, nothing is held back."""
    from elastic_mnist.metrics import TensorBoardMetrics
    from elastic_mnist.resilience import fence
    from elastic_mnist.resilience.fence import Fence, FenceClosed, Over

    monkeypatch.setattr(fence, "RECENT_S", 0.0)  # every write asks: none reuses a verdict
    monkeypatch.setattr(fence, "RECENT_WAIT_S", 5.0)  # and waits for the answer, however loaded
    verdict: list[Over | None] = [None]
    over: list[Over] = []
    threads = set(threading.enumerate())
    metrics = TensorBoardMetrics(tmp_path, purge_step=1,
                                 fence=Fence(lambda: verdict[0], on_over=over.append))
    # No thread of the writer's own (the fence asks its questions in one of its own, which
    # writes nothing).
    assert {t for t in threading.enumerate() if not t.name.startswith("fence")} <= threads
    metrics.scalars(1, {"train/loss": 2.0})
    metrics.text("launch", "hello", 1)
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert accumulate(tmp_path).Scalars("train/loss")[0].value == 2.0  # no flush needed
    verdict[0] = Over("rank 0 was dropped", EXIT_DROPPED)
    writes = [lambda: metrics.scalars(2, {"train/loss": 1.0}),
              lambda: metrics.image("test/predictions", torch.zeros(4, 4, 3), 2),
              lambda: metrics.text("launch", "again", 2),
              lambda: metrics.hparams({"lr": 0.1}, ["test/accuracy"]),
              lambda: metrics.layout({"loss": {"train loss": ["train/loss"]}}),
              metrics.flush]
    for write in writes:
        with pytest.raises(FenceClosed):
            write()
    metrics.close()
    assert len(over) == len(writes)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == files


def plot(capsys, *argv: str) -> tuple[int, str]:
    """``elastic-mnist plot ...`` in this process: its exit status and what it said on stderr."""
    status = main(["plot", *argv])
    return status, capsys.readouterr().err


@pytest.mark.parametrize("suffix", [".png", ".svg", ".pdf"])
def test_plot_draws_the_run_for_a_report(resized_dir, tmp_path, capsys, suffix):
    out = tmp_path / f"run{suffix}"
    status, err = plot(capsys, str(resized_dir), "-o", str(out))
    assert status == 0, err
    data = out.read_bytes()
    if suffix == ".png":
        assert data.startswith(b"\x89PNG\r\n\x1a\n")
        image = Image.open(out)
        assert image.size[0] >= 1200 and len(image.getcolors(image.size[0] * image.size[1])) > 50
    elif suffix == ".pdf":
        assert data.startswith(b"%PDF-") and data.rstrip().endswith(b"%%EOF")
    else:
        text = data.decode()
        assert text.lstrip().startswith("<?xml") and "<svg" in text
        for words in (*RESIZED_RESTARTS, "loss", "error rate", "throughput and world size",
                      "world size (processes)", "optimizer step", "final test accuracy"):
            assert words in text, words


def test_plot_labels_each_restart_with_generation_and_world_sizes(killed_run, resized_dir):
    from elastic_mnist.plot import read_record

    killed = read_record(killed_run / "runs" / "killed")
    assert [r.label for r in killed.restarts] == ["g1, world 2\u21922", "g2, world 2\u21922"]
    assert [s for s, _ in killed.starts] == [0] + [r.step for r in killed.restarts]
    resized = read_record(resized_dir)
    assert [r.label for r in resized.restarts] == RESIZED_RESTARTS
    assert [w for _, w in resized.starts] == [2, 1, 2] and resized.final_accuracy > 0.5


@pytest.mark.parametrize("case", ["no folder", "no run in it", "unknown format", "no such parent"])
def test_plot_of_bad_input_is_one_line_and_exit_2(tmp_path, capsys, case):
    run_dir, out, said = {
        "no folder": (tmp_path / "missing", tmp_path / "run.png", "missing is not a folder"),
        "no run in it": (tmp_path, tmp_path / "run.png", "holds no train/loss scalars"),
        "unknown format": (tmp_path, tmp_path / "run.jpg", "must end with .png, .svg, .pdf"),
        "no such parent": (tmp_path, tmp_path / "missing" / "run.png", "missing is not a folder"),
    }[case]
    status, err = plot(capsys, str(run_dir), "-o", str(out))
    assert status == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("elastic-mnist plot: error:"), err
    assert said in err, err
    assert not out.exists()


def test_only_the_plot_command_imports_matplotlib():
    probe = ("import sys, elastic_mnist.cli; before = 'matplotlib' in sys.modules; "
             "import elastic_mnist.plot; print(before, 'matplotlib' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=clean_env(), check=False,
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["False", "True"], done.stderr


def test_standalone_uuids_are_not_run_names():
    assert is_generated_id("2f1c8f4e-6f0e-4c61-9f3d-0c6f3f1b5e21")
    assert not is_generated_id("job-42")

