"""The writers' fence is bounded and off the step's path (elastic_mnist/resilience/fence.py): a
store that does not answer holds a commit's check ASK_S at most and a step's not at all, the
checkpoint folder's copy of the generation decides meanwhile, and no lock is held while the
store is asked. In milliseconds, with reasons that block as a silent store does."""

from __future__ import annotations

import threading
import time

import pytest

from elastic_mnist.errors import EXIT_DROPPED, CannotTell
from elastic_mnist.resilience import fence as fence_module
from elastic_mnist.resilience.fence import Fence, FenceClosed, Over


class SilentStore:
    """A reason whose store does not answer until the test lets it."""

    def __init__(self):
        self.answer = threading.Event()
        self.asked = 0

    def __call__(self):
        self.asked += 1
        self.answer.wait()


def timed(call):
    began = time.monotonic()
    call()
    return time.monotonic() - began


def test_a_silent_store_holds_a_commit_ask_s_and_the_folder_decides(monkeypatch):
    monkeypatch.setattr(fence_module, "RECENT_S", 0.0)
    store, said = SilentStore(), []
    fence = Fence(store, fallback=lambda: said.append(1), ask_s=0.3)
    assert 0.3 <= timed(fence.check) < 1.0  # the commit goes on: the folder says nothing else
    assert timed(lambda: fence.check(recent=True)) < 0.05  # a step's: the question in flight
    assert timed(fence.check) < 0.05  # the question's bound is spent: the next commit waits no more
    assert store.asked == 1 and len(said) == 3  # one question at a time, answered by the file
    store.answer.set()
    time.sleep(0.05)
    assert timed(fence.check) < 0.1 and store.asked == 2  # answered again: asked again


def test_the_folder_can_drop_a_process_whose_store_is_silent():
    store, over = SilentStore(), []
    dropped = Over("rank 3 was dropped from the job at generation 1", EXIT_DROPPED)
    fence = Fence(store, fallback=lambda: dropped, on_over=over.append, ask_s=0.2)
    with pytest.raises(FenceClosed):
        fence.check()
    assert over == [dropped]
    store.answer.set()


def test_strict_asks_are_told_that_nobody_can_tell():
    store = SilentStore()

    def cannot_tell():
        raise CannotTell("the store does not answer, and generation.json says nothing")

    fence = Fence(store, fallback=cannot_tell, ask_s=0.2)
    with pytest.raises(CannotTell, match="generation.json"):
        fence.check(strict=True)
    fence.check()  # a commit goes on
    no_fallback = Fence(SilentStore(), ask_s=0.1)
    with pytest.raises(CannotTell, match="did not answer the fence within 0.1 s"):
        no_fallback.check(strict=True)
    store.answer.set()


def test_no_lock_is_held_while_the_store_is_asked(monkeypatch):
    monkeypatch.setattr(fence_module, "RECENT_S", 0.0)
    store = SilentStore()
    fence = Fence(store, fallback=lambda: None, ask_s=5.0)
    blocked = threading.Thread(target=fence.check)  # a commit waiting for the store
    blocked.start()
    time.sleep(0.1)
    # Meanwhile the training thread's every-step check and the watchdog's lock-free reads go on.
    assert timed(lambda: fence.check(recent=True)) < 0.05
    assert fence._lock.acquire(timeout=0.05)
    fence._lock.release()
    store.answer.set()
    blocked.join(timeout=2)
    assert not blocked.is_alive()


def test_an_over_found_by_a_question_nobody_waited_for_is_acted_on(monkeypatch):
    monkeypatch.setattr(fence_module, "RECENT_S", 0.0)
    answer, over = threading.Event(), []
    dropped = Over("rank 1 was dropped from the job at generation 2", EXIT_DROPPED)

    def slow_then_over():
        answer.wait()
        return dropped

    fence = Fence(slow_then_over, fallback=lambda: None, on_over=over.append, ask_s=0.1)
    fence.check()  # timed out: the folder said nothing, the write went on
    answer.set()
    time.sleep(0.1)
    with pytest.raises(FenceClosed):
        fence.check(recent=True)  # the late answer is not thrown away
    assert over == [dropped]


def test_a_node_cut_off_from_store_and_peers_leaves_as_the_folder_says_not_with_a_hang(
        monkeypatch, caplog):
    """make partitions' cut-60, on the cut node: its watchdog's heartbeat write waits on the
    silent store, and at the deadline its verdict ("the coordination store does not answer")
    asks the fence itself, not behind that write. The folder's generation.json says the job went
    on without it: it leaves with the fence's one line and EXIT_DROPPED, as its sibling's
    recovery does, and declares no hang (124)."""
    from elastic_mnist.env import DistEnv
    from elastic_mnist.resilience import watchdog

    class Silent:
        def __init__(self):
            self.answer = threading.Event()

        def set_timeout(self, timeout):
            pass

        def set(self, key, value):
            self.answer.wait()

        def compare_set(self, key, expected, desired):
            self.answer.wait()

    exited: list[int] = []
    monkeypatch.setattr(watchdog, "end_process", exited.append)
    monkeypatch.setattr(watchdog, "STORE_TIMEOUT", watchdog.timedelta(seconds=0.1))
    store, reason, left = Silent(), SilentStore(), []
    over = Over("rank 5 was dropped from the job at generation 0 (generation.json says the job "
                "is at 1; the coordination store does not answer): leaving without writing",
                EXIT_DROPPED)
    fence = Fence(reason, fallback=lambda: over, ask_s=0.2, on_over=left.append)
    dog = watchdog.Watchdog(DistEnv(rank=5, world_size=6, launched=True), store, floor_s=0.1,
                            report=lambda record: None, go_on_without=lambda ranks, why: None,
                            store_host=None, fence=fence)
    try:
        dog._publish()  # the heartbeat's write: held by the silent store
        assert dog._pending is not None and not dog._pending.done()
        dog._declare(watchdog.Verdict([], [], "the coordination store does not answer", {}))
        assert left == [over] and exited == []
        assert not [r for r in caplog.records if r.getMessage().startswith("hang: ")]
    finally:
        store.answer.set()
        reason.answer.set()
        dog.close()


def test_a_folder_that_does_not_answer_either_is_bounded_too(monkeypatch):
    """The store silent, and the checkpoint folder too (a mount the cut took): a commit's check
    waits ASK_S and then FALLBACK_S once, a step's check waits for neither in flight, and an
    "over" the folder finds late is acted on at the next check."""
    monkeypatch.setattr(fence_module, "FALLBACK_S", 0.3)
    monkeypatch.setattr(fence_module, "RECENT_S", 0.0)
    store, folder, left = SilentStore(), threading.Event(), []
    over = Over("rank 1 was dropped", EXIT_DROPPED)
    fence = Fence(store, fallback=lambda: folder.wait(10) and over, ask_s=0.2,
                  on_over=left.append)
    began = time.monotonic()
    with pytest.raises(CannotTell, match="the checkpoint folder not within 0.3 s"):
        fence.check(strict=True)
    assert 0.5 <= time.monotonic() - began < 1.0
    assert timed(lambda: fence.check(recent=True)) < 0.05  # both in flight: no wait
    folder.set()  # the folder answers: the job went on without this process
    time.sleep(0.05)
    with pytest.raises(FenceClosed):
        fence.check(recent=True)
    assert left == [over]
    store.answer.set()
