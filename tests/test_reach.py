"""A node cut off from its peers on the data network, named (elastic_mnist/resilience/reach.py):
which nodes to go on without, tries that reach or do not, the address tried from, and the
verdict from the heartbeats. In milliseconds, on loopback; a real cut between hosts of their own
is `make partitions`' data-30 and out-30 cases."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import pytest
import torch.distributed as dist

from elastic_mnist.resilience import findings, reach
from elastic_mnist.resilience.heartbeat import Heartbeat


def test_the_fewest_nodes_go_and_the_job_keeps_rank_0s_side():
    # Node 4 (first rank 4) reaches nobody, and nobody reaches it: it goes alone.
    assert reach.cut_off({4: {0, 2}, 0: {4}}, {0, 2, 4}) == [4]
    # One way only (the others say so; the cut one reports nothing): the same.
    assert reach.cut_off({0: {4}, 2: {4}}, {0, 2, 4}) == [4]
    # Two nodes that cannot reach each other: the one without rank 0 goes.
    assert reach.cut_off({0: {2}, 2: {0}}, {0, 2}) == [2]
    # Nothing cut, or nothing said: nobody.
    assert reach.cut_off({}, {0, 2, 4}) == []
    assert reach.cut_off({0: set()}, {0, 2}) == []
    # A node no longer in the generation is no reason to drop anyone.
    assert reach.cut_off({0: {9}}, {0, 2}) == []
    # Two cut off, each from every other: both go.
    assert reach.cut_off({0: {4, 6}, 2: {4, 6}, 4: {0, 2, 6}, 6: {0, 2, 4}},
                         {0, 2, 4, 6}) == [4, 6]


def beat(rank: int, node: int, unreachable: list[int] | None = None) -> Heartbeat:
    return Heartbeat(rank=rank, step=7, beat=3, busy="", host="h", pid=rank, ppid=node,
                     waiting=True, node=node, unreachable=unreachable or [])


def test_the_verdict_names_every_rank_of_the_node_cut_off():
    beats = {0: beat(0, 0, [4]), 1: beat(1, 0), 2: beat(2, 2, [4]), 3: beat(3, 2),
             4: beat(4, 4, [0, 2]), 5: beat(5, 4)}
    ranks, why = reach.cut_off_ranks(beats)
    assert ranks == [4, 5]
    assert why.startswith("cut off from its peers on the data network (node of rank 0 could "
                          "not reach the node(s) of rank(s) 4;")
    assert reach.cut_off_ranks({r: beat(r, r - r % 2) for r in range(6)}) == ([], "")


def test_a_try_reaches_a_listener_and_not_a_closed_port():
    listener = reach.Listener("127.0.0.1")
    with socket.socket() as s:  # a port that nobody listens on any more
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    try:
        began = time.monotonic()
        found = reach.unreachable("127.0.0.1", {0: listener.address, 2: closed,
                                                4: "127.0.0.1:notaport"}, timeout_s=2.0)
        assert found == {2, 4}
        assert time.monotonic() - began < 1.0  # refused at once: no wait for the timeout
        assert reach.unreachable("127.0.0.1", {0: listener.address}) == set()
    finally:
        listener.close()
    assert reach.unreachable("127.0.0.1", {0: listener.address}, timeout_s=0.5) == {0}


def test_a_lost_syn_is_sent_again_within_the_bound_not_after_tcps_second():
    """A listener whose accept queue is full drops a SYN silently, as a lossy link does; once it
    accepts again, a try sent again beside the first (every RESEND_S) connects at once, where
    TCP's own retransmission of the lost SYN would come only after a second."""
    full = socket.create_server(("127.0.0.1", 0), backlog=0)
    address = f"127.0.0.1:{full.getsockname()[1]}"
    fillers = []
    for _ in range(4):  # the queue is full: later SYNs are dropped
        f = socket.socket()
        f.setblocking(False)
        f.connect_ex(("127.0.0.1", full.getsockname()[1]))
        fillers.append(f)
    time.sleep(0.1)

    def drain():
        time.sleep(0.3)
        full.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:
                full.accept()[0].close()

    try:
        threading.Thread(target=drain, daemon=True).start()
        began = time.monotonic()
        assert reach.unreachable("127.0.0.1", {0: address}, timeout_s=0.9) == set()
        assert time.monotonic() - began < 0.9
    finally:
        for f in fillers:
            f.close()
        full.close()


def test_the_data_address_follows_the_backends_interface_variable():
    from elastic_mnist.addresses import bindable_addresses, gloo_address

    assert reach.data_address("gloo", {"GLOO_SOCKET_IFNAME": "no-such-if0,lo"}) == "127.0.0.1"
    assert reach.data_address("gloo", {"GLOO_SOCKET_IFNAME": "no-such-if0"}) is None
    assert reach.data_address("nccl", {"NCCL_SOCKET_IFNAME": "=lo",
                                       "GLOO_SOCKET_IFNAME": "no-such-if0"}) == "127.0.0.1"
    host_name = gloo_address(bindable_addresses(socket.gethostname()))
    assert reach.data_address("gloo", {}) == host_name
    assert reach.data_address("gloo", {"GLOO_SOCKET_IFNAME": "x"}) == host_name  # torch: unset
    assert reach.data_address("nccl", {"NCCL_SOCKET_IFNAME": "^docker"}) == host_name


class Store:
    """The generation's store, as the watchdog's bounded call reaches it."""

    def __init__(self):
        self.values: dict[str, bytes] = {}
        self.counts: dict[str, int] = {}

    def add(self, key, n):
        self.counts[key] = self.counts.get(key, 0) + n
        return self.counts[key]

    def set(self, key, value):
        self.values[key] = value.encode()

    def multi_get(self, keys):
        return [self.values[k] for k in keys]


def wait_for(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def two_nodes(store) -> tuple[reach.ReachWatch, reach.ReachWatch]:
    """The first workers of nodes 0 and 2, listening, each said where in ``store``."""
    call = lambda method, *args: method(*args)
    watches = tuple(reach.ReachWatch(node, reach.Listener("127.0.0.1"), store, call)
                    for node in (0, 2))
    for watch in watches:
        watch.announce()
    return watches


@pytest.mark.parametrize("stalled_s", [None, 0.5])
def test_a_node_tries_only_once_its_step_waited_long_enough_and_says_what_it_found(stalled_s):
    store = dist.HashStore()
    mine, theirs = two_nodes(store)
    said = lambda: json.loads(store.get(f"{reach.FOUND}/0"))
    try:
        mine.beat(stalled_s, 1.0, step=7)  # busy, or waiting 0.5 s of the 1 s: no try
        assert mine._trying is None and mine.found == []
        mine.beat(1.5, 1.0, step=7)
        mine._trying.join(timeout=5)
        assert mine.found == [] and mine._targets == {2: theirs.listener.address}
        assert said() == {"step": 7, "found": []} and store.add(reach.CUTS, 0) == 0
        theirs.listener.close()  # node 2 stops answering
        mine.beat(1.5, 1.0, step=7)  # tried once in this wait: not again before TRY_AGAIN_S
        assert not mine._trying.is_alive() and mine.found == []
        mine.beat(0.1, 1.0, step=7)  # the next wait
        mine.beat(1.5, 1.0, step=7)
        wait_for(lambda: mine.found == [2])
        mine._trying.join(timeout=5)
        assert said() == {"step": 7, "found": [2]} and store.add(reach.CUTS, 0) == 1
        mine.beat(0.1, 1.0, step=8)  # a step completed: nothing found any more
        assert mine.found == []
    finally:
        mine.listener.close()
        theirs.listener.close()


def test_a_node_looks_ten_times_a_second_whether_to_try():
    store = dist.HashStore()
    mine, theirs = two_nodes(store)
    theirs.listener.close()
    stalled, stop = [0.5], threading.Event()
    try:
        mine.watch(lambda: stalled[0], lambda: 1.0, lambda: 3, stop)
        time.sleep(0.3)
        assert not store.check([f"{reach.FOUND}/0"])  # waited too little: no try
        began, stalled[0] = time.monotonic(), 1.0
        wait_for(lambda: store.check([f"{reach.FOUND}/0"]))
        assert json.loads(store.get(f"{reach.FOUND}/0")) == {"step": 3, "found": [2]}
        assert time.monotonic() - began < 0.3 + reach.LOOK_S  # refused: found at once
    finally:
        stop.set()
        mine.listener.close()


def test_only_a_nodes_first_worker_with_an_address_tries():
    call = lambda method, *args: method(*args)
    assert reach.reach_for(5, 1, "gloo", Store(), call) is reach.NO_REACH
    watch = reach.reach_for(4, 0, "gloo", Store(), call)
    assert isinstance(watch, reach.ReachWatch) and watch.node == 4
    # The listener is the process's: it outlives the generation (a change's survey tries it).
    watch.close()
    again = reach.reach_for(4, 0, "gloo", Store(), call)
    assert again.listener is watch.listener
    assert reach.unreachable("0.0.0.0", {4: watch.listener.address}) == set()


def announced(store, prefix: str, nodes: list[int]) -> dict[int, reach.Listener]:
    """Each node's first worker, listening, said where in the generation ``prefix``."""
    listeners = {node: reach.Listener("127.0.0.1") for node in nodes}
    for i, (node, listener) in enumerate(listeners.items()):
        store.add(f"{prefix}{reach.NODES}", 1)
        store.set(f"{prefix}{reach.NODES}/{i}", f"{node} {listener.address}")
    return listeners


def test_a_change_goes_on_without_the_node_its_new_group_cannot_be_built_across():
    """One way of node 4's data link dropped: its own collective fails at once, every rank
    checks in (each reaches the store), and the new group of all six can never be built. The
    survey made as the round began (where the change began: g3; this round: g4) names node 4,
    once the tries are done, and only while the group is not built."""
    store, began, prefix = dist.HashStore(), "g3/", "g4/"
    listeners = announced(store, began, [0, 2, 4])
    listeners[4].close()  # its peers do not hear it; it still reaches them
    try:
        for node in (0, 2, 4):
            findings.survey(lambda: store, began, prefix, node, listeners[node]).join(timeout=10)
        assert json.loads(store.get(f"{prefix}{reach.FOUND}/0")) == {"step": None, "found": [4]}
        assert json.loads(store.get(f"{prefix}{reach.FOUND}/4"))["found"] == []
        # The new group's ranks, each with its node where the change began.
        survey = findings.Survey(store, prefix, {0: 0, 1: 0, 2: 2, 3: 2, 4: 4, 5: 4})
        assert survey.cut(0.5) == ([], "")  # a group over a sound network is built by then
        ranks, why = survey.cut(reach.CONNECT_S)
        assert ranks == [4, 5]
        assert why.startswith("the new group cannot be built across a cut on the data network "
                              "(node of rank 0 could not reach the node(s) of rank(s) 4;")
        # Healed as the group waits: nodes 0 and 2 try again and say so; read anew, nobody.
        for node in (0, 2):
            store.set(f"{prefix}{reach.FOUND}/{node}", json.dumps({"step": None, "found": []}))
        assert survey.cut(reach.CONNECT_S) == ([], "")
        # Without node 4 in the new group: nobody.
        assert findings.Survey(store, prefix, {0: 0, 1: 2}).cut(reach.CONNECT_S) == ([], "")
        # What a generation's own tries said is no survey's.
        store.set(f"{prefix}{reach.FOUND}/0", json.dumps({"step": 7, "found": [4]}))
        assert survey.cut(reach.CONNECT_S) == ([], "")
    finally:
        for listener in listeners.values():
            listener.close()


def test_a_prober_names_the_cut_node_as_soon_as_every_node_has_said_in_this_wait():
    """The generation's nodes (first ranks 0, 2, 4; node 2 never said where it listens) tried
    each other while the step after step 7 waited: the prober's look names node 4's ranks, by
    the nodes the heartbeats name, as soon as all three said, with no wait for the hang
    verdict; what was said in an earlier wait counts for nothing."""
    store = dist.HashStore()
    listeners = announced(store, "", [0, 4])
    step = [7]
    nodes = {0: 0, 1: 0, 2: 2, 3: 2, 4: 4, 5: 4}
    look = findings.Cuts(store, lambda method, *args: method(*args), lambda: nodes, lambda: step[0])
    say = lambda node, found, at=7: store.set(f"{reach.FOUND}/{node}",
                                              json.dumps({"step": at, "found": found}))
    try:
        assert look(None) == ([], "") and look(0.1) == ([], "")  # nobody found a cut yet
        say(0, [4])
        store.add(reach.CUTS, 1)
        say(2, [4], at=6)  # an earlier wait's: not yet said in this one
        assert look(0.1) == ([], "")
        say(2, [4])
        say(4, [0, 2])
        ranks, why = look(0.2)
        assert ranks == [4, 5] and why.startswith("cut off from its peers on the data network")
        step[0] = 9  # a later wait: what was said in the last counts for nothing
        assert look(findings.Cuts.PATIENCE_S) == ([], "")
    finally:
        for listener in listeners.values():
            listener.close()


def test_a_cut_found_in_a_wait_that_ended_is_taken_back():
    """A blip: node 0 found node 2 out of reach, and the step's wait ended (the link healed).
    What it found is taken back at once, so that another wait of the same step (the next
    collective of that step, an evaluation's) reads no stale cut."""
    store = dist.HashStore()
    call = lambda method, *args: method(*args)
    listeners = announced(store, "", [0, 2])
    mine = reach.ReachWatch(0, listeners[0], store, call)
    try:
        mine._say(7, [2])
        assert json.loads(store.get(f"{reach.FOUND}/0")) == {"step": 7, "found": [2]}
        mine.beat(0.2, 1.0, step=7)  # the wait ended
        assert json.loads(store.get(f"{reach.FOUND}/0")) == {"step": 7, "found": []}
    finally:
        for listener in listeners.values():
            listener.close()


def test_one_nodes_word_alone_drops_nobody():
    """Node 0 alone said what it found: until the patience ends the others may yet say; after,
    a pair whose other node never said is no cut (one side cannot tell which side is cut
    off), whichever is the higher. Once both said, the pair is cut, and the node without
    rank 0 goes."""
    store, prefix = dist.HashStore(), "g5/"
    say = lambda node, found: store.set(f"{prefix}{reach.FOUND}/{node}",
                                        json.dumps({"step": None, "found": found}))
    say(4, [2])  # the higher node's word against the lower
    survey = findings.Survey(store, prefix, {0: 0, 1: 2, 2: 4})
    assert survey.cut(reach.CONNECT_S) == ([], "")
    say(0, [])
    assert survey.cut(2 * reach.CONNECT_S) == ([], "")  # node 2 never said: nobody
    say(2, [4])
    assert survey.cut(reach.CONNECT_S)[0] == [2]
    # Nothing found anywhere: nobody, however long the group waits.
    say(2, [])
    say(4, [])
    assert findings.Survey(store, prefix, {0: 2, 1: 4}).cut(60.0) == ([], "")


def test_rank_0_admits_a_joining_node_only_once_it_answers_on_the_data_network(monkeypatch,
                                                                              caplog):
    """A node ready to join that reaches the store but not its peers (its data link still cut)
    is not admitted: the new group's creation would hold every rank until the heal."""
    from types import SimpleNamespace

    import torch

    from elastic_mnist.resilience import admissions

    monkeypatch.setattr(admissions, "data_address", lambda backend: "127.0.0.1")
    store = Store()
    store.check = lambda keys: all(k in store.values for k in keys)
    store.get = lambda key: store.values[key]
    rank0 = admissions.Admissions.__new__(admissions.Admissions)
    rank0.member = SimpleNamespace(connections=SimpleNamespace(declare=store),
                                   device=torch.device("cpu"))
    rank0.round, rank0._unreached = 3, set()
    assert rank0._reachable(0)  # it said nowhere: tried by nobody, admitted as before
    listener = reach.Listener("127.0.0.1")
    store.set(admissions.join_key(3, 0, "reach"), listener.address)
    assert rank0._reachable(0)
    listener.close()
    with caplog.at_level("WARNING"):
        assert not rank0._reachable(0) and not rank0._reachable(0)
    assert caplog.text.count("does not answer on the data network") == 1  # said once


def test_the_survey_finds_what_the_generations_watchdog_announced_under_the_launchs_prefix():
    """The keys meet as the job makes them: the watchdog announces on the generation's store
    (``Membership.generation_store``: a prefix ``g<n>`` over a clone of the launch's store), a
    round's survey reads that through ``Membership.key`` on a clone of its own, and the
    round's watchers read what it found on the launch's store."""
    import datetime

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    launch = dist.PrefixStore("launch", dist.TCPStore(
        "127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=10)))
    call = lambda method, *args: method(*args)
    mine, theirs = reach.Listener("127.0.0.1"), reach.Listener("127.0.0.1")
    try:
        for node, listener in ((0, mine), (2, theirs)):
            reach.ReachWatch(node, listener, dist.PrefixStore("g3", launch.clone()),
                             call).announce()
        theirs.close()
        findings.survey(launch.clone, "g3/", "g4/", 0, mine).join(timeout=10)
        assert json.loads(launch.get(f"g4/{reach.FOUND}/0")) == {"step": None, "found": [2]}
        launch.set(f"g4/{reach.FOUND}/2", json.dumps({"step": None, "found": [0]}))
        assert findings.Survey(launch, "g4/", {0: 0, 1: 2}).cut(reach.CONNECT_S)[0] == [1]
    finally:
        mine.close()
