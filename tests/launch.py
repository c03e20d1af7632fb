"""Launching the job for real in tests: torchrun in a subprocess, killed as a whole tree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from processes import LAUNCHER_VARS, free_port, job_env, kill_tree  # noqa: F401 - shared


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without any launcher's variables, one thread per worker."""
    return job_env(1, **extra)


def torchrun_cmd(nproc: int, *args: str, max_restarts: int = 0) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", f"--max_restarts={max_restarts}",
            "--monitor_interval=0.2", "-m", "elastic_mnist", *args]


def cli_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "elastic_mnist", *args]


def start(cmd: list[str], log: Path | None = None, env: dict[str, str] | None = None,
          cwd: Path | None = None) -> subprocess.Popen:
    out = open(log, "w") if log else subprocess.PIPE  # noqa: SIM115 - handed to the child
    return subprocess.Popen(cmd, cwd=cwd or REPO, env=env or clean_env(), stdout=out,
                            stderr=subprocess.STDOUT, text=True)


def run(cmd: list[str], timeout: float = 240, env: dict[str, str] | None = None,
        cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Runs ``cmd`` to completion (stdout and stderr together); kills its tree on timeout."""
    proc = start(cmd, env=env, cwd=cwd)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, _ = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} timed out after {timeout}s:\n{out}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")
