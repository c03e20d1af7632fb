"""A node's relay: its survivors check in once and read the membership's record once, through
the node's board, and each does it itself whatever the relay fails to do."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from elastic_mnist.env import DistEnv
from elastic_mnist.resilience import relay as relay_module
from elastic_mnist.resilience.agreement import (
    Pulses,
    backup_watchers,
    check_in,
    close_membership,
    watchers,
)
from elastic_mnist.resilience.board import MAILBOX_BYTES, NodeBoard
from elastic_mnist.resilience.relay import (
    CONFIRM_S,
    GATHER_S,
    Relay,
    by_themselves,
    relay_of,
)

WORLD = 16
"""Two nodes of 8: the watchers are 0, 8 and 15, the backups 4, 6 and 12."""
NODE = range(8, 16)
POSITION = json.dumps({"step": 3, "mid_step": False, "evaluated_step": 0})


class Counted:
    """A store that notes each operation made through it."""

    def __init__(self, store):
        self.store, self.calls = store, []

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def call(*args, **kwargs):
            self.calls.append(name)
            return method(*args, **kwargs)

        return call


@pytest.fixture
def store():
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                    timeout=timedelta(seconds=30))


def env(rank: int) -> DistEnv:
    return DistEnv(rank=rank, world_size=WORLD, local_rank=rank - rank // 8 * 8,
                   local_world_size=8)


def relays(tmp_path) -> dict[int, Relay]:
    """The second node's workers, each with its own view of the node's board."""
    return {r: Relay(NodeBoard(tmp_path, "node", 8, r - 8)) for r in NODE}


def in_threads(work: dict[int, callable]) -> dict[int, object]:
    done: dict[int, object] = {}
    threads = [threading.Thread(target=lambda r=r, w=w: done.__setitem__(r, w()))
               for r, w in work.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return done


def test_a_mailbox_is_read_whole_by_the_siblings_and_never_half_written(tmp_path):
    mine, theirs = NodeBoard(tmp_path, "node", 2, 0), NodeBoard(tmp_path, "node", 2, 1)
    assert theirs.read(0) is None  # nothing posted yet
    assert mine.post({"g": 1, "rank": 0, "fault": "x"})
    assert theirs.read(0) == {"g": 1, "rank": 0, "fault": "x"} and theirs.read(1) is None
    assert not mine.post({"g": 1, "rank": 0, "big": "y" * MAILBOX_BYTES})  # does not fit ...
    assert theirs.read(0)["fault"] == "x"  # ... and the last one stays whole
    at = mine._mailboxes
    mine._map[at] += 1  # its writer stopped half way: the sequence number is odd
    assert theirs.read(0) is None
    # The slot's next worker (restarted into the job) writes from there: read whole again.
    assert mine.post({"g": 2, "rank": 0}) and theirs.read(0) == {"g": 2, "rank": 0}
    mine.post([1, 2])  # no message: never taken for one
    assert theirs.read(0) is None


def test_who_relays_for_a_node_and_who_agrees_by_itself():
    expected = set(range(WORLD))
    alone = by_themselves(expected)
    assert alone == set(watchers(expected)) | set(backup_watchers(expected)) \
        == {0, 4, 6, 8, 12, 15}
    assert [relay_of(env(r), expected) for r in NODE] == [None, 9, 9, 9, None, 9, 9, None]
    # Rank 9 hung: the watchers of the others are 0, 7 and 15, so rank 8 relays now; a
    # suspect relays for nobody, nor is relayed.
    hung = expected - {9}
    assert relay_of(env(10), hung) == 8 and relay_of(env(9), hung) is None


def test_a_nodes_survivors_check_in_once_and_take_the_record_from_their_relay(store, tmp_path):
    """The second node's five ranks that do not agree by themselves check in as one arrival,
    by their relay (rank 9); the watchers close the membership; rank 9 alone waits for the
    record and reads it, and the others take it from the board: one store operation for each
    of them, none."""
    expected, views = set(range(WORLD)), relays(tmp_path)
    ranks = [r for r in NODE if relay_of(env(r), expected) is not None]
    stores = {r: Counted(store.clone()) for r in ranks}
    in_threads({r: lambda r=r: views[r].check_in(stores[r], "g0/", env(r), 0, POSITION,
                                                  expected) for r in ranks})
    assert store.add("g0/arrivals", 0) == 1
    lines = store.get("g0/arrived/0").decode().splitlines()
    assert [int(line.split()[0]) for line in lines] == ranks
    assert stores[9].calls == ["add", "set"]
    assert all(stores[r].calls == [] for r in ranks if r != 9)
    for r in set(range(WORLD)) - set(ranks):  # the others, each by itself
        check_in(store, "g0/", r, POSITION)

    def record(r: int) -> dict:
        return views[r].record(env(r), 0, expected, 10, lambda: close_membership(
            stores[r], "g0/", expected, [], Pulses(store, {}, ("pulse", 0)), 10, rank=r))

    store.set("pulse", "1")  # the closer's own pulse, its clock
    closer = threading.Thread(target=lambda: close_membership(
        store.clone(), "g0/", expected, [], Pulses(store.clone(), {}, ("pulse", 0)), 10))
    for s in stores.values():
        s.calls.clear()
    closer.start()
    found = in_threads({r: lambda r=r: record(r) for r in ranks})
    closer.join(10)
    assert all(found[r]["members"] == list(range(WORLD)) for r in ranks)
    assert stores[9].calls == ["wait", "get"]
    assert all(stores[r].calls == [] for r in ranks if r != 9)


def test_siblings_check_in_themselves_when_their_relay_never_comes(store, tmp_path):
    """Rank 9, the relay, is lost before it checks in: each sibling checks itself in once it
    has waited GATHER_S + CONFIRM_S to be named."""
    expected, views = set(range(WORLD)), relays(tmp_path)
    siblings = [10, 11, 13, 14]
    start = time.monotonic()
    in_threads({r: lambda r=r: views[r].check_in(store, "g0/", env(r), 0, POSITION, expected)
                for r in siblings})
    assert time.monotonic() - start >= GATHER_S + CONFIRM_S
    arrived = [store.get(f"g0/arrived/{n}").decode() for n in range(store.add("g0/arrivals", 0))]
    assert sorted(int(line.split()[0]) for line in arrived) == siblings


def test_a_late_sibling_the_relay_did_not_name_checks_itself_in(store, tmp_path):
    """The relay checks in the siblings that posted within GATHER_S; one that posts later
    finds itself not named and checks itself in."""
    expected, views = set(range(WORLD)), relays(tmp_path)
    early = [9, 10, 11, 13]
    in_threads({r: lambda r=r: views[r].check_in(store, "g0/", env(r), 0, POSITION, expected)
                for r in early})
    views[14].check_in(store, "g0/", env(14), 0, POSITION, expected)
    arrived = [store.get(f"g0/arrived/{n}").decode().splitlines()
               for n in range(store.add("g0/arrivals", 0))]
    assert [[int(line.split()[0]) for line in lines] for lines in arrived] == [early, [14]]


def test_siblings_read_the_record_themselves_when_their_relay_cannot_or_falls_silent(
        tmp_path, monkeypatch):
    """A relay whose wait failed says so: its siblings read the record at once. A relay that
    fell silent (its pulse on the board stands still) is given up on after RELAY_SILENT_S."""
    monkeypatch.setattr(relay_module, "RELAY_SILENT_S", 0.3)
    expected, views = set(range(WORLD)), relays(tmp_path)
    closed = {"members": [9, 10]}
    views[9].post(0, 9, record=None)  # its own close raised: it posted that it could not
    start = time.monotonic()
    assert views[10].record(env(10), 0, expected, 10, lambda: closed) is closed
    assert time.monotonic() - start < 1
    views[9].post(1, 9, position=POSITION)  # in the next generation it freezes after checking in
    start = time.monotonic()
    assert views[10].record(env(10), 1, expected, 10, lambda: closed) is closed
    assert 0.3 <= time.monotonic() - start < 2
    # While its pulse moves, the siblings wait for it, and take what it posts.
    raising = threading.Event()

    def pulse() -> None:
        while not raising.wait(0.05):
            views[9].board.raise_pulse()

    threading.Thread(target=pulse, daemon=True).start()
    threading.Timer(0.6, lambda: views[9].post(2, 9, record={"members": "9-15"})).start()
    views[9].post(2, 9, position=POSITION)
    got = views[10].record(env(10), 2, expected, 10, lambda: pytest.fail("read it itself"))
    raising.set()
    assert got["members"] == list(range(9, 16))


def test_woken_siblings_take_the_fault_their_first_rank_read(tmp_path):
    """The node's first rank reads the fault and posts it; its siblings, woken with it, take it
    from the board; where it posts nothing (it is the hung one), they read it themselves once
    FAULT_WAIT_S has passed (a sibling that finds it posted by another by then takes it)."""
    views = relays(tmp_path)
    reads: list[int] = []

    def read(r: int):
        return lambda: reads.append(r) or b'{"why": "hung"}'

    found = in_threads({r: lambda r=r: views[r].fault(0, r, r == 8, read(r)) for r in NODE})
    assert set(found.values()) == {'{"why": "hung"}'} and reads == [8]
    found = in_threads({r: lambda r=r: views[r].fault(1, r, r == 8, read(r))
                        for r in NODE if r != 8})
    assert set(found.values()) == {'{"why": "hung"}'} and len(found) == 7
    assert 8 not in reads[1:] and 1 <= len(reads[1:]) <= 7


def test_a_late_word_on_a_generation_that_is_over_changes_nothing(tmp_path):
    views = relays(tmp_path)
    views[9].post(3, 9, position=POSITION)
    views[9].post(2, 9, fault="late")  # a wake-up thread of generation 2, late
    assert views[10].board.read(1) == {"g": 3, "rank": 9, "position": POSITION}


def test_a_sibling_stops_waiting_for_a_live_relay_that_went_on_or_never_posts_the_record(
        tmp_path):
    """The relay posts for the next generation already (it had the record, and went on): its
    sibling reads the record itself at once. A relay alive on the board that never posts it
    (its trainer held elsewhere) is waited for as long as a rank waits for the watchers,
    limit_s + 1, not to the bound."""
    expected, views = set(range(WORLD)), relays(tmp_path)
    closed = {"members": [9, 10]}
    raising = threading.Event()

    def pulse() -> None:
        while not raising.wait(0.05):
            views[9].board.raise_pulse()

    threading.Thread(target=pulse, daemon=True).start()
    views[9].post(4, 9, position=POSITION)
    threading.Timer(0.3, lambda: views[9].post(5, 9, fault="the next one")).start()
    start = time.monotonic()
    assert views[10].record(env(10), 4, expected, 10, lambda: closed) is closed
    assert time.monotonic() - start < 1.5
    views[9].post(6, 9, position=POSITION)
    start = time.monotonic()
    assert views[10].record(env(10), 6, expected, 0.5, lambda: closed) is closed
    raising.set()
    assert 1.5 <= time.monotonic() - start < 3
