"""scripts/gpu_check.sh on a machine without a GPU: its steps' plumbing (each in its own bound,
cut off without stopping the next, the summary written as they go) with stand-in commands, the
probes of scripts/gpu_probes.py on CPU, and the script's own dry run at the tiniest sizes (on a
GPU the script is the check itself, 8 minutes at most)."""

from __future__ import annotations

import json
import sys
import time

import gpu_check
import gpu_probes
import psutil
import pytest
import torch
from launch import REPO, clean_env, run


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_each_step_in_its_bound_and_the_budget_the_summary_written_as_they_go(tmp_path):
    """A step cut off at its bound (its descendants too, in sessions of their own as torchrun's
    workers are), one that fails, one skipped: the next steps run all the same; one left with
    no time in the budget is skipped; the running step is in the summary while it runs."""
    summary_file, pid_file = tmp_path / "summary.json", tmp_path / "grandchild"
    result = tmp_path / "result.json"
    steps = [
        gpu_check.Step("hangs", "a step that never ends", python(
            "import json, subprocess, sys, time\n"
            f"print(json.load(open({str(summary_file)!r}))['steps'][-1]['status'], flush=True)\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
            " start_new_session=True)\n"
            f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
            "time.sleep(60)"), bound_s=1),
        gpu_check.Step("fails", "a step that fails", python("import sys; sys.exit(3)"), 30),
        gpu_check.Step("needs a GPU", "skipped", python("pass"), 30, skip="no GPU"),
        gpu_check.Step("writes", "a step with its result", python(
            f"open({str(result)!r}, 'w').write('{{\"checks\": {{\"it held\": true}}}}')"), 30,
            result=result),
    ]
    late = [gpu_check.Step("late", "a step that takes the rest of the budget",
                           python("import time; time.sleep(60)"), 30),
            gpu_check.Step("later", "a step left with no time", python("pass"), 30)]
    summary = gpu_check.Summary(summary_file, {"gpus": []})
    log = gpu_check.Log(tmp_path / "gpu_check.log")
    began = time.monotonic()
    assert gpu_check.run_steps(steps, summary, log, budget_s=120, bounds={}) == 1
    assert gpu_check.run_steps(late, summary, log, budget_s=gpu_check.RESERVE_S + 2,
                               bounds={}) == 1
    assert time.monotonic() - began < 3 + 4 * gpu_check.GRACE_S
    written = json.loads(summary_file.read_text())
    assert [(s["name"], s["status"]) for s in written["steps"]] == [
        ("hangs", "timed out"), ("fails", "failed"), ("needs a GPU", "skipped (no GPU)"),
        ("writes", "ok"), ("late", "timed out"),
        ("later", "skipped (no time left in the budget)")]
    assert written["steps"][0]["bound_s"] == 1 and written["steps"][1]["exit_code"] == 3
    assert written["steps"][3]["result"] == {"checks": {"it held": True}}
    assert written["steps"][4]["bound_s"] <= 2  # what was left of the budget, not its own 30
    assert not psutil.pid_exists(int(pid_file.read_text()))
    lines = (tmp_path / "gpu_check.log").read_text().splitlines()
    assert lines[1] == "running"  # what the summary said while the step ran
    assert any(line.startswith("gpu_check: fails: failed (exit 3) (") for line in lines)


def test_a_grouped_probe_outside_torchrun_is_one_line_and_exit_2(tiny_digits, tmp_path,
                                                                 capsys):
    assert gpu_probes.main(["ddp", "--device", "cpu", "--data-dir", str(tiny_digits),
                            "--out", str(tmp_path / "x.json")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_the_futures_probe_on_cpu_writes_its_check_left_open(tiny_digits, tmp_path):
    """The one probe without a process group, in this process (the dry run below leaves it out:
    on a CPU it proves nothing but this)."""
    assert gpu_probes.main(["futures", "--device", "cpu", "--data-dir", str(tiny_digits),
                            "--out", str(tmp_path / "futures.json")]) == 0
    found = json.loads((tmp_path / "futures.json").read_text())
    assert found["probe"] == "futures" and found["device"] == "cpu"
    assert list(found["checks"].values()) == [None]


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: run the script itself")
def test_gpu_check_dry_run_leaves_its_files(tiny_digits, tmp_path):
    """The script as run, with the interpreter it is given (the one running the suite: the
    torch-2.11 venv's under make test-torch211): the smoke test in one CPU process, the probes on
    CPU (those of a process group in a group of one without torchrun), their GPU checks left
    open; the bench is left to tests/test_bench.py. The probes run in processes of their own:
    a gloo group's threads outlive it and can abort the process that made it at its exit."""
    out = tmp_path / "out"
    done = run([str(REPO / "scripts" / "gpu_check.sh"), str(out), "--digits", str(tiny_digits),
                "--only", "smoke,ddp,rng,graphs"], env=clean_env(GPU_CHECK_PYTHON=sys.executable),
               timeout=240)
    assert done.returncode == 0, done.stdout
    lines = [line for line in done.stdout.splitlines() if line.startswith("gpu_check: ")]
    assert lines[-1] == f"gpu_check: exit status 0; results in {out}"
    assert (out / "gpu_check.log").read_text().splitlines()[-1] == lines[-1]
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.log", "smoke.json",
                                                    "summary.json"]  # few: they travel back
    summary = json.loads((out / "summary.json").read_text())
    assert summary["finished"] and summary["dry_run"] and summary["exit_status"] == 0
    assert summary["torch"] == torch.__version__
    assert [(s["name"], s["status"]) for s in summary["steps"]] == [
        ("digits", f"skipped (given: {tiny_digits})"), ("smoke", "ok"), ("ddp", "ok"), ("rng", "ok"),
        ("futures", "skipped (not asked for)"), ("graphs", "ok"), ("cuda tests", "skipped (no GPU)"),
        ("laptop", "skipped (no GPU)"), ("bench", "skipped (not asked for)")]
    assert len(summary["not_proven"]) == len(gpu_check.NOT_PROVEN)
    assert all(entry["needs"] == "2 GPUs" for entry in summary["not_proven"])

    smoke = json.loads((out / "smoke.json").read_text())
    assert smoke["passed"] and (smoke["device"], smoke["world_size"]) == ("cpu", 1)
    assert len(smoke["checks"]) == 6 and all(smoke["checks"].values())
    assert summary["steps"][1]["result"] == smoke
    probes = {s["name"]: s["result"] for s in summary["steps"][2:6] if s["name"] != "futures"}
    for name, found in probes.items():
        assert found["probe"] == name and found["device"] == "cpu" and found["checks"], found
        assert False not in found["checks"].values()
        assert (True in found["checks"].values()) == (name in ("ddp", "graphs")), found
    assert probes["ddp"]["checks"]["a gloo group of one under torchrun"] is True
