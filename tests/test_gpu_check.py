"""scripts/gpu_check.sh's dry run on a machine without a GPU: what it can run on CPU, at smoke-test
sizes, leaving the files it promises (on a GPU the script is the check itself, minutes long)."""

from __future__ import annotations

import json

import pytest
import torch
from launch import REPO, clean_env, run


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: run the script itself")
def test_gpu_check_runs_its_cpu_parts_and_leaves_its_files(tiny_digits, tmp_path):
    out = tmp_path / "out"
    done = run([str(REPO / "scripts" / "gpu_check.sh"), str(out), "--data-dir", str(tiny_digits)],
               env=clean_env(), timeout=240)
    assert done.returncode == 0, done.stdout
    summary = [line for line in done.stdout.splitlines() if line.startswith("gpu_check: ")]
    assert [line.split(": ")[1] for line in summary] == [
        "cuda tests", "two CPU workers with one GPU visible", "smoke test", "bench",
        "exit status 0; results in " + str(out)], summary
    assert all("skipped (no GPU)" in line for line in summary[:2])
    assert all(": ok (" in line for line in summary[2:4]), summary
    assert (out / "gpu_check.log").read_text().splitlines()[-1] == summary[-1]

    smoke = json.loads((out / "smoke.json").read_text())
    assert smoke["passed"] and (smoke["device"], smoke["world_size"]) == ("cpu", 1)
    assert len(smoke["checks"]) == 6 and all(smoke["checks"].values())
    results = json.loads((out / "results.json").read_text())
    assert results["device"] == "cpu" and not results["errors"]
    assert results["figures"]["worker_samples_per_s"]["median"] > 0
    assert "| Our worker, one process" in (out / "table.md").read_text()
