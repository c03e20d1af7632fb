"""jobs/slurm.sbatch under a real SLURM, when there is one: submitted with sbatch, preempted with
`scancel --batch --signal=TERM`, requeued by the job file itself, resumed at the exact step of the
stop and finished, one run folder for the job; a second job beside it on the same node, at a
rendezvous port of its own, finished too (scripts/slurm_check.py, which `make slurm-check` runs
on a one-node cluster of its own). Skips where `sbatch` is missing or no controller answers;
run it against one with

    scripts/slurm_local.sh .venv/bin/python -m pytest tests/test_slurm.py
"""

from __future__ import annotations

import sys

import pytest
from launch import REPO

sys.path.insert(0, str(REPO / "scripts"))
import slurm_check

pytestmark = pytest.mark.slow


def test_a_preempted_slurm_job_requeues_itself_and_resumes_at_the_step_it_stopped(tmp_path):
    missing = slurm_check.slurm_missing()
    if missing:
        pytest.skip(missing)
    try:
        outcome = slurm_check.check_slurm_job(tmp_path, steps=200, preempt_after=60,
                                              nproc_per_node=2, timeout=600, second_steps=400)
    except slurm_check.CheckFailed as failure:
        pytest.fail(str(failure))
    print(slurm_check.report(outcome))
    assert 60 <= outcome.stopped_step < 200
    assert set(outcome.timings) >= {"submit → first step", "TERM → stopped, checkpoint saved",
                                    "stopped → requeued job's first step",
                                    "requeued job's first step → finish",
                                    "second job: submit → completed"}
    assert outcome.second_job_id
