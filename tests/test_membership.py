"""The membership protocol's pieces, on real TCPStores and real futures, in one process: who closes
the membership and when, how the survivors are renumbered, collectives given up on, torchrun's
own records read and written as its agents do. The whole of it, with real torchrun agents and
real signals, is tests/test_multinode.py."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import json
import os
import pickle
import re
import socket
import threading
import time
import types
from pathlib import Path

import psutil
import pytest
import torch
from test_faults import state
from torch.distributed import PrefixStore, TCPStore

from elastic_mnist.checkpointer import Checkpointer
from elastic_mnist.env import DistEnv, rendezvous_of, why_no_rendezvous
from elastic_mnist.errors import EXIT_DROPPED, EXIT_GAVE_UP, Dropped, PeerFailure
from elastic_mnist.events import EventLog, read_events
from elastic_mnist.resilience.agreement import (
    PULSE_S,
    UNKNOWN,
    Fault,
    Identity,
    Pulses,
    backup_watchers,
    close_membership,
    declare_fault,
    decode_ranks,
    encode_ranks,
    node_sizes,
    placed_env,
    pulse_key,
    successor_env,
    watchers,
    whole_nodes,
)
from elastic_mnist.resilience.agreement import check_in as survivor_checks_in
from elastic_mnist.resilience.board import NodeBoard
from elastic_mnist.resilience.fence import Fence, FenceClosed, Over
from elastic_mnist.resilience.lease import LeaseKeeper
from elastic_mnist.resilience.lease_record import JobIdentity, read_lease
from elastic_mnist.resilience.membership import Membership
from elastic_mnist.resilience.torchrun_agents import arrive_at_exit_barrier, rendezvous_round
from elastic_mnist.trainer import StepFlags

TIMEOUT = datetime.timedelta(seconds=10)
DROPPED_LINE = ("rank 1 was dropped from the job at generation 0 (the job is at 1): leaving "
                "without writing")


@pytest.fixture
def store() -> TCPStore:
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)


def own_board(folder: Path, rank: int) -> NodeBoard:
    """A board of its own for ``rank``, as if each rank of this one process ran on a node of its
    own (the default board is its agent's: the test process's parent, for every rank here)."""
    return NodeBoard(folder / f"node-of-rank-{rank}", "board", 1, 0)


@pytest.fixture
def members(store, tmp_path):
    """Memberships of ranks of one generation, closed at the end (their watchers stop)."""
    made: list[Membership] = []

    def make(rank: int = 0, world_size: int = 2, pg_timeout_s: float = 10) -> Membership:
        env = DistEnv(rank=rank, world_size=world_size, launched=True)
        made.append(Membership(env, torch.device("cpu"), PrefixStore("launch", store.clone()),
                               generation=0, pg_timeout_s=pg_timeout_s, bound_s=60,
                               board=own_board(tmp_path, rank)))
        return made[-1]

    yield make
    for member in made:
        member.close()
    # A recovery's step given up on (a group's creation waiting for a rank that never comes)
    # ends at the group's timeout; one still blocked in gloo when pytest exits aborts it
    # (std::terminate, status 134) as the timeout fires during the interpreter's shutdown.
    for thread in threading.enumerate():
        if thread.name.startswith("membership-g"):
            thread.join(max(m.pg_timeout.total_seconds() for m in made) + 5 if made else 0)


def check_in(store, rank: int) -> None:
    survivor_checks_in(store, "g0/", rank, "{}")


@pytest.fixture
def pulses(store):
    """Ranks' pulses in ``store`` as their processes raise them (rank 0's is the reader's own):
    ``beating(rank, ...)`` starts raising them, every PULSE_S until the test ends; a rank never
    started has a pulse that stands still."""
    stop = threading.Event()
    beating: set[int] = set()
    for rank in range(4):
        store.add(f"pulse/{rank}", 1)

    def beat() -> None:
        connection = store.clone()
        while not stop.wait(PULSE_S):
            for rank in list(beating):
                connection.add(f"pulse/{rank}", 1)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    # Opened here, not in the tests' timed windows: the store's server looks up the name of each
    # client that connects, and a lookup the resolver drops stalls it for 5 s (README).
    reader = store.clone()

    def start(*ranks: int) -> Pulses:
        beating.update(ranks)
        # A record of one slot per rank (a node of one worker each), raised by ``add``.
        return Pulses(reader, {r: (f"pulse/{r}", 0) for r in range(4)}, ("pulse/0", 0))

    yield start
    stop.set()
    thread.join()


def test_the_membership_closes_at_once_when_every_expected_rank_has_come(store, pulses):
    for rank in (0, 1, 3):
        check_in(store, rank)
    start = time.monotonic()
    members = close_membership(store, "g0/", expected={0, 1, 3}, excluded=[2],
                               pulses=pulses(0, 1, 3), limit_s=30)["members"]
    assert members == [0, 1, 3] and time.monotonic() - start < 5  # not the limit


def test_the_dead_are_left_out_once_their_pulses_stop(store, pulses):
    check_in(store, 0)
    late = threading.Timer(0.3, check_in, (store.clone(), 2))
    late.start()
    start = time.monotonic()
    members = close_membership(store, "g0/", expected={0, 1, 2, 3}, excluded=[],
                               pulses=pulses(0, 2), limit_s=30)["members"]
    late.join()
    assert members == [0, 2]  # 1 and 3 never came, and their pulses stand still
    assert time.monotonic() - start < 3  # SILENT_PULSES of the reader's own, not the limit
    check_in(store, 1)  # too late: the membership is closed, and the same for everyone
    assert close_membership(store.clone(), "g0/", {0, 1, 2, 3}, [], pulses(),
                            30)["members"] == [0, 2]


def test_a_live_rank_busy_with_its_own_work_is_waited_for(store, pulses):
    """A survivor still evaluating, saving or recompiling when the others check in comes
    seconds later: its pulse moves, so it is kept, even though its pulse thread, starved of
    CPU (4 nodes × 8 workers on 2 cores), stood still for its first second; the dead one (3)
    is not waited for."""
    check_in(store, 0)
    starved = threading.Timer(1.0, pulses, (1,))  # its pulse moves again after a second
    busy = threading.Timer(2.0, check_in, (store.clone(), 1))
    starved.start()
    busy.start()
    start = time.monotonic()
    members = close_membership(store, "g0/", expected={0, 1, 3}, excluded=[2],
                               pulses=pulses(0), limit_s=30)["members"]
    starved.join()
    busy.join()
    assert members == [0, 1] and 2.0 <= time.monotonic() - start < 5


def test_a_live_rank_that_never_comes_is_left_out_at_the_limit(store, pulses):
    check_in(store, 0)
    start = time.monotonic()
    members = close_membership(store, "g0/", expected={0, 1}, excluded=[],
                               pulses=pulses(0, 1), limit_s=1.5)["members"]
    assert members == [0] and 1.5 <= time.monotonic() - start < 4


def test_after_the_store_was_away_every_rank_is_heard_afresh(store):
    """The store back after an outage: the reader's own node record comes back first, its
    pulse jumped by the outage's pulses (300 here); another node's comes back a moment later.
    That rank is not silent at once, only once the reader's own moved SILENT_PULSES more."""
    from elastic_mnist.resilience.agreement import SILENT_PULSES

    for rank in (0, 1):
        store.add(f"pulse/{rank}", 1)
    pulses = Pulses(store, {r: (f"pulse/{r}", 0) for r in (0, 1)}, ("pulse/0", 0))
    assert pulses.silent() == set()
    store.add("pulse/0", 300)  # the reader's record, written again after the outage
    assert pulses.silent() == set()  # rank 1's record is not back yet: heard afresh
    store.add("pulse/0", SILENT_PULSES)
    assert pulses.silent() == {1}  # still not back: silent


def test_a_look_that_waited_for_the_store_counts_not_against_the_limit(store, pulses,
                                                                        monkeypatch):
    """The store away during a look (0.8 s here, over AWAY_S's 0.5; its check-ins held with it,
    store_wait.py): the limit (0.6 s) runs on from where it stood, so the survivor whose
    check-in the outage held, heard just after it, is kept instead of left out by a limit that
    ran out meanwhile."""
    from elastic_mnist.resilience import agreement

    monkeypatch.setattr(agreement, "AWAY_S", 0.5)
    check_in(store, 0)

    class AwayOnce:  # the first look's add waits, as on a connection the store left
        def __init__(self):
            self.away = True

        def __getattr__(self, name):
            return getattr(store, name)

        def add(self, key, value):
            if self.away:
                self.away = False
                time.sleep(0.8)
                threading.Timer(0.2, check_in, (store.clone(), 1)).start()  # heard after it
            return store.add(key, value)

    members = close_membership(AwayOnce(), "g0/", expected={0, 1}, excluded=[],
                               pulses=pulses(0, 1), limit_s=0.6)["members"]
    assert members == [0, 1]


def test_an_arrival_lost_before_it_named_itself_hides_none_after_it(store, pulses):
    """Rank 1 counts itself among the arrivals and is lost before it writes its name: the
    ranks that come after it are read all the same (its pulse stops: it is left out), and the
    one that comes late, while the others already look, is read at its arrival."""
    check_in(store, 0)
    store.add("g0/arrivals", 1)  # rank 1's count, never its name
    check_in(store, 2)
    late = threading.Timer(0.3, check_in, (store.clone(), 3))
    late.start()
    start = time.monotonic()
    members = close_membership(store, "g0/", expected={0, 1, 2, 3}, excluded=[],
                               pulses=pulses(0, 2, 3), limit_s=30)["members"]
    late.join()
    assert members == [0, 2, 3] and time.monotonic() - start < 5  # 1's silence, not the limit


def test_an_arrival_that_names_itself_late_is_read_when_it_does(store, pulses):
    """Rank 1 counts itself among the arrivals and, starved of CPU, writes its name only later:
    its pulse moves, so the others wait for it, and read it at its name, not at the limit."""
    check_in(store, 0)
    store.add("g0/arrivals", 1)  # rank 1's count; its name comes 0.5 s later
    named = threading.Timer(0.5, store.clone().set, ("g0/arrived/1", "1 {}"))
    named.start()
    start = time.monotonic()
    members = close_membership(store, "g0/", expected={0, 1}, excluded=[],
                               pulses=pulses(0, 1), limit_s=30)["members"]
    named.join()
    assert members == [0, 1] and time.monotonic() - start < 5


def test_a_rank_named_in_the_fault_is_left_out_even_if_it_comes(store, pulses):
    for rank in (0, 1):
        check_in(store, rank)
    assert close_membership(store, "g0/", expected={0}, excluded=[1], pulses=pulses(0, 1),
                            limit_s=30)["members"] == [0]


def test_only_the_watchers_look_and_every_other_survivor_takes_their_record(store, pulses):
    """Of 5 survivors, ranks 0, 2 and 4 watch; rank 1 waits for their record, then reads it: two
    operations (it never looks at the check-ins, nor reads a pulse), and takes what the watcher
    decided."""
    assert watchers({0, 1, 2, 3, 4}) == [0, 2, 4] and watchers([7]) == [7]
    counted = CountingStore(store.clone())
    waiting: list[dict] = []
    follower = threading.Thread(target=lambda: waiting.append(close_membership(
        counted, "g0/", {0, 1, 2, 3, 4}, [], pulses(0, 1, 2, 3, 4), limit_s=30, rank=1)))
    follower.start()
    for rank in range(5):
        check_in(store, rank)
    decided = close_membership(store, "g0/", {0, 1, 2, 3, 4}, [], pulses(0, 1, 2, 3, 4),
                               limit_s=30, rank=4,
                               decide=lambda members, _: {"members": members[:-1], "step": 7})
    follower.join(10)
    assert decided == waiting[0] == {"members": [0, 1, 2, 3], "step": 7}
    assert counted.calls == ["wait", "get"]


def test_the_first_declarer_wakes_every_rank_and_a_later_one_looks_that_it_did(store,
                                                                              monkeypatch):
    """The first declaration writes every rank's wake key, then ``woken``; a later one (a
    watcher, or a rank that found the fault itself: a woken rank declares nothing) returns the
    first's fault in two operations, looking that the waking was done (and does it itself where
    the first was lost between its writes)."""
    first = CountingStore(store.clone())
    assert declare_fault(first, "g0/", 4, '{"by": 1}') == '{"by": 1}'
    assert first.calls == ["compare_set", "multi_set", "set"]
    assert store.multi_get([f"g0/wake/{r}" for r in range(4)]) == [b"fault"] * 4
    later = CountingStore(store.clone())
    assert declare_fault(later, "g0/", 4, '{"by": 3}') == '{"by": 1}'
    assert later.calls == ["compare_set", "check"]
    store.compare_set("g1/fault", "", '{"by": 1}')  # the first lost before it woke anyone
    lost = CountingStore(store.clone())
    monkeypatch.setattr("elastic_mnist.resilience.agreement.WOKEN_WAIT",
                        datetime.timedelta(seconds=0.2))
    assert declare_fault(lost, "g1/", 2, '{"by": 0}') == '{"by": 1}'
    assert store.multi_get(["g1/wake/0", "g1/wake/1", "g1/woken"]) == [b"fault", b"fault", b"1"]


def test_the_backups_close_the_membership_when_no_watcher_does(store, pulses):
    """Of 7 survivors, the watchers 0, 3 and 6 are lost: the backups (1, 2 and 5) close it a
    second past the limit; rank 4 waits for their record, never reading the check-ins itself."""
    expected = set(range(7))
    assert watchers(expected) == [0, 3, 6] and backup_watchers(expected) == [1, 2, 5]
    for rank in (1, 2, 4, 5):
        check_in(store, rank)
    counted = CountingStore(store.clone())
    waiting: list[dict] = []
    follower = threading.Thread(target=lambda: waiting.append(close_membership(
        counted, "g0/", expected, [], pulses(1, 2), limit_s=1, rank=4)))
    follower.start()
    start = time.monotonic()
    assert close_membership(store, "g0/", expected, [], pulses(1, 2), limit_s=1,
                            rank=5)["members"] == [1, 2, 4, 5]
    assert 2 <= time.monotonic() - start < 10
    follower.join(10)
    assert waiting == [{"members": [1, 2, 4, 5]}]
    assert counted.calls == ["wait", "wait", "get"]


def test_the_backups_are_on_other_nodes_than_the_watchers():
    """Ranks are numbered node by node: the watchers' neighbours share their nodes and fall
    with them. From five nodes of a size on, the backups are on other nodes (two of them at
    five, the two nodes the watchers leave), from six on, on three."""
    for nodes in (5, 6, 7, 9, 125, 1000):
        for size in (1, 2, 8):
            ranks = range(nodes * size)
            first = {r // size for r in watchers(ranks)}
            backups = {r // size for r in backup_watchers(ranks)}
            assert not first & backups and len(backups) == (2 if nodes < 6 else 3), \
                (nodes, size, first, backups)


def test_a_membership_is_written_as_its_runs_of_ranks():
    for ranks in ([], [3], [0, 1, 2, 5, 7, 8], list(range(8000))):
        assert decode_ranks(encode_ranks(ranks)) == ranks
    assert encode_ranks([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


class CountingStore:
    """A store that notes the name of every call made on it."""

    def __init__(self, store):
        self.store, self.calls = store, []

    def __getattr__(self, name):
        self.calls.append(name)
        return getattr(self.store, name)


def test_survivors_are_renumbered_in_the_order_of_their_old_ranks():
    identities = {rank: Identity(host, 100 + rank, agent, local)
                  for rank, (host, agent, local) in enumerate(
                      [("a", 10, 0), ("a", 10, 1), ("b", 20, 0), ("b", 20, 1), ("c", 30, 0)])}
    env = DistEnv(rank=4, world_size=5, local_rank=0, local_world_size=1, group_rank=2,
                  group_world_size=3, launched=True)
    new = successor_env(env, [1, 4], identities)  # node b and rank 0 lost
    assert (new.rank, new.world_size, new.local_rank, new.local_world_size) == (1, 2, 0, 1)
    assert (new.group_rank, new.group_world_size, new.launched) == (1, 2, True)
    first = successor_env(DistEnv(rank=1, world_size=5, local_rank=1, local_world_size=2,
                                  launched=True), [1, 4], identities)
    assert (first.rank, first.local_rank, first.local_world_size, first.is_main) == (0, 0, 1, True)


def test_each_survivor_finds_its_place_from_the_nodes_sizes_as_from_every_identity():
    """The watcher's record carries the kept nodes' sizes as runs; each survivor's place from
    them is the one every identity gives, for every member of every layout (nodes of unequal
    sizes, whole nodes lost, a rank lost mid-node). A node whose ranks are not numbered
    together has no sizes: the survivors then read the identities."""
    layouts = [[("a", 2), ("b", 2), ("c", 1)], [("a", 8)] * 1 + [("b", 8), ("c", 7), ("d", 8)],
               [("a", 3), ("b", 1), ("c", 3), ("d", 3)]]
    for layout in layouts:
        identities = {}
        for agent, (host, size) in enumerate(layout, start=1):
            for local in range(size):
                identities[len(identities)] = Identity(host, 1000 + len(identities), agent, local)
        world = len(identities)
        for lost in ([], [0], [world - 1], [1, 2], list(range(layout[0][1]))):
            members = [r for r in range(world) if r not in lost]
            sizes = node_sizes(members, identities)
            assert sizes is not None and sum(s * n for s, n in sizes) == len(members)
            for rank in members:
                env = DistEnv(rank=rank, world_size=world, launched=True)
                assert placed_env(env, members, sizes) == successor_env(env, members, identities)
    assert node_sizes(list(range(16)), {r: Identity("h", r, 1 + r // 8, r % 8)
                                        for r in range(16)}) == [[8, 2]]
    mixed = {0: Identity("a", 1, 1, 0), 1: Identity("b", 2, 2, 0), 2: Identity("a", 3, 1, 1)}
    assert node_sizes([0, 1, 2], mixed) is None
    with pytest.raises(ValueError, match="not one of the members"):
        placed_env(DistEnv(rank=1, world_size=3), [0, 2], [[1, 2]])


def test_the_survivors_of_a_death_go_on_without_the_dead_ranks_whole_node():
    """A worker that died takes its node's other workers with it (their agent restarts them all),
    where ranks that hung or left, named in the fault, take nobody."""
    identities = {rank: Identity(host, 100 + rank, agent, local)
                  for rank, (host, agent, local) in enumerate(
                      [("a", 10, 0), ("b", 20, 0), ("b", 20, 1), ("c", 30, 0), ("c", 30, 1)])}
    died = Fault("died", [], 0, "", 0.0)
    assert whole_nodes([0, 1, 3, 4], identities, died, 5) == [0, 3, 4]  # rank 2 died
    assert whole_nodes([0, 1, 2, 3], identities, Fault("died", [4], 0, "", 0.0), 5) == [0, 1, 2]
    for why in ("hung", "left"):  # the named ranks alone; a rank that died besides them counts
        named = Fault(why, [2], 0, "", 0.0)
        assert whole_nodes([0, 1, 3, 4], identities, named, 5) == [0, 1, 3, 4]
        assert whole_nodes([0, 1, 3], identities, named, 5) == [0, 1]
    unknown = {**identities, 2: UNKNOWN}  # lost before it said who it was: no node to name
    assert whole_nodes([0, 1, 3, 4], unknown, died, 5) == [0, 1, 3, 4]


def test_a_declared_fault_fails_every_pending_and_later_wait(members):
    mine, theirs = members(0), members(1)
    pending = torch.futures.Future()
    guarded = mine.guard(pending)
    fault = theirs.declare("hung", [1], "no heartbeat")
    assert mine.declare("died", [], "late") == fault  # the first declaration stands
    with pytest.raises(PeerFailure, match="hung"):
        guarded.wait()  # the watcher gave up on it: the collective itself never returned
    with pytest.raises(PeerFailure):
        mine.guard(torch.futures.Future())
    pending.set_result([torch.ones(1)])  # the abandoned collective ending later changes nothing
    assert isinstance(fault, Fault) and fault.suspects == [1]


def test_a_woken_rank_declares_nothing_more_and_a_watcher_confirms(members):
    """Of 4 ranks (watchers 0, 2, 3), rank 1, woken by rank 0's declaration, has the one fault
    without a store operation (every rank's compare_set was W in the fault's busiest second);
    the watcher 2, woken too, still declares, and confirms that every rank was woken."""
    ranks = [members(r, world_size=4) for r in range(4)]
    assert watchers(range(4)) == [0, 2, 3]
    fault = ranks[0].declare("died", [3], "connection closed")
    deadline = time.monotonic() + 10
    while any(m.faulted is None for m in ranks[1:3]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ranks[1].faulted == ranks[2].faulted == fault  # woken: their watchers read it
    counted = {r: CountingStore(ranks[r].connections.declare) for r in (1, 2)}
    for r, store in counted.items():
        object.__setattr__(ranks[r].connections, "declare", store)
        assert ranks[r].declare("died", [], "late") == fault
    assert [c for c in counted[1].calls if c != "set"] == []  # its pulse's sets aside
    # The watcher found every rank woken at its first look: no waking of its own.
    assert [c for c in counted[2].calls if c != "set"] == ["compare_set", "check"]


def test_the_watchers_read_the_identities_as_their_generation_begins(members):
    """The watchers (0, 2 and 3 of 4) read every rank's identity once all have said who they
    are, before any fault: a recovery then reads the lost node's pulses from its first look.
    The others never read them unless a recovery needs them."""
    ranks = [members(r, world_size=4) for r in range(4)]
    deadline = time.monotonic() + 10
    while not all(ranks[r].known.ready for r in (0, 2, 3)) and time.monotonic() < deadline:
        time.sleep(0.01)
    for r in (0, 2, 3):
        assert ranks[r].known.ready and ranks[r].known.generation == 0
        assert {rank: i.nonce for rank, i in ranks[r].known.read().items()} == {
            rank: m.identity.nonce for rank, m in enumerate(ranks)}
        assert UNKNOWN not in ranks[r].known.values()
    assert not ranks[1].known.ready


def test_a_watcher_recovers_with_the_identities_it_read_ahead_and_passes_them_on(members):
    """Rank 1 of 2 read the identities as the generation began; rank 0 leaves. Rank 1's
    recovery decides from them, never reading them, and the next generation has them from it,
    with no read."""
    from elastic_mnist.resilience import agreement

    lost, survivor = members(0), members(1)
    deadline = time.monotonic() + 10
    while not survivor.known.ready and time.monotonic() < deadline:
        time.sleep(0.01)
    assert survivor.known.ready
    lost.close()  # it left: it never checks in
    reads: list[int] = []
    read = survivor.identities
    survivor.identities = lambda *args, **kwargs: reads.append(1) or read(*args, **kwargs)
    with no_group_left():
        change = survivor.recover(agreement.Position(step=3, mid_step=False, evaluated_step=0),
                                  why="left", suspects=(0,))
    assert (change.env.world_size, change.lost[0]["rank"]) == (1, 0)
    assert reads == []
    assert survivor.known.generation == 1 and survivor.known.ready
    assert survivor.known[0].nonce == survivor.identity.nonce


def test_a_verdict_on_a_generation_that_is_over_is_dropped(store, members):
    """The watchdog declares through ``declare`` bound to the generation it watched (duties.py): a
    verdict reached there and delivered after a recovery moved on names ranks of a group that is
    gone, and is dropped, instead of dropping healthy ranks of the new one."""
    mine, theirs = members(0), members(1)
    verdict = functools.partial(mine.declare, "hung", generation=mine.generation)
    for member in (mine, theirs):  # a recovery completes meanwhile
        member.declare("died", [])
        member.generation += 1
        member._start_generation()
    assert verdict([1], "no heartbeat") is None
    assert not store.check(["launch/g1/fault"]) and not store.check(["launch/g1/wake/1"])
    assert verdict.func("hung", [1], generation=1).suspects == [1]  # its own generation's: kept


def test_a_fallback_to_a_restart_says_in_which_phase_and_why(store, members, monkeypatch,
                                                            caplog):
    """A recovery that cannot complete a step within its bound leaves (torchrun restarts the job)
    with one line and one ``fallback`` record naming the phase that failed and why. A rank the
    others went on without did not fall back: it is dropped (EXIT_DROPPED, the fence's line),
    with no record, and no give-up follows it."""
    from elastic_mnist.resilience import agreement, recovery

    left: list[int] = []
    monkeypatch.setattr(recovery, "end_process", left.append)
    mine, theirs = members(0), members(1)
    written: list[dict] = []
    for member in (mine, theirs):
        member.on_fallback = written.append
    mine.recovery.phase = "creating the new group"
    mine.recovery.failure = "creating the new group: no pulse"
    mine.recovery.deadline.armed_at = time.monotonic() - 60  # the change began 60 s ago
    mine.recovery._give_up()
    assert left == [EXIT_GAVE_UP]
    assert written[0]["phase"] == "creating the new group"
    assert written[0]["reason"].startswith("no step completed within 60 s of the fault (the last "
                                           "round failed creating the new group: no pulse")
    # Rank 0 closed the membership without rank 1.
    store.set("launch/g0/members", json.dumps({"members": "0", "step": 3}))
    with pytest.raises(Dropped) as e:
        theirs.recover(agreement.Position(step=3, mid_step=False, evaluated_step=0))
    assert (str(e.value), e.value.exit_code) == (DROPPED_LINE, EXIT_DROPPED)
    assert theirs.recovery.deadline.timer is None  # no give-up, no record
    assert len(written) == 1
    lines = [r.getMessage() for r in caplog.records
             if "recovery in process failed" in r.getMessage()]
    assert len(lines) == 1


def test_a_declaration_the_store_does_not_answer_ends_at_the_changes_bound(members, monkeypatch,
                                                                          caplog):
    """The watchdog's verdict on a hung peer, while the coordination store does not answer: the
    declaration waits for it (TCP's own give-up is about 15 minutes away), and the training
    thread, in the hung collective, is never woken to recover. The change's bound runs from the
    declaration: at it, this rank falls back in one line (EXIT_GAVE_UP), and nothing holds it
    longer. A membership closed at the job's end has no bound left to end it."""
    from elastic_mnist.resilience import recovery

    left: list[int] = []
    monkeypatch.setattr(recovery, "end_process", left.append)
    mine = members(0)
    mine.bound_s = 0.5
    silent = threading.Event()


    class Silent:  # every call waits, as on a connection the store does not answer
        def __getattr__(self, name):
            return lambda *args, **kwargs: silent.wait(30) and None

        def compare_set(self, key, expected, desired):
            silent.wait(30)
            return desired.encode()

    monkeypatch.setattr(mine, "connections", dataclasses.replace(mine.connections,
                                                                 declare=Silent()))
    monkeypatch.setattr(mine, "dropped", lambda: None)  # the fence's question: nothing to say
    declaring = threading.Thread(target=mine.declare, args=("hung", [1]), daemon=True)
    declaring.start()
    try:
        deadline = time.monotonic() + 5
        while not left and time.monotonic() < deadline:
            time.sleep(0.02)
        assert left == [EXIT_GAVE_UP] and declaring.is_alive()
        assert [r.getMessage().split(":")[0] for r in caplog.records if r.levelname == "ERROR"
                ] == ["recovery in process failed while detecting the fault"]
    finally:
        silent.set()
        declaring.join(5)
    other = members(1)
    other.recovery.deadline.arm()
    other.close()
    assert other.recovery.deadline.timer is None


def test_a_rank_woken_at_its_bound_after_the_others_went_on_is_dropped(store, members,
                                                                       monkeypatch, caplog):
    """A rank frozen in a recovery, woken after its bound: its give-up finds that the job went on
    without it, and it leaves as dropped, in the fence's line, with no ``fallback`` record."""
    from elastic_mnist.resilience import recovery

    left: list[int] = []
    monkeypatch.setattr(recovery, "end_process", left.append)
    survivor, woken = members(0), members(1)
    written: list[dict] = []
    woken.on_fallback = written.append
    survivor.declare("hung", [1])
    survivor.generation = 1
    survivor._publish_current([0])
    woken.recovery._give_up()
    assert (left, written) == ([EXIT_DROPPED], [])
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [DROPPED_LINE]


@pytest.mark.parametrize("why", ["hung", "left"])
def test_the_fence_tells_a_dropped_rank_from_survivors_on_their_way(members, why):
    """Survivors name their generation the job's current one, with the processes they kept,
    before they build its group: a rank of the generation before that was not kept is dropped
    (unless it left of its own accord: its last records are its own); a kept one still on its
    way is not; a later generation is never named over by an earlier one."""
    survivor, other = members(1, 3), members(2, 3)  # rank 0: another survivor, elsewhere
    assert survivor.dropped() is None and other.dropped() is None  # no generation named yet
    survivor.declare(why, [2])
    survivor.generation = 1  # rank 0 got there first
    survivor._publish_current([0, 1])
    survivor.generation = 0
    assert survivor.dropped() is None  # on its way to generation 1
    assert other.dropped() == (None if why == "left" else Over(
        "rank 2 was dropped from the job at generation 0 (the job is at 1): leaving without "
        "writing", EXIT_DROPPED))
    survivor.generation = 2
    survivor._publish_current([0])
    survivor.generation = 1
    survivor._publish_current([0, 1])  # late: changes nothing
    assert survivor.dropped().line.endswith("generation 1 (the job is at 2): leaving without "
                                            "writing")


def memberships_on_a_store_that_goes(folder, ranks: int = 2):
    """Memberships of ranks ``0..ranks-1`` on a store of their own (``del`` the server returned,
    and it is gone), mirroring the job's generation into ``folder``."""
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    return server, [Membership(DistEnv(rank=r, world_size=ranks, launched=True),
                               torch.device("cpu"), PrefixStore("launch", server.clone()),
                               generation=0, pg_timeout_s=10, bound_s=60, folder=folder,
                               launch="this-launch",
                               board=own_board(folder.parent / f"{folder.name}-boards", r))
                    for r in range(ranks)]


def test_the_fence_fails_closed_for_a_dropped_rank_when_the_coordination_store_does_not_answer(
        tmp_path):
    """Rank 1 went on without rank 0 (frozen, say); then the store went. The checkpoint folder's
    generation.json says so: rank 0's queued checkpoint is not committed (nor `latest` moved,
    nor its files left), no record is written, and it leaves with one line."""
    server, (member, survivor) = memberships_on_a_store_that_goes(tmp_path)
    over: list[Over] = []
    fence = Fence(member.dropped, on_over=over.append)
    saver = Checkpointer(tmp_path, every=1, keep_last=1, restart_generation=0, fence=fence)
    events = EventLog(tmp_path / "events.jsonl", fence)
    saver.maybe_save(lambda: state(1), 1)
    saver.wait()
    events.emit("checkpoint", 1)
    survivor.declare("hung", [0])
    survivor.generation, survivor.env = 1, DistEnv(rank=0, world_size=1, launched=True)
    survivor._publish_current([1])  # the job goes on without rank 0
    survivor.close()
    del server  # the store's host is gone
    saver.maybe_save(lambda: state(2), 2)
    with pytest.raises(FenceClosed):
        saver.wait()
    with pytest.raises(FenceClosed):
        events.emit("checkpoint", 2)
    member.close()
    events.close()
    assert [o.status for o in over] == [EXIT_DROPPED, EXIT_DROPPED]
    assert over[0].line == ("rank 0 was dropped from the job at generation 0 (generation.json "
                            "says the job is at 1; the coordination store does not answer): "
                            "leaving without writing")
    assert (tmp_path / "latest").read_text() == "step-00000001\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "events.jsonl", "generation.json", "latest", "step-00000001.json", "step-00000001.pt"]
    assert [e["step"] for e in read_events(tmp_path / "events.jsonl")] == [1]


@pytest.mark.parametrize("named", ["no generation", "this one, kept", "another launch's"])
def test_a_rank_still_in_the_job_commits_when_the_coordination_store_does_not_answer(
        tmp_path, named, caplog):
    """A store outage longer than its timeout, or the whole job stopped (SIGTERM) with the
    store's host gone first: nothing says the job went on without this rank, so its final
    checkpoint and records are written, with one warning; the lease is not renewed meanwhile
    (a lease that nobody can renew lapses by itself), and the process does not leave."""
    server, (member, other) = memberships_on_a_store_that_goes(tmp_path)
    if named == "this one, kept":
        other.declare("died", [1])
        for m in (member, other):
            m.generation = 1
        member._publish_current([0])
    elif named == "another launch's":
        (tmp_path / "generation.json").write_text(json.dumps(
            {"launch": "an-earlier-launch", "generation": 7, "kept": "3"}))
    over: list[Over] = []
    fence = Fence(member.dropped, on_over=over.append)
    saver = Checkpointer(tmp_path, every=1, keep_last=2, restart_generation=0, fence=fence)
    events = EventLog(tmp_path / "events.jsonl", fence)
    keeper = LeaseKeeper(tmp_path, JobIdentity("torchrun:this-job"), 0.5)  # renews every 0.1 s
    keeper.acquire()
    keeper.fence = fence
    keeper.start()
    other.close()
    del server
    saver.maybe_save(lambda: state(1), 1, final=True)
    saver.wait()
    events.emit("checkpoint", 1)
    time.sleep(0.3)  # the keeper's next beat asked, and could not tell
    beat = read_lease(tmp_path).beat
    time.sleep(0.5)
    assert read_lease(tmp_path).beat == beat and keeper._thread.is_alive()
    keeper.close()
    member.close()
    events.close()
    assert over == []
    assert (tmp_path / "latest").read_text() == "step-00000001\n"
    assert [e["step"] for e in read_events(tmp_path / "events.jsonl")] == [1]
    said = [r.getMessage() for r in caplog.records if r.name == "elastic_mnist.resilience.fence"]
    assert len(said) == 1 and said[0].startswith(
        "rank 0 cannot tell whether it is still one of the job's ranks: the coordination store "
        "does not answer (") and said[0].endswith("; writing on")


def test_processes_of_one_host_name_and_pid_have_pulses_and_places_of_their_own(members):
    """Containers: every node's worker can be pid 1 on hosts of one name. A process whose pulse
    stopped is found silent while another of its name and pid lives; and the fence tells a
    dropped process from a kept one of the same name and pid."""
    live, stopped = members(0), members(1)  # one process: one host name, one pid
    assert (live.identity.host, live.identity.pid) == (stopped.identity.host,
                                                       stopped.identity.pid)
    stopped.close()  # its pulse stops: frozen, or gone
    pulses = Pulses(live.store, {r: pulse_key(i) for r, i in live.identities().items()},
                    live.pulse_key)
    deadline = time.monotonic() + 10
    while not (silent := pulses.silent()) and time.monotonic() < deadline:
        time.sleep(PULSE_S)
    assert silent == {1}
    live.declare("hung", [1])
    live.generation = 1
    live._publish_current([0])  # the job goes on without rank 1
    live.generation = 0
    assert live.dropped() is None
    assert stopped.dropped().line.startswith("rank 1 was dropped from the job at generation 0")


def connections_to(port: int) -> int:
    """This process's open connections to ``port``: the clients' ends."""
    return sum(1 for c in psutil.Process().net_connections("tcp")
               if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED)


def test_a_recovery_opens_no_connection_to_the_coordination_store(store, members):
    """torch's TCPStore server resolves each new client's address to a name inside its event
    loop, so a new connection can stall every client of the store for the resolver's timeout:
    a process opens its connections at start, and every generation reuses them."""
    member = members()
    before = connections_to(store.port)
    member.declare("died", [])  # wakes this rank's watcher: the generation is over
    member.generation += 1  # a recovery's next generation: its watcher, its watchdog's store
    member._start_generation()
    member.generation_store().set("heartbeat", "1")
    assert connections_to(store.port) == before
    assert member._waker.name == "membership-wake-g1" and member._waker.is_alive()


def test_a_rank_whose_agent_the_rendezvous_dropped_leaves(store, monkeypatch, caplog):
    """A lapsed keep-alive of this process's agent is renewed by its local rank 0. Every agent
    of round 3 dropped all the same, a node that came alone starts round 4 and trains in it:
    the workers of round 3 leave at once, in one line, so that their agents restart them into
    the job."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    from elastic_mnist.resilience import torchrun_agents

    backend = C10dRendezvousBackend(store, "job7")
    state = _RendezvousState()
    state.round = 3
    # Lapsed: this process's "agent", rank 1's on another node, and one whose node is gone.
    agent, other, gone = (_NodeDesc(socket.getfqdn(), os.getppid(), 0),
                          _NodeDesc("n2.example", 4242, 0), _NodeDesc("n3.example", 4343, 0))
    lapsed_at = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=20)
    for rank, node in enumerate((agent, other, gone)):
        state.participants[node] = rank
        state.last_heartbeats[node] = lapsed_at
    backend.set_state(pickle.dumps(state))
    launch = PrefixStore("elastic_mnist/job7/x", store.clone())
    launch.set("g0/id/1", json.dumps(dataclasses.asdict(
        Identity("n2", 99, 4242, 0, agent_addr="n2.example"))))
    left: list[int] = []
    monkeypatch.setattr(torchrun_agents, "ROUND_CHECK_S", 0.05)
    monkeypatch.setattr(torchrun_agents, "end_process", left.append)
    env = DistEnv(rank=0, world_size=2, launched=True, rendezvous=rendezvous_of(
        ["torchrun", "--nnodes=1:4", "--rdzv_backend=c10d", "--rdzv_endpoint=head:29400",
         "--rdzv_id=job7", "-m", "elastic_mnist", "train"]))
    member = Membership(env, torch.device("cpu"), PrefixStore("elastic_mnist/job7/x",
                                                              store.clone()),
                        generation=0, pg_timeout_s=10, bound_s=60)
    try:
        assert member.round == 3
        time.sleep(0.5)
        assert left == []  # the same round: the job goes on
        renewed = pickle.loads(backend.get_state()[0]).last_heartbeats  # by local rank 0
        assert renewed[agent] > lapsed_at + datetime.timedelta(seconds=19)
        assert renewed[other] == renewed[agent] and renewed[gone] == lapsed_at
        # 20 s and the membership's start: each connection it opens can wait for the store's
        # resolver (5 s), as a recovery's would (see test_a_recovery_opens_no_connection...).
        assert re.search(r"2 of this job's torchrun agents had sent no keep-alive for up to "
                         r"2\d\.\d s", caplog.text), caplog.text
        state.round = 4
        backend.set_state(pickle.dumps(state), backend.get_state()[1])
        deadline = time.monotonic() + 10
        while not left and time.monotonic() < deadline:
            time.sleep(0.05)
        assert left[0] == EXIT_DROPPED
        assert "the rendezvous moved on to round 4 without this node's agent" in caplog.text
    finally:
        member.close()


def c10d_handler(port: int, run_id: str, **conf: str):
    """torch's own c10d rendezvous handler, as an agent makes it (``--rdzv_conf`` in ``conf``)."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    params = RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{port}", run_id=run_id,
                                  min_nodes=1, max_nodes=2, is_host="false", **conf)
    return create_handler(*reversed(create_backend(params)), params)


JOINER = """import sys
from test_membership import c10d_handler
c10d_handler(int(sys.argv[1]), "job7", local_addr="joiner.example", last_call_timeout="1",
             keep_alive_interval="1", keep_alive_max_attempt="2").next_rendezvous()
"""


@pytest.mark.slow
def test_a_rank_takes_its_round_and_its_agent_from_the_rendezvous(store, monkeypatch, caplog):
    """Real torch handlers. This process's agent is named in the rendezvous otherwise than this
    host's resolver names it (its --local_addr, or a flaky resolver): the worker finds it by its
    pid and renews its keep-alive under its own name. Then its keep-alives lapse (a start-up
    stall) and a node that comes alone makes round 1 without it: a worker that starts then
    refuses that round, leaves at once in one line and writes nothing."""
    import subprocess
    import sys

    from elastic_mnist.resilience import torchrun_agents

    monkeypatch.setattr(os, "getppid", os.getpid)  # the handler below is this process's agent
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # no store of its own to serve
    monkeypatch.setattr(torchrun_agents, "ROUND_CHECK_S", 0.05)

    def leave(code: int):
        raise SystemExit(code)

    monkeypatch.setattr(torchrun_agents, "end_process", leave)
    agent = c10d_handler(store.port, "job7", local_addr="agent-a.example",
                         last_call_timeout="1", keep_alive_interval="60")  # never renews
    assert agent.next_rendezvous().rank == 0
    env = DistEnv(rank=0, world_size=1, launched=True, rendezvous=rendezvous_of(
        ["torchrun", "--nnodes=1:2", "--rdzv_backend=c10d",
         f"--rdzv_endpoint=127.0.0.1:{store.port}", "--rdzv_id=job7",
         "--rdzv_conf=keep_alive_interval=1", "-m", "elastic_mnist", "train"]))
    reader = torchrun_agents.RendezvousReader(store, "job7")
    (joined_at,) = reader.read()[0].last_heartbeats.values()
    member = Membership(env, torch.device("cpu"), PrefixStore("elastic_mnist/job7/x",
                                                              store.clone()),
                        generation=0, pg_timeout_s=10, bound_s=60)
    try:
        assert (member.round, member.identity.agent_addr) == (0, "agent-a.example")
        deadline = time.monotonic() + 10
        while reader.read()[0].last_heartbeats[next(iter(reader.read()[0].participants))] \
                == joined_at:  # renewed past 2.5 s (the lapse at 3)
            assert time.monotonic() < deadline, "the agent's keep-alive was not renewed"
            time.sleep(0.1)
    finally:
        member.close()
    subprocess.run([sys.executable, "-c", JOINER, str(store.port)], check=True, timeout=60,
                   cwd=os.path.dirname(__file__))
    state = reader.read()[0]
    assert state.round == 1 and [n.addr for n in state.participants] == ["joiner.example"]
    with pytest.raises(SystemExit) as left:
        Membership(env, torch.device("cpu"), PrefixStore("elastic_mnist/job7/y", store.clone()),
                   generation=0, pg_timeout_s=10, bound_s=60)
    assert left.value.code == EXIT_DROPPED
    assert "the rendezvous is in round 1, which does not list this node's torchrun agent" in \
        caplog.text
    assert not store.check(["elastic_mnist/job7/y/g0/id/0"])  # nothing written
    with contextlib.suppress(Exception):
        agent.shutdown()


ORPHAN = """import os, sys, time
import torch
from torch.distributed import PrefixStore, TCPStore
from elastic_mnist.env import DistEnv, rendezvous_of
from elastic_mnist.resilience import membership, torchrun_agents

torchrun_agents.ROUND_CHECK_S = 0.05
store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False)
store.wait(["go"])
env = DistEnv(rank=1, world_size=2, group_rank=1, launched=True, rendezvous=rendezvous_of(
    ["torchrun", "--nnodes=1:2", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{sys.argv[1]}",
     "--rdzv_id=job7", "--rdzv_conf=keep_alive_interval=1", "-m", "elastic_mnist", "train"]))
member = membership.Membership(env, torch.device("cpu"), PrefixStore("elastic_mnist/job7/x", store),
                               generation=0, pg_timeout_s=10, bound_s=60)
print(os.getpid(), flush=True)
time.sleep(120)
"""


@pytest.mark.slow
def test_an_agent_killed_alone_is_not_renewed_for_its_orphaned_worker(store, monkeypatch):
    """torchrun starts its workers in sessions of their own: SIGKILL of an agent alone leaves its
    worker training, a member still. Its keep-alive is not renewed by the other node's local
    rank 0 (which renews its own agent's), so the rendezvous drops it: the orphan, whose parent
    is no longer its agent, said so in the store. At the end rank 0 arrives for it at the exit
    barrier."""
    import shlex
    import signal
    import subprocess
    import sys

    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    from elastic_mnist.resilience import torchrun_agents

    monkeypatch.setattr(torchrun_agents, "ROUND_CHECK_S", 0.05)
    worker = shlex.join([sys.executable, "-c", ORPHAN, str(store.port)])
    agent = subprocess.Popen(["bash", "-c", f"{worker} & wait"], stdout=subprocess.PIPE,
                             text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    ours, theirs = _NodeDesc(socket.getfqdn(), os.getppid(), 0), _NodeDesc("n2.example",
                                                                          agent.pid, 0)
    backend = C10dRendezvousBackend(store, "job7")
    state = _RendezvousState()
    state.round, state.complete = 3, True
    for rank, node in enumerate((ours, theirs)):
        state.participants[node] = rank
        state.last_heartbeats[node] = datetime.datetime.now(datetime.timezone.utc)
    backend.set_state(pickle.dumps(state))
    store.set("go", "1")
    orphan = int(agent.stdout.readline())  # its membership is up
    env = DistEnv(rank=0, world_size=2, launched=True, rendezvous=rendezvous_of(
        ["torchrun", "--nnodes=1:2", "--rdzv_backend=c10d",
         f"--rdzv_endpoint=127.0.0.1:{store.port}", "--rdzv_id=job7",
         "--rdzv_conf=keep_alive_interval=1", "-m", "elastic_mnist", "train"]))
    member = Membership(env, torch.device("cpu"), PrefixStore("elastic_mnist/job7/x",
                                                              store.clone()),
                        generation=0, pg_timeout_s=10, bound_s=60)
    try:
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
        deadline = time.monotonic() + 10
        while not store.check([f"elastic_mnist/job7/x/dead-agent/n2.example/{agent.pid}"]):
            assert time.monotonic() < deadline, "the orphan did not say its agent is dead"
            time.sleep(0.05)
        lapsed_at = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=20)
        written = False
        while not written:  # a compare-and-set, which a renewal meanwhile makes fail: again
            state, token = backend.get_state()
            state = pickle.loads(state)
            state.last_heartbeats.update(dict.fromkeys((ours, theirs), lapsed_at))
            written = backend.set_state(pickle.dumps(state), token)[2]
        while pickle.loads(backend.get_state()[0]).last_heartbeats[ours] == lapsed_at:
            assert time.monotonic() < deadline + 10, "this node's agent was not renewed"
            time.sleep(0.05)
        assert pickle.loads(backend.get_state()[0]).last_heartbeats[theirs] == lapsed_at
        # At the end, rank 0 arrives at torchrun's exit barrier for the dead agent, who never will.
        member.release_agents()
        barrier = PrefixStore("torch.rendezvous.job7.3", store.clone())
        assert barrier.add("torchelastic/agent/terminal_state/num_members", 0) == 1
    finally:
        member.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(orphan, signal.SIGKILL)


def test_a_failed_collective_fails_its_wait_and_marks_the_group_broken(members):
    member = members()
    done, failing = torch.futures.Future(), torch.futures.Future()
    ok, bad = member.guard(done), member.guard(failing)
    done.set_result([torch.ones(1)])
    assert torch.equal(ok.wait()[0], torch.ones(1)) and member.broken is None
    failing.set_exception(RuntimeError("[pair.cc:545] Read error: Connection reset by peer"))
    with pytest.raises(PeerFailure, match="Connection reset by peer"):
        bad.wait()
    assert member.broken.startswith("a collective failed")


def test_the_step_flags_are_written_in_place_and_read_back_summed():
    ranks = [StepFlags(rank, 3, torch.device("cpu")) for rank in range(3)]
    tensor = ranks[1].tensor
    assert ranks[1].write(checkpoint_failed=False, leave_vote=False, stop=True,
                          nonfinite=torch.tensor(False)) is tensor  # allocated once
    total = sum(flags.write(checkpoint_failed=rank == 0, leave_vote=rank == 2, stop=rank != 1,
                            nonfinite=torch.tensor(rank == 2), admit=rank == 0,
                            evict_vote=rank == 1).clone()
                for rank, flags in enumerate(ranks))
    assert ranks[0].read(total.tolist()) == (True, True, True, True, [0, 2], [2])
    alone = sum(flags.write(checkpoint_failed=False, leave_vote=False, stop=False,
                            nonfinite=torch.tensor(False)).clone() for flags in ranks)
    assert ranks[2].read(alone.tolist()) == (False, False, False, False, [], [])


def test_the_rendezvous_is_read_from_the_agent_command_line():
    line = ["/v/bin/python", "/v/bin/torchrun", "--nnodes=1:4", "--nproc_per_node=8",
            "--rdzv_backend=c10d", "--rdzv_endpoint=head:29400", "--rdzv_id=job7",
            "--max_restarts=3", "-m", "elastic_mnist", "train", "--rdzv_id=not-this"]
    found = rendezvous_of(line)
    assert (found.host, found.port, found.run_id, found.endpoint) == \
        ("head", 29400, "job7", "head:29400")
    module = ["python", "-m", "torch.distributed.run", *line[2:]]
    assert rendezvous_of(module) == found
    for joined in (["python", "-mtorch.distributed.run", *line[2:]],  # tests/launch.py's way
                   ["python", "-u", "-m", "torch.distributed.launch", "--use-env", *line[2:]]):
        assert rendezvous_of(joined) == found, joined
    assert (found.keep_alive_interval_s, found.keep_alive_max_attempt, found.local_addr) == \
        (5.0, 3, None)  # torch's defaults
    conf = "--rdzv_conf=join_timeout=600,keep_alive_interval=1,keep_alive_max_attempt=4"
    node_sh = rendezvous_of([*line[:6], conf, "--local_addr=n1", *line[6:]])
    assert (node_sh.keep_alive_interval_s, node_sh.keep_alive_max_attempt, node_sh.local_addr) \
        == (1.0, 4, "n1")
    default_port = [arg.replace("head:29400", "head") for arg in line]
    assert rendezvous_of(default_port).port == 29400
    for one_node in (["python", "-m", "torch.distributed.run", "--standalone",
                      "--nproc_per_node=2", "-m", "elastic_mnist", "train"],
                     [*line[:2], "--nnodes=1", *line[3:]],
                     [a.replace("c10d", "static") for a in line], ["bash", "jobs/local.sh"]):
        assert rendezvous_of(one_node) is None, one_node
    environ = {"RANK": "0", "WORLD_SIZE": "1", "GROUP_WORLD_SIZE": "3"}
    env = DistEnv.from_environ(environ, launcher_argv=line)
    assert env.rendezvous == found and env.group_world_size == 3
    assert why_no_rendezvous(["/bin/bash", "-c", "true; python -m elastic_mnist train"], 42) == \
        "the worker's parent (pid 42, `bash`) is not a torchrun agent whose --rdzv_endpoint it " \
        "can read"
    assert "not a multi-node c10d one" in why_no_rendezvous([*line[:2], "--nnodes=1"], 42)


def test_the_exit_barrier_is_released_for_the_agents_that_are_gone(store):
    """What torchrun's agents keep in the store, written by torch's own classes, read back; the
    barrier they wait in at their end, counted as torch's barrier counts it."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState
    from torch.distributed.elastic.utils.store import barrier

    state = _RendezvousState()
    state.round = 3
    C10dRendezvousBackend(store, "job7").set_state(pickle.dumps(state))
    assert rendezvous_round(PrefixStore("elastic_mnist/job7/x", store), "job7") == 3
    round_store = PrefixStore("torch.rendezvous.job7.3", store.clone())
    agent = threading.Thread(target=barrier, args=(round_store, 3,
                                                   "torchelastic/agent/terminal_state", 20))
    agent.start()  # the one surviving agent of three waits for the two that are gone
    arrive_at_exit_barrier(store, "job7", 3, count=2, agents=3)
    agent.join(timeout=10)
    assert not agent.is_alive()


def test_the_glue_falls_back_to_restarts_where_torch_keeps_its_rendezvous_otherwise(store):
    """The c10d glue reads torch's private rendezvous state: where it reads as in the torch this
    was written against, the glue is usable; where it does not (another torch's classes), the
    reason is one line naming both torch versions, and the job recovers by restarts."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    from elastic_mnist.env import Rendezvous
    from elastic_mnist.resilience.torchrun_agents import CHECKED_TORCH, TorchrunAgents

    glue = TorchrunAgents(Rendezvous("127.0.0.1", store.port, "job7"))
    state = _RendezvousState()
    state.round = 2
    state.participants[_NodeDesc("host-a", 123, 0)] = 0
    backend = C10dRendezvousBackend(store, "job7")
    token = backend.set_state(pickle.dumps(state))[1]
    assert glue.unusable(store) is None
    backend.set_state(pickle.dumps({"round": 2}), token)  # not the class this torch keeps
    reason = glue.unusable(store)
    assert reason is not None and "\n" not in reason
    assert f"torch {torch.__version__}'s c10d rendezvous state" in reason
    assert CHECKED_TORCH[-1] in reason and "AttributeError" in reason


def test_an_agent_whose_keep_alive_lapsed_in_a_stalled_store_is_renewed_back(tmp_path):
    """Real torch rendezvous handlers (jobs/node.sh's timing: keep-alives every 1 s, dropped
    after 3) on a store in another process, SIGSTOPped for 4 s as a store stalls: afterwards
    neither handler ever renews its keep-alive again (torch 2.14: each read drops its own lapsed
    entry from its copy of the state), so the next node to join would drop them both and start
    a round alone. Renewed in their place, they take it up again themselves, and a node that
    joins waits for the next round beside them, as it should."""
    import signal
    import subprocess
    import sys

    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    from elastic_mnist.resilience.torchrun_agents import RendezvousReader

    serve = ("import time; from torch.distributed import TCPStore; "
             "s = TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False); "
             "print(s.port, flush=True); time.sleep(300)")
    server = subprocess.Popen([sys.executable, "-c", serve], stdout=subprocess.PIPE, text=True)
    handlers = []
    try:
        port = int(server.stdout.readline())

        def handler():
            params = RendezvousParameters(
                backend="c10d", endpoint=f"127.0.0.1:{port}", run_id="job7", min_nodes=2,
                max_nodes=3, join_timeout="60", last_call_timeout="1", keep_alive_interval="1",
                keep_alive_max_attempt="3", is_host="false")
            handlers.append(create_handler(*reversed(create_backend(params)), params))
            return handlers[-1]

        first = [handler(), handler()]
        joins = [threading.Thread(target=h.next_rendezvous) for h in first]
        for join in joins:
            join.start()
        for join in joins:
            join.join(timeout=60)
        reader = RendezvousReader(TCPStore("127.0.0.1", port, timeout=TIMEOUT), "job7")

        def ages() -> list[float]:
            now = datetime.datetime.now(datetime.timezone.utc)
            return [(now - t).total_seconds() for t in reader.read()[0].last_heartbeats.values()]

        assert len(ages()) == 2 and max(ages()) < 2.5
        server.send_signal(signal.SIGSTOP)
        time.sleep(4)
        server.send_signal(signal.SIGCONT)
        time.sleep(3)
        lapsed = ages()
        assert min(lapsed) > 6, lapsed  # nothing renewed in the 3 s since the store came back
        state, token = reader.read()
        node = next(iter(state.participants))
        renewed_at = datetime.datetime.now(datetime.timezone.utc)
        count, age = reader.renew(state, token, {(node.addr, node.pid)}, older_than_s=2.5)
        assert count == 2 and age > 6  # the two handlers share this process's name and pid
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and min(
                reader.read()[0].last_heartbeats.values()) < renewed_at + datetime.timedelta(
                    seconds=0.5):
            time.sleep(0.1)
        assert max(ages()) < 2.5, "the handlers did not take their keep-alives up again"
        round_ = reader()

        def join_late():
            with contextlib.suppress(Exception):  # closed at the end
                handler().next_rendezvous()

        threading.Thread(target=join_late, daemon=True).start()
        while time.monotonic() < deadline + 10 and not reader.read()[0].wait_list:
            time.sleep(0.1)
        state = reader.read()[0]
        assert (state.round, len(state.participants), len(state.wait_list)) == (round_, 2, 1)
    finally:
        for made in handlers[:2]:
            with contextlib.suppress(Exception):
                made.shutdown()
        server.kill()
        server.wait()


def test_a_rendezvous_state_that_holds_anything_else_is_refused(store):
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    C10dRendezvousBackend(store, "job7").set_state(pickle.dumps(_Exploit()))
    with pytest.raises(pickle.UnpicklingError, match="posix.system|os.system"):
        rendezvous_round(store, "job7")


class _Exploit:
    def __reduce__(self):
        import os

        return (os.system, ("true",))


def test_the_fallback_record_goes_where_this_rank_can_write_it(tmp_path):
    """Rank 0 writes it through its generation's writers; another node's first rank in the run
    folder's events.jsonl; any other rank nowhere. Its step is the progress's when it comes (in
    the give-up timer's thread too): no trainer is read."""
    from elastic_mnist.config import TrainConfig
    from elastic_mnist.duties import Duties, record_fallback
    from elastic_mnist.resilience.faces import NullMembership
    from elastic_mnist.state import Progress
    from elastic_mnist.writers import Writers

    duties = Duties(TrainConfig(), "run", tmp_path, tmp_path / "ckpt", None, NullMembership())
    progress, events = Progress(step=7), Recorded()
    duties.writers = Writers(events=events)
    record_fallback(duties, progress, {"phase": "creating the new group"})
    progress.become(Progress(step=9))
    for rank, local_rank in ((2, 0), (3, 1)):
        duties.env = DistEnv(rank=rank, local_rank=local_rank, world_size=4, launched=True)
        record_fallback(duties, progress, {"phase": "creating the new group"})
    written = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(record["event"], record["step"]) for record in written] == [("fallback", 9)]
    assert events.records == [("fallback", 7)]


def test_identities_of_ranks_lost_before_they_said_who_they_were_are_unknown(store, members):
    member = members(rank=0, world_size=3)
    found = member.identities()
    assert found[0].pid > 0 and found[1].host == found[2].host == "unknown"
    assert json.loads(store.get("launch/g0/id/0"))["pid"] == found[0].pid


class Recorded:
    """An event log that keeps what it is told."""

    def __init__(self):
        self.records: list[tuple[str, int]] = []

    def emit(self, event: str, step: int, **fields) -> None:
        self.records.append((event, step))

    def close(self) -> None:
        pass


@pytest.mark.parametrize("rank0_did", ["trained", "evaluated", "saved"])
def test_what_the_agreed_step_owes_is_done_before_the_next_step(tiny_digits, tmp_path,
                                                                rank0_did):
    """A fault in an epoch's evaluation or save comes after its step was agreed: the new group
    evaluates it (unless its rank 0 had, and logged it) and saves it (unless its rank 0 had
    committed it: a new rank 0 does not write it, nor its records, twice), before stepping on."""
    from elastic_mnist.checkpoint import newest_committed_step
    from elastic_mnist.checkpointer import Checkpointer
    from elastic_mnist.config import TrainConfig
    from elastic_mnist.data.datasets import load
    from elastic_mnist.resilience.agreement import Change
    from elastic_mnist.resilience.preemption import StopRequest
    from elastic_mnist.trainer import Trainer
    from elastic_mnist.writers import Writers

    cfg = TrainConfig()
    cfg.optim.global_batch_size, cfg.optim.micro_batch_size, cfg.optim.max_steps = 64, 32, 11
    cfg.run.device = "cpu"
    trainer = Trainer(cfg, DistEnv(), torch.device("cpu"), load(tiny_digits, "synthetic"),
                      run_id="owed", restart_generation=1)
    for _ in range(10):  # 640 digits, 64 a step: step 10 ends the epoch
        batch = trainer.global_batch()
        trainer.train_step(batch, stop_requested=False)
        trainer.advance(len(batch))
    if rank0_did == "saved":  # the rank 0 that is gone committed step 10
        predecessor = Checkpointer(tmp_path, every=0, keep_last=3, restart_generation=1)
        predecessor.maybe_save(trainer.state, 10, epoch_end=True, final=True)
        predecessor.close()
    # The new generation's writers, as a change hands them over (Duties.after).
    checkpointer = Checkpointer(tmp_path, every=0, keep_last=3, restart_generation=2,
                                taking_over_at=10)
    events = Recorded()
    trainer.take(Writers(checkpointer=checkpointer, events=events))
    committed = []
    checkpointer.on_commit = lambda manifest, blocking_ms: committed.append(manifest.step)
    trainer.owed = Change(env=DistEnv(), generation=2, old_world_size=2, lost=[], why="died",
                          step=10, holder=0, steps_redone=0,
                          evaluated_step=9 if rank0_did == "trained" else 10, detected=0.0,
                          detected_at=0.0)
    assert trainer.fit(StopRequest()) == "finished"
    checkpointer.close()
    evals = [step for event, step in events.records if event == "eval"]
    assert evals == ([10, 11] if rank0_did == "trained" else [11])
    assert committed == ([11] if rank0_did == "saved" else [10, 11])
    assert newest_committed_step(tmp_path) == 11 and (tmp_path / "step-00000010.pt").exists()


def test_a_collective_of_an_aborted_generation_raises_instead_of_returning_local_values(
        tiny_digits, members):
    """NCCL's abort (``Membership.abort``) makes torch clear the default group. A collective
    skipped for want of a group would return this rank's own values as the sum: a step's flags
    and statistics, an evaluation's accuracy, of one rank. Every collective of the loop raises
    PeerFailure instead, which the loop recovers from."""
    from elastic_mnist.comm import Comm
    from elastic_mnist.config import TrainConfig
    from elastic_mnist.data.datasets import load
    from elastic_mnist.engine import GradCheck, sum_allreduce_hook
    from elastic_mnist.resilience.watchdog import NullWatchdog
    from elastic_mnist.trainer import Trainer

    cfg = TrainConfig()
    cfg.run.device = "cpu"
    trainer = Trainer(cfg, DistEnv(), torch.device("cpu"), load(tiny_digits, "synthetic"),
                      run_id="aborted", restart_generation=1)
    member = members(0, world_size=2)
    comm = Comm(member.env, member, NullWatchdog())  # rank 0 of 2, its group gone
    trainer.report.enter(member.env, 1, trainer.writers, comm)
    member.abort(Fault("died", [1], 1, "", time.time()))
    assert not torch.distributed.is_initialized()
    with pytest.raises(PeerFailure):
        comm.all_reduce_(torch.ones(3))
    with pytest.raises(PeerFailure):
        trainer.report.evaluation()
    assert trainer.report.last_eval is None

    class Bucket:
        def buffer(self) -> torch.Tensor:
            return torch.ones(4)

    with pytest.raises(PeerFailure):
        sum_allreduce_hook(GradCheck(torch.device("cpu"), member), Bucket())


def a_change(rank: int, world_size: int, generation: int):
    from elastic_mnist.resilience.agreement import Change

    return Change(env=DistEnv(rank=rank, world_size=world_size, launched=True),
                  generation=generation, old_world_size=2, lost=[], why="died", step=3,
                  holder=0, steps_redone=0, evaluated_step=0, detected=0.0, detected_at=0.0)


@contextlib.contextmanager
def no_group_left():
    """The default process group a test's recovery built, destroyed at its end (one process)."""
    try:
        yield
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_a_survivor_that_watches_nothing_reads_no_identity_for_the_next_generation(
        members, monkeypatch):
    """A survivor that neither closed the membership nor watches the new generation never read
    the identities: the change hands its next generation none, and it reads none for it (every
    survivor reading them there would be W values each, W² in all, at the busiest moment)."""
    from elastic_mnist.resilience import recovery
    from elastic_mnist.resilience.read_once import ReadOnce

    member = members(1, world_size=4)  # rank 1 of 4, then of 4 again: no watcher of either
    monkeypatch.setattr(recovery, "connect_group", lambda *args: None)
    monkeypatch.setattr(recovery, "install_group", lambda *args: None)
    read: list[int] = []
    never = ReadOnce(lambda: read.append(1) or {}, 0)
    member.recovery.next_generation(a_change(1, 4, 1), never, [0, 1, 2, 3])
    assert read == [] and not never.ready
    assert member.known.generation == 1 and not member.known.ready


def test_a_second_fault_in_a_recovery_opens_no_connection_to_the_store(store, members):
    """A creation given up on (rank 1 never came) still waits on the group's connection, until
    the group's timeout: the next round takes the spare one, prepared at start, instead of
    opening one in the middle of the recovery (every client of the store can stall while the
    store's server resolves a new client's name); the spare is replaced once the change is
    over."""
    mine, theirs = members(0, pg_timeout_s=3), members(1, pg_timeout_s=3)  # the creation ends
    identities = mine.identities()
    before = connections_to(store.port)
    with no_group_left():
        threading.Timer(0.5, lambda: mine.declare("died", [1], "never came")).start()
        with pytest.raises(PeerFailure):
            mine.recovery.next_generation(a_change(0, 2, 1), identities, [0, 1])
        mine.recovery.next_generation(a_change(0, 1, 2), {0: identities[0]}, [0])  # alone now
        assert connections_to(store.port) == before
        assert torch.distributed.get_world_size() == 1
        mine.recovered()  # the first step after the change: outside the recovery
        mine.recovery._refilling.join(10)
        assert connections_to(store.port) == before + 1  # the spare, replaced
    assert theirs.generation == 0


def test_joiners_that_had_not_taken_the_state_do_not_go_on_alone_from_scratch(store, members):
    """Every rank that held the job's state lost as the joiners entered (before they adopted
    it): a joiner holds no committed step, so the survivors cannot go on in process; they fall
    back (torchrun restarts the job from its last checkpoint) instead of training on from
    step 0 with a model that never learned."""
    from elastic_mnist.errors import CannotRecover
    from elastic_mnist.regroup import Regroup
    from elastic_mnist.state import Progress

    joiner = members(1)  # rank 1 of the grown generation 0; rank 0, the job's, is gone
    joiner.joining = True  # built as a joining worker, before its admission
    regroup = Regroup(joiner, None, None, None, torch.device("cpu"), Progress(), dict,
                      lambda payload: None)
    joiner.joining = False  # admitted: the grow moved it into the job's generation
    # Rank 0 never checks in (it never said who it was: its pulse stands still): the joiner,
    # a watcher of two, closes the membership alone, and finds no state in it.
    with no_group_left(), pytest.raises(CannotRecover, match="no survivor holds the job's state"):
        joiner.recover(regroup.position(evaluated_step=0))


LATE_RANK = """import os
import signal
import sys
import torch
from elastic_mnist.errors import PeerFailure
from torch.distributed import PrefixStore, TCPStore
from elastic_mnist.env import DistEnv
from elastic_mnist.resilience.membership import Membership
import test_membership

store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False)
member = Membership(DistEnv(rank=1, world_size=2, launched=True), torch.device("cpu"),
                    PrefixStore("launch", store), generation=0, pg_timeout_s=60, bound_s=120)
identities = member.identities()
# It stops itself (SIGSTOP) as it begins to create the group, before it says where it listens.
member.inject = lambda phase: (phase == "creating the new group"
                               and os.kill(os.getpid(), signal.SIGSTOP))
try:
    member.recovery.next_generation(test_membership.a_change(1, 2, 1), identities, [0, 1])
except PeerFailure:
    pass  # woken, it finds generation 1 over
store.wait(["bye"])
"""


@pytest.mark.slow
def test_a_group_creation_given_up_on_that_completes_late_changes_nothing(store):
    """Rank 1 (another process) begins to create generation 1's group and freezes (SIGSTOP);
    rank 0 gives up on that group when rank 1's pulse stops, and goes on alone in generation 2.
    Rank 1 wakes, and both sides of generation 1's group complete: rank 0's, given up on,
    replaces nothing (the default process group stays generation 2's, of one)."""
    import signal
    import subprocess
    import sys

    late = subprocess.Popen([sys.executable, "-c", LATE_RANK, str(store.port)],
                            cwd=os.path.dirname(__file__))
    mine = Membership(DistEnv(rank=0, world_size=2, launched=True), torch.device("cpu"),
                      PrefixStore("launch", store.clone()), generation=0, pg_timeout_s=60,
                      bound_s=120)
    try:
        deadline = time.monotonic() + 60
        while psutil.Process(late.pid).status() != psutil.STATUS_STOPPED:
            assert time.monotonic() < deadline and late.poll() is None
            time.sleep(0.05)
        identities = mine.identities()
        with no_group_left():
            with pytest.raises(PeerFailure, match="ranks died"):  # its pulse stopped
                mine.recovery.next_generation(a_change(0, 2, 1), identities, [0, 1])
            mine.recovery.next_generation(a_change(0, 1, 2), {0: identities[0]}, [0])
            world = torch.distributed.group.WORLD
            late.send_signal(signal.SIGCONT)
            # Generation 1's group completes meanwhile (its connection comes back), however
            # long a loaded machine takes to wake rank 1; then half a second more.
            deadline, completed = time.monotonic() + 60, None
            while completed is None or time.monotonic() < completed + 0.5:
                assert torch.distributed.group.WORLD is world
                assert torch.distributed.get_world_size() == 1
                if completed is None and mine.connections.group.idle() == 2:
                    completed = time.monotonic()
                assert completed is not None or time.monotonic() < deadline, "never completed"
                time.sleep(0.05)
            assert (mine.generation, mine.broken) == (2, None)
    finally:
        late.send_signal(signal.SIGCONT)
        store.set("bye", "1")
        mine.close()
        late.wait(timeout=60)


def test_a_shrink_counts_the_agents_it_removed_by_the_nodes_numbers(members):
    """The nodes a change removed are counted by the worlds' node numbers, not by the
    identities the closer knew (a node lost before its ranks said who they were in the last
    generation is one too); removed nodes that joined in process are no agents of the launch's
    round. Rank 0 releases that many from torchrun's exit barrier at the end."""
    mine = members(0, world_size=3)
    mine.env = dataclasses.replace(mine.env, group_world_size=3)
    mine.joined_agents = {("joined", 7)}
    change = a_change(0, 1, 1)
    with no_group_left():
        mine.recovery.next_generation(change, {0: mine.identities()[0]}, [0],
                                      gone=[("joined", 7)])  # and a node it knew nothing of
    assert mine.gone_agents == 1


def test_a_late_watcher_of_a_generation_that_is_over_changes_nothing(members):
    """The watcher of generation 0 is woken by a fault, but gets to act on it only after this
    rank has moved on to generation 1 (a thread held up, a store that stalls): it must not mark
    generation 1 broken, nor fail its collectives."""
    mine, theirs = members(0), members(1)
    held, original = threading.Event(), mine.abort

    def held_up(fault, *args, **kwargs):
        if threading.current_thread().name == "membership-wake-g0":
            held.wait(20)
        return original(fault, *args, **kwargs)

    mine.abort = held_up
    old_waker = mine._waker
    with no_group_left():
        theirs.declare("died", [1])
        time.sleep(0.3)  # mine's g0 watcher is woken, and held up
        mine.recovery.next_generation(a_change(0, 1, 1), {0: mine.identities()[0]}, [0])
        pending = mine.guard(torch.futures.Future())
        held.set()
        old_waker.join(timeout=10)
        assert not old_waker.is_alive()
        assert mine.broken is None and mine.faulted is None and not pending.done()


def test_an_adoption_given_up_on_that_completes_late_changes_nothing(tiny_digits, members,
                                                                     monkeypatch):
    """Rank 1 of a new group of two waits for the agreed state from rank 0; a fault is declared
    meanwhile, and it gives up on that round (the next one follows). The state arrives only
    then, in the thread given up on: nothing of it is loaded, no wrapper is built."""
    from elastic_mnist import distributed
    from elastic_mnist.config import TrainConfig
    from elastic_mnist.data.datasets import load
    from elastic_mnist.model import state_digest
    from elastic_mnist.trainer import Trainer

    cfg = TrainConfig()
    cfg.run.device = "cpu"
    mine, theirs = members(1), members(0)
    trainer = Trainer(cfg, DistEnv(), torch.device("cpu"), load(tiny_digits, "synthetic"),
                      run_id="late", restart_generation=1, membership=mine)
    theirs_state = trainer.state()
    theirs_state["model"] = {k: v + 1 for k, v in theirs_state["model"].items()}
    arrives, gathered = threading.Event(), threading.Event()

    def late_state(*args, **kwargs):
        arrives.wait(20)
        return theirs_state

    def digests(obj, *args, **kwargs):
        gathered.set()
        return [obj, obj]

    monkeypatch.setattr(distributed, "broadcast_object", late_state)
    monkeypatch.setattr(distributed, "all_gather_object", digests)
    before, net = state_digest(trainer.model.state_dict()), trainer.engine.net
    threading.Timer(0.5, lambda: theirs.declare("died", [0], "lost")).start()
    with pytest.raises(PeerFailure):
        trainer.regroup.adopt(a_change(1, 2, 1))
    arrives.set()
    gathered.wait(5)
    time.sleep(0.5)  # whatever the thread given up on still does, it has done
    assert state_digest(trainer.model.state_dict()) == before
    assert trainer.engine.net is net and trainer.regroup.change is None


@pytest.mark.parametrize("loaded", ["as agreed", "corrupted"])
def test_a_survivor_that_holds_another_model_than_the_agreed_one_cannot_recover(
        tiny_digits, monkeypatch, loaded):
    """Every survivor's digest is gathered from the one payload broadcast, so the digests always
    agree: what each survivor then holds, once loaded and wrapped, is what is compared with
    the agreed digest, on its own (no collective more)."""
    from elastic_mnist import distributed
    from elastic_mnist.config import TrainConfig
    from elastic_mnist.data.datasets import load
    from elastic_mnist.errors import CannotRecover
    from elastic_mnist.trainer import Trainer

    cfg = TrainConfig()
    cfg.run.device = "cpu"
    trainer = Trainer(cfg, DistEnv(), torch.device("cpu"), load(tiny_digits, "synthetic"),
                      run_id="digest", restart_generation=1)
    agreed = trainer.state()
    agreed["model"] = {k: v.clone() + 1 for k, v in agreed["model"].items()}
    monkeypatch.setattr(distributed, "broadcast_object", lambda obj, *a, **k: agreed)
    monkeypatch.setattr(distributed, "all_gather_object", lambda obj, *a, **k: [obj, obj])
    load_state = trainer.regroup.load_state

    def load_and_corrupt(payload) -> None:
        load_state(payload)
        if loaded == "corrupted":
            with torch.no_grad():
                next(trainer.model.parameters()).view(-1)[0] += 1  # a bit flipped on the way

    monkeypatch.setattr(trainer.regroup, "load_state", load_and_corrupt)
    change = dataclasses.replace(a_change(0, 1, 2), env=DistEnv(), holder=1)  # takes the state
    if loaded == "as agreed":
        trainer.regroup.adopt(change)
        assert trainer.regroup.change is change
        return
    with pytest.raises(CannotRecover, match="holds another model than the agreed one"):
        trainer.regroup.adopt(change)
    assert trainer.regroup.change is None


def test_a_group_made_after_a_recovery_gets_a_backend_of_its_own():
    """The survivors' group is handed to torch through a backend name of its own, which becomes
    the default group's: a later ``new_group()`` without a backend builds a real one under that
    name; and an install that fails keeps no connected backend for a later group to take."""
    from elastic_mnist.resilience import survivors_group
    from elastic_mnist.resilience.survivors_group import connect_group, install_group

    cpu, store = torch.device("cpu"), torch.distributed.HashStore()
    with no_group_left():
        install_group(connect_group(cpu, PrefixStore("g1", store), 0, 1, TIMEOUT), cpu,
                      PrefixStore("g1", store), 0, 1, TIMEOUT)
        world = torch.distributed.group.WORLD
        group = torch.distributed.new_group([0])
        total = torch.ones(2)
        torch.distributed.all_reduce(total, group=group)
        assert group is not world and total.tolist() == [1.0, 1.0]
        with pytest.raises(ValueError, match="twice"):  # a default group is there already
            install_group(connect_group(cpu, PrefixStore("g2", store), 0, 1, TIMEOUT), cpu,
                          PrefixStore("g2", store), 0, 1, TIMEOUT)
        assert survivors_group._handed_over == []


def test_an_nccl_group_is_installed_without_connecting_again(monkeypatch):
    """On NCCL the backend is connected as it is built (in the recovery's thread): torch would
    connect it again if ``init_process_group`` were given the device; the group is bound to it
    afterwards instead. (A gloo backend stands in for NCCL's here.)"""
    from elastic_mnist.resilience.survivors_group import connect_group, install_group

    cpu, cuda, store = torch.device("cpu"), torch.device("cuda", 0), torch.distributed.HashStore()
    init, given = torch.distributed.init_process_group, []

    def spy(*args, **kwargs):
        given.append(kwargs.get("device_id"))
        return init(*args, **kwargs)

    monkeypatch.setattr(torch.distributed, "init_process_group", spy)
    with no_group_left():
        install_group(connect_group(cpu, PrefixStore("g1", store), 0, 1, TIMEOUT), cuda,
                      PrefixStore("g1", store), 0, 1, TIMEOUT)
        assert given == [None] and torch.distributed.group.WORLD.bound_device_id == cuda


def test_a_late_watcher_never_aborts_the_next_generations_nccl_group(members, monkeypatch):
    """NCCL's abort of the default group is decided under the lock the generation moves on
    under: a watcher of generation 0 that gets there only once this rank is in generation 1
    (and installed its group) aborts nothing; one in time aborts its own generation's group."""
    from elastic_mnist.resilience import membership

    mine = members(0, 1)
    aborted, late = [], [False]

    def nccl(device):
        if late[0]:
            mine.generation = 1  # the training thread moved on meanwhile
        return "nccl"

    monkeypatch.setattr(membership, "backend_for", nccl)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed.distributed_c10d, "_abort_process_group",
                        lambda *args: aborted.append(mine.generation))
    fault = Fault("died", [1], 1, "", 0.0)
    mine.abort(fault, 0)
    assert aborted == [0]
    late[0] = True
    mine.abort(fault, 0)
    assert aborted == [0] and mine.generation == 1


def test_an_nccl_group_keeps_its_connection_to_the_store(store, members, monkeypatch):
    """gloo is done with the store once its group is connected, and gives its connection back
    to the spares; NCCL's later communicators meet on it, so an NCCL group keeps it (the
    spares are refilled once the change is over)."""
    from elastic_mnist.resilience import recovery

    mine = members(0, 1)
    built: list[str] = []
    monkeypatch.setattr(recovery, "connect_group",
                        lambda device, *args: built.append(device.type) or "backend")
    monkeypatch.setattr(recovery, "install_group", lambda *args: None)
    mine.declare("died", [])  # its watcher is done: the next generation's takes its connection
    mine.recovery.next_generation(a_change(0, 1, 1), {0: mine.identities()[0]}, [0])
    assert mine.connections.group.idle() == 2
    mine.device = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)  # no group to abort
    mine.declare("died", [])
    mine.recovery.next_generation(a_change(0, 1, 2), {0: mine.identities()[0]}, [0])
    assert built == ["cpu", "cuda"] and mine.connections.group.idle() == 1


def test_the_spare_connection_is_refilled_off_the_first_step_after_a_change(tmp_path,
                                                                              monkeypatch, caplog):
    """Once the first step after a change is done, the deadline is cancelled at once; the
    spare connection a second fault took is opened in a thread of its own (a new connection
    can wait seconds on the store's resolver); and a store gone meanwhile leaves one warning,
    no exception."""
    server, (mine,) = memberships_on_a_store_that_goes(tmp_path, ranks=1)
    spares, opened = mine.connections.group, threading.Event()
    spares.take()  # a second fault took the spare
    clone = spares._store.clone

    def slow_clone():
        opened.wait(20)  # the store's server resolving this client's name
        return clone()

    monkeypatch.setattr(spares, "_store", types.SimpleNamespace(clone=slow_clone))
    mine.recovery.deadline.arm()
    deadline = mine.recovery.deadline.timer
    done = threading.Thread(target=mine.recovered)
    done.start()
    done.join(2)
    assert not done.is_alive() and mine.recovery.deadline.timer is None and deadline.finished.is_set()
    opened.set()
    mine.recovery._refilling.join(10)
    assert spares.idle() == 2
    spares.take()
    monkeypatch.setattr(spares, "_store", TCPStore("127.0.0.1", server.port, is_master=False,
                                                   timeout=datetime.timedelta(seconds=1)))
    del server  # gone
    mine.recovered()
    mine.recovery._refilling.join(20)
    assert spares.idle() == 1
    assert [r.getMessage().split(" (")[0] for r in caplog.records if r.name.endswith("recovery")
            and "spare" in r.getMessage()] == [
        "could not open a spare connection to the coordination store"]
    mine.close()


def test_a_recovery_step_in_a_generation_broken_already_runs_nothing(members):
    """A fault declared before a recovery's step begins: its collectives never start (they
    would wait in a group given up on until its timeout), and the round's failure says why."""
    mine = members(0, 2)
    mine.abort(Fault("died", [1], 1, "", 0.0))
    ran = []
    with pytest.raises(PeerFailure, match="the group changed"):
        mine.run("adopting the agreed state", lambda: ran.append(1))
    time.sleep(0.2)
    assert ran == [] and mine.recovery.failure.startswith(
        "adopting the agreed state: the group changed")


def test_a_grow_decision_names_the_joiners_and_each_rank_places_itself_from_the_nodes_sizes():
    """Rank 0's decision to admit two joiners to a job of 2 nodes of 2 names the joiners and the
    nodes' sizes, not every member (every rank reads it: W² bytes in all): an old rank keeps
    its rank, a joiner finds its own, each its node and local rank, and no member's identity is
    read unless a watcher of the new generation asks for them (once)."""
    from elastic_mnist.resilience import agreement
    from elastic_mnist.resilience.recovery import Recovery

    joiners = [agreement.Identity("c", 10 + i, 99, i, nonce=f"j{i}", serial=3) for i in range(2)]
    decision = {"generation": 4, "old_world_size": 4, "joins": [{"join": 0, "ranks": [4, 5]}],
                "joiners": [dataclasses.asdict(j) for j in joiners], "nodes": [[2, 3]]}
    reads: list[tuple[int, int]] = []
    old = {r: agreement.Identity("ab"[r // 2], r, 50 + r // 2, r % 2) for r in range(4)}

    def member(env: DistEnv, identity, joining: bool):
        return types.SimpleNamespace(
            env=env, identity=identity, joining=joining,
            identities=lambda generation, world_size: reads.append((generation, world_size))
            or dict(old))

    mine = Recovery(member(DistEnv(rank=3, world_size=4, local_rank=1, local_world_size=2,
                                   group_rank=1, group_world_size=2), old[3], False))
    change, identities = mine._grown(decision, 5, 7, 7, 0.0, 0.0)
    env = change.env
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.group_rank,
            env.group_world_size) == (3, 6, 1, 2, 1, 3)
    assert change.joined == [{"rank": 4, "host": "c", "agent": 3},
                             {"rank": 5, "host": "c", "agent": 3}]
    theirs = Recovery(member(DistEnv(rank=1, world_size=2, local_rank=1, local_world_size=2),
                             joiners[1], True))
    env = theirs._grown(decision, 5, 7, 7, 0.0, 0.0)[0].env
    assert (env.rank, env.world_size, env.local_rank, env.group_rank) == (5, 6, 1, 2)
    assert reads == []
    assert [identities[r] for r in range(6)] == [*old.values(), *joiners]
    assert reads == [(4, 4)]  # the old ranks', as they wrote them where rank 0 decided
