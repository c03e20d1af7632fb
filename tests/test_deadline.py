"""The change's bound (elastic_mnist/resilience/deadline.py): one timer a change, whichever
thread begins it; a replaced or disarmed timer ends nothing; a declaration that fails leaves no
bound behind. In milliseconds."""

from __future__ import annotations

import threading
import time

import pytest

from elastic_mnist.resilience.deadline import Deadline


def test_the_first_to_arm_starts_the_bound_and_only_it_can_end_the_process():
    fired: list[str] = []
    deadline = Deadline(lambda: 0.2, lambda: fired.append("expired"))
    armed = []
    threads = [threading.Thread(target=lambda: armed.append(deadline.arm())) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(armed) == [False] * 7 + [True]  # one timer, however many threads begin it
    deadline.disarm()
    deadline.arm()  # the next change's
    time.sleep(0.35)
    assert fired == ["expired"]  # the next change's timer only
    deadline.disarm()


def test_a_timer_replaced_meanwhile_ends_nothing():
    """A stale timer firing in its own thread (cancel raced its expiry) ends nothing; the
    current one does."""
    fired: list[str] = []
    deadline = Deadline(lambda: 10, lambda: fired.append("expired"))
    deadline.arm()
    stale = threading.Timer(0, deadline._fire)  # a timer of an earlier arming, firing late
    stale.start()
    stale.join()
    assert fired == []
    deadline.timer.cancel()
    threading.Thread(target=deadline.timer.function).start()  # not a timer's thread: a test's
    time.sleep(0.1)
    assert fired == ["expired"]
    deadline.disarm()


def test_a_failed_declaration_keeps_its_bound_and_the_jobs_end_closes_it():
    """A declaration whose store is gone keeps the bound it started (the process leaves at it,
    in one line); once the job has no step left, nothing arms a bound again."""
    deadline = Deadline(lambda: 10, lambda: None)
    with pytest.raises(RuntimeError):
        deadline.during(lambda: (_ for _ in ()).throw(RuntimeError("store reset")))
    assert deadline.timer is not None
    assert deadline.during(lambda: "agreed") == "agreed"
    deadline.close()
    assert deadline.timer is None and not deadline.arm() and deadline.timer is None


def test_a_change_waits_for_a_store_that_went_away_bounded_and_said(monkeypatch, caplog):
    """store_wait.py: at the bound, a store that does not answer a fresh connection keeps the
    change waiting, a step at a time, said once; once heard again, one step more for the calls
    it held, then the bound ends it. A store that never comes back: STORE_WAIT_S from the
    change's start at most. A store that answers all along: the bound as it was."""
    from elastic_mnist.resilience import store_wait

    monkeypatch.setattr(store_wait, "EXTEND_S", 0.1)
    monkeypatch.setattr(store_wait, "PROBE_S", 0.05)
    away = threading.Event()
    away.set()

    def probe():
        if away.is_set():
            time.sleep(1)  # a silent store: held past PROBE_S

    def run(wait_s: float, back_after_s: float | None) -> float:
        monkeypatch.setattr(store_wait, "STORE_WAIT_S", wait_s)
        ended = threading.Event()
        waits = store_wait.StoreWait(probe)
        deadline = Deadline(lambda: 0.1, lambda: None if waits.extends(deadline) else ended.set())
        began = time.monotonic()
        deadline.arm()
        if back_after_s is not None:
            time.sleep(back_after_s)
            away.clear()
        assert ended.wait(5)
        return time.monotonic() - began

    away.clear()
    assert run(10, None) < 0.2  # answers: the bound as it was
    away.set()
    took = run(10, 0.6)  # back 0.6 s in: one step more after it, then the bound
    assert 0.6 < took < 1.0
    away.set()
    took = run(0.5, None)  # never back
    assert 0.5 <= took < 0.8
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 2 and said[0].startswith("the coordination store does not answer: the "
                                                 "recovery waits for it, up to 10 s")
