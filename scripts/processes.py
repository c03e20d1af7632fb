"""Process helpers shared by the scripts and the tests: clean environments for the jobs they
start, whole trees killed, free ports found."""

from __future__ import annotations

import os
import signal
import socket

import psutil

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
                 "MASTER_ADDR", "MASTER_PORT")
"""What a launcher sets; an outer torchrun's values must not leak into the jobs started here."""


WORKAROUNDS = ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE",)
"""What jobs/*.sh set for torchrun; a plain launch, as users make it, has none of them."""


def job_env(threads: int = 1, **extra: str) -> dict[str, str]:
    """The environment of a plain launch, as a user makes it: this one without any launcher's
    variables and without the workarounds jobs/*.sh set, with ``threads`` intra-op threads (on a
    small shared machine more threads per process collapse whenever another is busy) and
    ``extra`` on top."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARS + WORKAROUNDS and not k.startswith("TORCHELASTIC_")}
    env["OMP_NUM_THREADS"] = str(threads)
    env.update(extra)
    return env


def tree(pid: int) -> list[psutil.Process]:
    """``pid``'s descendants and ``pid`` itself (none when it is gone). torchrun's workers live
    in sessions of their own, so a process group or session does not reach them all."""
    try:
        root = psutil.Process(pid)
        return [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return []


def signal_all(procs: list[psutil.Process], sig: int) -> None:
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signals ``pid`` and every descendant, then reaps what it killed."""
    procs = tree(pid)
    signal_all(procs, sig)
    if sig == signal.SIGKILL:
        psutil.wait_procs(procs, timeout=10)


def stop_tree(pid: int, grace_s: float) -> None:
    """SIGTERM to ``pid`` and every descendant (torchrun's agent passes it on to its workers),
    then SIGKILL to those of them still alive ``grace_s`` later."""
    procs = tree(pid)
    signal_all(procs, signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    signal_all(alive, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=grace_s)


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
