"""The node's record is written off the pulse's thread, and a write that a silent store holds
hands the next record to a fresh connection (elastic_mnist/resilience/speaker.py). In
milliseconds, with stores that answer, hang or fail as the test says."""

from __future__ import annotations

import threading
import time

from elastic_mnist.resilience import speaker as speaker_module
from elastic_mnist.resilience.speaker import Speaker


class Connection:
    def __init__(self, name: str, hold: threading.Event | None = None, fail: bool = False):
        self.name, self.hold, self.fail = name, hold, fail
        self.written: list[str] = []

    def set(self, key: str, value: str) -> None:
        if self.hold is not None:
            self.hold.wait()
        if self.fail:
            raise RuntimeError("Connection reset by peer")
        self.written.append(value)


def wait_for(condition, timeout=3.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_stuck_write_hands_the_next_records_to_a_fresh_connection(monkeypatch):
    monkeypatch.setattr(speaker_module, "STUCK_S", 0.1)
    held = threading.Event()
    first = Connection("first", hold=held)
    fresh = [Connection("fresh")]
    speaker = Speaker(first, "node/a", lambda: fresh[0])
    speaker.say("1,1")
    time.sleep(0.05)
    speaker.say("2,2")  # not stuck yet: waits its turn, replaced by the next
    speaker.say("3,3")
    assert first.written == [] and fresh[0].written == []
    time.sleep(0.15)
    began = time.monotonic()
    speaker.say("4,4")  # the write of "1,1" is stuck: the fresh connection takes "4,4"
    wait_for(lambda: fresh[0].written == ["4,4"])
    assert time.monotonic() - began < 0.5
    speaker.say("5,5")
    wait_for(lambda: fresh[0].written == ["4,4", "5,5"])
    held.set()  # the stuck write returns at last: its connection writes nothing more
    speaker.say("6,6")
    wait_for(lambda: fresh[0].written[-1] == "6,6")
    assert first.written == ["1,1"]
    speaker.close()


def test_a_broken_connection_is_replaced_and_a_store_away_is_tried_again(monkeypatch):
    monkeypatch.setattr(speaker_module, "STUCK_S", 0.05)
    opened: list[Connection] = []

    def fresh():
        if len(opened) < 2:  # the store is away for two tries
            opened.append(None)
            raise RuntimeError("Connection refused")
        opened.append(Connection("fresh"))
        return opened[-1]

    speaker = Speaker(Connection("broken", fail=True), "node/a", fresh)
    for n in range(40):
        speaker.say(f"{n}")
        time.sleep(0.02)
        if opened and opened[-1] is not None and opened[-1].written:
            break
    assert len(opened) == 3 and opened[-1].written  # two failed tries, then written
    speaker.close()
