"""The store side of ``make scale``: one real TCPStore served as the job serves it, every
operation a simulated rank makes counted, the store's own load read beside them, and its
capacity on this machine.

- :class:`Counting` wraps a client: operations (by kind) and bytes, per second of the wall
  clock;
- :class:`StoreGauge` reads, every ``GAUGE_S``, the store's process's CPU time and the round
  trip of a client that asks nothing else;
- :func:`capacity` drives the store as fast as ``CAPACITY_CLIENTS`` processes can;
- :func:`serve` starts it in a process of its own (``elastic-mnist rendezvous``).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

from torch.distributed import TCPStore

from elastic_mnist.stores import listening

CAPACITY_CLIENTS = 4
"""Processes that measure the store's capacity, each as fast as it can."""
GAUGE_S = 0.05
"""How often :class:`StoreGauge` reads the store's load."""
OPS = ("set", "get", "add", "check", "multi_get", "multi_set", "compare_set", "wait")


class Counting:
    """A store that counts what passes through it: operations, and bytes of keys and values
    each way, per second of the wall clock."""

    def __init__(self, store: Any, counts: Counter, lock: threading.Lock, prefix: str = ""):
        """``prefix``: the prefix ``store`` puts before every key, counted in its bytes."""
        self._store, self._counts, self._lock = store, counts, lock
        self._prefix = len(prefix) + 1 if prefix else 0

    def _count(self, op: str, nbytes: int, keys: int = 1) -> None:
        second = int(time.time())
        with self._lock:
            self._counts[("ops", second)] += 1
            self._counts[(op, second)] += 1
            self._counts[("bytes", second)] += nbytes + keys * self._prefix

    def set_timeout(self, timeout: timedelta) -> None:
        self._store.set_timeout(timeout)

    def set(self, key: str, value: str | bytes) -> None:
        self._store.set(key, value)
        self._count("set", len(key) + len(value))

    def get(self, key: str) -> bytes:
        value = self._store.get(key)
        self._count("get", len(key) + len(value))
        return value

    def add(self, key: str, amount: int) -> int:
        value = self._store.add(key, amount)
        self._count("add", len(key) + 16)
        return value

    def check(self, keys: list[str]) -> bool:
        found = self._store.check(keys)
        self._count("check", sum(map(len, keys)) + 1, len(keys))
        return found

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = self._store.multi_get(keys)
        self._count("multi_get", sum(map(len, keys)) + sum(map(len, values)), len(keys))
        return values

    def multi_set(self, keys: list[str], values: list[str]) -> None:
        self._store.multi_set(keys, values)
        self._count("multi_set", sum(map(len, keys)) + sum(map(len, values)), len(keys))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        value = self._store.compare_set(key, expected, desired)
        self._count("compare_set", len(key) + len(expected) + len(desired) + len(value))
        return value

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._store.wait(keys) if timeout is None else self._store.wait(keys, timeout)
        self._count("wait", sum(map(len, keys)), len(keys))


def serve(port: int) -> subprocess.Popen:
    """The store, in a process of its own, as ``elastic-mnist rendezvous`` serves it."""
    proc = subprocess.Popen([sys.executable, "-m", "elastic_mnist", "rendezvous", "--host",
                             "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not listening("127.0.0.1", port, timeout_s=1):
        if time.time() > deadline or proc.poll() is not None:
            proc.kill()
            raise SystemExit(f"scale: the store did not start on port {port}")
        time.sleep(0.1)
    return proc


def stop_serving(server: subprocess.Popen) -> None:
    """Ends the store's process: SIGTERM, SIGKILL if it has not ended within 10 s (thousands of
    connections to close)."""
    server.terminate()
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


class StoreGauge:
    """The store's own load, read beside the simulation every GAUGE_S: its process's CPU time,
    and the round trip of a ``check`` by a client that asks nothing else (on this machine's busy
    cores: an upper bound of the store's own answer)."""

    def __init__(self, port: int, pid: int):
        self.port, self.pid = port, pid
        self.trips: list[tuple[float, float]] = []
        """(when, seconds) of each round trip."""
        self.cpu: list[tuple[float, float]] = []
        """(when, the store's CPU seconds so far)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="store-gauge")
        self._thread.start()

    def _run(self) -> None:
        store = TCPStore("127.0.0.1", self.port, is_master=False, timeout=timedelta(seconds=60))
        store.set("gauge", "1")
        tick = os.sysconf("SC_CLK_TCK")
        stat = Path(f"/proc/{self.pid}/stat")
        while not self._stop.wait(GAUGE_S):
            start = time.perf_counter()
            store.check(["gauge"])
            self.trips.append((time.time(), time.perf_counter() - start))
            with contextlib.suppress(OSError, ValueError, IndexError):  # no /proc: no CPU figure
                # utime and stime, after the command's closing parenthesis (fields 14 and 15)
                fields = stat.read_text().rpartition(")")[2].split()
                self.cpu.append((time.time(), (int(fields[11]) + int(fields[12])) / tick))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def cpu_share(self, start: float, end: float) -> float | None:
        """The store's share of one core from ``start`` to ``end``."""
        inside = [(t, c) for t, c in self.cpu if start <= t <= end]
        if len(inside) < 2:
            return None
        return (inside[-1][1] - inside[0][1]) / max(inside[-1][0] - inside[0][0], 1e-9)

    def round_trip_ms(self, start: float, end: float) -> list[float] | None:
        """The median and the 99th percentile of the round trips from ``start`` to ``end``."""
        trips = sorted(s for t, s in self.trips if start <= t <= end)
        if not trips:
            return None
        return [1e3 * trips[len(trips) // 2], 1e3 * trips[min(len(trips) - 1,
                                                                 int(0.99 * len(trips)))]]


def hammer(port: int, seconds: float, out: Any) -> None:
    """One client's fastest stream of ``add``s on its own key (a pulse)."""
    store = TCPStore("127.0.0.1", port, is_master=False)
    done, end = 0, time.time() + seconds
    while time.time() < end:
        for _ in range(100):
            store.add(f"capacity/{os.getpid()}", 1)
        done += 100
    out.send(done)


def capacity(port: int, clients: int, seconds: float = 3.0) -> float:
    """The store's operations a second, as ``clients`` processes on this machine drive it."""
    pipes = [mp.Pipe(duplex=False) for _ in range(clients)]
    procs = [mp.Process(target=hammer, args=(port, seconds, w)) for _, w in pipes]
    for p in procs:
        p.start()
    total = sum(r.recv() for r, _ in pipes)
    for p in procs:
        p.join()
    return total / seconds
