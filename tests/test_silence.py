"""A peer gone silent is named by its pulse, as fast as a crash (elastic_mnist/resilience/silence.py),
in milliseconds: the prober's watch, the generation's pulses, and a stopped sibling killed. A
frozen worker named this way under real torchrun launches is tests/test_multinode.py's; a node
whose links are cut, `make partitions`'."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from elastic_mnist.resilience import silence
from elastic_mnist.resilience.agreement import SILENT_PULSES
from elastic_mnist.resilience.read_once import ReadOnce


class Watch:
    """A SilenceWatch whose pulses and stall the test sets, and whose declarations it keeps."""

    def __init__(self, rank: int = 0):
        self.silent: set[int] | None = set()
        self.stalled: float | None = 0.0
        self.looks = 0
        self.declared: list[tuple[list[int], str]] = []
        self.stop = threading.Event()
        self.watch = silence.SilenceWatch(rank, self.read, lambda: self.stalled,
                                          lambda ranks, why: self.declared.append((ranks, why)),
                                          self.stop)

    def read(self):
        self.looks += 1
        return self.silent


def wait_for(condition, timeout=3.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_silent_member_is_named_only_while_the_probers_own_step_waits():
    w = Watch(rank=0)
    w.silent, w.stalled = {2}, 0.3  # waiting 0.3 s only: rank 2 took part in the last step
    w.watch.start()
    try:
        wait_for(lambda: w.looks >= 5)  # read at every look, stalled or not
        assert w.declared == []
        w.stalled = None  # busy with work of its own (a save): nobody holds it up
        looks = w.looks
        wait_for(lambda: w.looks >= looks + 3)
        assert w.declared == []
        w.silent, w.stalled = {0}, 5.0  # its own pulse: never a verdict on itself
        looks = w.looks
        wait_for(lambda: w.looks >= looks + 3)
        assert w.declared == []
        w.silent = {0, 2, 3}
        wait_for(lambda: w.declared)
        (ranks, why), = w.declared
        assert ranks == [2, 3] and why.startswith("no pulse for 1.5 s")
        time.sleep(0.3)
        assert len(w.declared) == 1  # one verdict: the generation is over
    finally:
        w.stop.set()


def test_the_watch_ends_with_its_generation_and_rides_out_a_store_error():
    w = Watch()
    calls = iter([RuntimeError("store gone")] * 3)

    def read():
        w.looks += 1
        error = next(calls, None)
        if error is not None:
            raise error
        return set()

    w.watch.silent = read
    w.watch.start()
    wait_for(lambda: w.looks >= 5)  # went on past the errors
    w.stop.set()
    w.watch._thread.join(timeout=2)
    assert not w.watch._thread.is_alive() and w.declared == []


class NodeRecords:
    """The store's node records (board.py): the prober's own node's pulse moves at each read,
    the other node's as the test says."""

    def __init__(self):
        self.counts = {"node/a": 0, "node/b": 0}
        self.b_moves = True

    def multi_get(self, keys):
        self.counts["node/a"] += 1
        if self.b_moves:
            self.counts["node/b"] += 1
        return [f"{self.counts[k]},{self.counts[k]}".encode() for k in keys]


def test_the_generations_pulses_are_read_once_its_identities_are_known():
    from elastic_mnist.resilience.agreement import Identity

    def who(node: str, slot: int) -> Identity:
        return Identity("h", 1, 1, slot, board=node)

    known = ReadOnce(lambda: pytest.fail("read ahead by the watchers, never here"), 3)
    store = NodeRecords()
    pulses = silence.GenerationPulses(store, known, ("node/a", 0))
    assert pulses() is None  # not read ahead yet: nothing to say
    known.offer({0: who("a", 0), 1: who("a", 1), 2: who("b", 0), 3: who("b", 1)})
    for _ in range(SILENT_PULSES + 2):
        assert pulses() == set()
    store.b_moves = False  # node b's record stands still: both its ranks
    found = [pulses() for _ in range(SILENT_PULSES + 1)]
    assert found[SILENT_PULSES - 2] == set() and found[-1] == {2, 3}


def test_a_nodes_ranks_that_fell_silent_together_are_named_together():
    """Node b's record stops being written: its slot 1 had last moved a look before its slot 0
    (each rank raises its own pulse), so rank 3 is silent a look before rank 2. Both are named
    at once; a rank of another record, or one whose pulse moves, is not."""
    from elastic_mnist.resilience.agreement import Identity

    class Slots:
        def __init__(self):
            self.a, self.b = [0, 0], [0, 0]
            self.moving = {"a": [0, 1], "b": [0, 1]}

        def multi_get(self, keys):
            for slot in self.moving["a"]:
                self.a[slot] += 1
            for slot in self.moving["b"]:
                self.b[slot] += 1
            records = {"node/a": self.a, "node/b": self.b}
            return [",".join(map(str, records[k])).encode() for k in keys]

    known = ReadOnce(lambda: None, 3)
    known.offer({r: Identity("h", 1, 1, r % 2, board="ab"[r // 2]) for r in range(4)})
    store = Slots()
    pulses = silence.GenerationPulses(store, known, ("node/a", 0))
    for _ in range(3):
        assert pulses() == set()
    store.moving["b"] = [0]  # rank 3's pulse stops first; rank 2's a look later
    assert pulses() == set()
    store.moving["b"] = []
    found = [pulses() for _ in range(SILENT_PULSES + 1)]
    named = next(f for f in found if f)
    assert named == {2, 3}
    store.moving["a"] = [0]  # rank 1 frozen alone, its record written on: only itself
    found = [pulses() for _ in range(SILENT_PULSES + 1)]
    assert found[-1] == {1, 2, 3}
    # A record whose other rank stood still only later (a pulse thread starved, alive): the
    # silent one alone.
    store = Slots()
    pulses = silence.GenerationPulses(store, known, ("node/a", 0))
    pulses()
    store.moving["b"] = [0]
    for _ in range(6):
        pulses()
    store.moving["b"] = []
    found = [pulses() for _ in range(SILENT_PULSES)]
    assert next(f for f in found if f) == {3}


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_a_stopped_sibling_is_killed_and_a_running_one_left():
    stopped = subprocess.Popen(["sleep", "30"])
    running = subprocess.Popen(["sleep", "30"])
    try:
        stopped.send_signal(signal.SIGSTOP)
        stat = Path(f"/proc/{stopped.pid}/stat")
        wait_for(lambda: stat.read_text().rpartition(")")[2].split()[0] == "T")
        asked = []
        # Stopped but not named hung (an operator's, say): left alone.
        assert silence.kill_stopped_siblings(os.getpid(), lambda: asked.append(1) or set()) == []
        assert stopped.poll() is None and asked == [1]
        assert silence.kill_stopped_siblings(os.getpid(), lambda: {stopped.pid}) == [stopped.pid]
        assert stopped.wait(timeout=5) == -signal.SIGKILL
        assert running.poll() is None
        # No sibling stopped: the store is not asked who was named.
        assert silence.kill_stopped_siblings(os.getpid(), lambda: pytest.fail("asked")) == []
    finally:
        for p in (stopped, running):
            p.kill()
            p.wait()


def test_a_node_admitted_and_lost_again_and_again_is_kept_out_until_it_stays():
    from elastic_mnist.resilience.flapping import Flapping

    now = [0.0]
    flaps = Flapping(tries=3, window_s=100, quiet_s=20, clock=lambda: now[0])
    for join in range(3):  # admitted three times, lost each time
        assert flaps.admissible(7, join)
        flaps.admitted(7, join)
        now[0] += 10
    assert not flaps.admissible(7, 3)  # the fourth: kept out
    assert flaps.admissible(8, 0)  # another node is not
    now[0] += 15
    assert not flaps.admissible(7, 4)  # lost again: it asks anew, and waits anew
    now[0] += 15
    assert not flaps.admissible(7, 4)
    now[0] += 5
    assert flaps.admissible(7, 4)  # 20 s waiting, unbroken: let in
    flaps.admitted(7, 4)
    now[0] += 100  # the window passed: admitted at once again
    assert flaps.admissible(7, 5)


def test_where_steps_are_slow_the_wait_must_be_longer_than_two_of_them():
    w = Watch(rank=0)
    w.watch.slowest_step_s = lambda: 3.0  # many ranks on few cores: pulses starve too
    w.silent, w.stalled = {2}, 5.0
    w.watch.start()
    try:
        wait_for(lambda: w.looks >= 5)
        assert w.declared == []
        w.stalled = 6.5
        wait_for(lambda: w.declared)
    finally:
        w.stop.set()


def test_a_node_cut_off_from_its_peers_is_named_once_the_nodes_have_tried():
    """Its pulses go on (it reaches the store), so no silence: what the nodes found as they
    tried each other names it, counted from the moment the wait was long enough to try."""
    w = Watch(rank=0)
    asked: list[float | None] = []

    def cut(trying_s):
        asked.append(trying_s)
        return ([4, 5], "cut off from its peers") if trying_s is not None and trying_s >= 0.5 \
            else ([], "")

    w.watch.cut = cut
    w.stalled = 0.5  # too short a wait to try
    w.watch.start()
    try:
        wait_for(lambda: len(asked) >= 3)
        assert w.declared == [] and set(asked) == {None}
        w.stalled = silence.STALL_S + 0.6
        wait_for(lambda: w.declared)
        assert w.declared == [([4, 5], "cut off from its peers")]
        assert 0.5 <= asked[-1] < 0.7
    finally:
        w.stop.set()


def test_a_prober_on_the_node_cut_off_leaves_the_verdict_to_the_other():
    w = Watch(rank=5)
    w.watch.cut = lambda trying_s: ([4, 5], "cut off") if trying_s is not None else ([], "")
    w.stalled = silence.STALL_S + 1
    w.watch.start()
    try:
        wait_for(lambda: w.looks >= 5)
        assert w.declared == []
    finally:
        w.stop.set()


def test_a_join_that_stops_being_ready_waits_anew():
    from elastic_mnist.resilience.flapping import Flapping

    now = [0.0]
    flaps = Flapping(tries=1, window_s=100, quiet_s=20, clock=lambda: now[0])
    flaps.admitted(7, 0)
    assert not flaps.admissible(7, 1)
    now[0] += 15
    flaps.ready(set())  # lost again, or not reached: not ready at this look
    now[0] += 10
    flaps.ready({(7, 1)})
    assert not flaps.admissible(7, 1)  # 25 s since first seen, but only now ready again
    now[0] += 20
    assert flaps.admissible(7, 1)
