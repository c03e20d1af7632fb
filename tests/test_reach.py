"""A node cut off from its peers on the data network, named (elastic_mnist/resilience/reach.py):
which nodes to go on without, tries that reach or do not, the address tried from, and the
verdict from the heartbeats. In milliseconds, on loopback; a real cut between hosts of their own
is `make partitions`' data-30 and out-30 cases."""

from __future__ import annotations

import json
import socket
import time

import pytest
import torch.distributed as dist

from elastic_mnist.resilience import reach
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


@pytest.mark.parametrize("stalled_s", [None, 0.5])
def test_a_node_tries_only_once_its_step_waited_long_enough_and_says_what_it_found(stalled_s):
    store = dist.HashStore()
    call = lambda method, *args: method(*args)
    mine = reach.ReachWatch(0, reach.Listener("127.0.0.1"), store, call)
    theirs = reach.ReachWatch(2, reach.Listener("127.0.0.1"), store, call)
    mine.announce()
    theirs.announce()
    said = lambda: json.loads(store.get(f"{reach.FOUND}/0"))
    try:
        mine.beat(stalled_s, 1.0, step=7)  # busy, or waiting 0.5 s of the 1 s: no try
        assert mine._trying is None and mine.found == []
        mine.beat(1.5, 1.0, step=7)
        mine._trying.join(timeout=5)
        assert mine.found == [] and mine._targets == {2: theirs.listener.address}
        assert said() == {"step": 7, "found": []} and store.add(reach.CUTS, 0) == 0
        theirs.listener.close()  # node 2 stops answering
        mine.beat(1.5, 1.0, step=7)
        wait_for(lambda: mine.found == [2])
        mine._trying.join(timeout=5)
        assert said() == {"step": 7, "found": [2]} and store.add(reach.CUTS, 0) == 1
        mine.beat(0.1, 1.0, step=8)  # a step completed: nothing found any more
        assert mine.found == []
    finally:
        mine.listener.close()
        theirs.listener.close()


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
    survey made as the change began names node 4, once the tries are done."""
    store, prefix = dist.HashStore(), "g3/"
    listeners = announced(store, prefix, [0, 2, 4])
    listeners[4].close()  # its peers do not hear it; it still reaches them
    try:
        for node in (0, 2, 4):
            reach.survey(store, prefix, node, listeners[node]).join(timeout=10)
        assert json.loads(store.get(f"{prefix}{reach.FOUND}/0")) == {"step": None, "found": [4]}
        assert json.loads(store.get(f"{prefix}{reach.FOUND}/4"))["found"] == []
        # The new group's ranks, each with its node in the surveyed generation.
        survey = reach.Survey(store, prefix, {0: 0, 1: 0, 2: 2, 3: 2, 4: 4, 5: 4})
        assert survey.cut(0.5) == ([], "")  # a group over a sound network is built by then
        ranks, why = survey.cut(reach.CONNECT_S)
        assert ranks == [4, 5]
        assert why.startswith("the new group cannot be built across a cut on the data network "
                              "(node of rank 0 could not reach the node(s) of rank(s) 4;")
        # Without node 4 in the new group: nobody.
        assert reach.Survey(store, prefix, {0: 0, 1: 2}).cut(reach.CONNECT_S) == ([], "")
    finally:
        for listener in listeners.values():
            listener.close()


def test_a_prober_names_the_cut_node_as_soon_as_every_node_has_said_in_this_wait():
    """The generation's nodes (first ranks 0, 2, 4) tried each other while the step after step
    7 waited: the prober's look names node 4's ranks as soon as all three said, with no wait
    for the hang verdict; what was found in an earlier wait counts for nothing."""
    store, prefix = dist.HashStore(), ""
    listeners = announced(store, prefix, [0, 2, 4])
    step = [7]
    look = reach.Cuts(store, lambda method, *args: method(*args), 6, lambda: step[0])
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
        assert look(reach.Cuts.PATIENCE_S) == ([], "")
    finally:
        for listener in listeners.values():
            listener.close()


def test_a_survey_waits_for_every_nodes_word_then_goes_on_with_what_was_said():
    """Node 0 alone has said what it found: until twice the tries' bound, the others may yet
    say (a verdict from one side could drop the wrong node); after, what was said decides."""
    store, prefix = dist.HashStore(), "g5/"
    say = lambda node, found: store.set(f"{prefix}{reach.FOUND}/{node}",
                                        json.dumps({"step": None, "found": found}))
    say(0, [2])
    survey = reach.Survey(store, prefix, {0: 0, 1: 2, 2: 4})
    assert survey.cut(reach.CONNECT_S) == ([], "")
    say(4, [])
    assert survey.cut(2 * reach.CONNECT_S - 0.1) == ([], "")
    assert survey.cut(2 * reach.CONNECT_S)[0] == [1]
    # Nothing found anywhere: nobody, however long the group waits.
    say(2, [])
    assert reach.Survey(store, prefix, {0: 2, 1: 4}).cut(60.0) == ([], "")


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
