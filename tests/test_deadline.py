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
