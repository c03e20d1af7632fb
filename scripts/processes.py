"""Process helpers shared by the scripts and the tests: whole trees killed, free ports found."""

from __future__ import annotations

import signal
import socket

import psutil


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signals ``pid`` and every descendant (torchrun's workers live in sessions of their own,
    so a process group or session does not reach them), then reaps what it killed."""
    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    if sig == signal.SIGKILL:
        psutil.wait_procs(procs, timeout=10)


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
