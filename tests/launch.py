"""Launching the job for real in tests: torchrun in a subprocess, killed as a whole tree."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from pathlib import Path

import psutil

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


def listening(root_pid: int) -> dict:
    """What the launch rooted at ``root_pid`` listens on, for tests/test_listening.py: every
    process of its tree with a listening TCP socket (its role, rank, and the MASTER_* torchrun
    gave it) and, under the shared agent store, the attempt store that rank 0 published there."""
    from elastic_mnist.attempt_store import ENTRY

    processes = []
    for proc in [psutil.Process(root_pid), *psutil.Process(root_pid).children(recursive=True)]:
        try:
            sockets = [(c.laddr.ip, c.laddr.port) for c in proc.net_connections(kind="tcp")
                       if c.status == psutil.CONN_LISTEN]
            environ, cmdline = proc.environ(), proc.cmdline()
        except psutil.NoSuchProcess:
            continue
        if not sockets:
            continue
        role = ("agent" if "torch.distributed.run" in cmdline or "torchrun" in " ".join(cmdline)
                else "worker" if "RANK" in environ else " ".join(cmdline))
        processes.append({"role": role, "rank": environ.get("RANK"), "sockets": sockets,
                          **{k: environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT",
                                                         "TORCHELASTIC_USE_AGENT_STORE")}})
    published = None
    rank0 = next((p for p in processes if p["rank"] == "0"), None)
    if rank0 and rank0["TORCHELASTIC_USE_AGENT_STORE"] == "True":
        from torch.distributed import TCPStore

        agent = TCPStore(rank0["MASTER_ADDR"], int(rank0["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=10))
        published = json.loads(agent.get(ENTRY))
    return {"processes": processes, "attempt_store": published}
