"""A node cut off from its peers on the data network, named (elastic_mnist/resilience/reach.py):
which nodes to go on without, tries that reach or do not, the address tried from, and the
verdict from the heartbeats. In milliseconds, on loopback; a real cut between hosts of their own
is `make partitions`' data-30 and out-30 cases."""

from __future__ import annotations

import socket
import time

import pytest

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


@pytest.mark.parametrize("stalled_s", [None, 1.0])
def test_a_node_tries_only_once_its_step_waited_half_the_deadline(stalled_s):
    store = Store()
    call = lambda method, *args: method(*args)
    mine = reach.ReachWatch(0, reach.Listener("127.0.0.1"), store, call)
    theirs = reach.ReachWatch(2, reach.Listener("127.0.0.1"), store, call)
    mine.announce()
    theirs.announce()
    try:
        mine.beat(stalled_s, 10.0)  # busy, or waiting 1 s of a 10 s deadline: no try
        assert mine._trying is None and mine.found == []
        mine.beat(6.0, 10.0)
        mine._trying.join(timeout=5)
        assert mine.found == [] and mine._targets == {2: theirs.listener.address}
        theirs.close()  # node 2 stops answering
        mine.beat(6.0, 10.0)
        wait_for(lambda: mine.found == [2])
        mine.beat(0.1, 10.0)  # a step completed: nothing found any more
        assert mine.found == []
    finally:
        mine.close()
        theirs.close()


def test_only_a_nodes_first_worker_with_an_address_tries():
    call = lambda method, *args: method(*args)
    assert reach.reach_for(5, 1, "gloo", Store(), call) is reach.NO_REACH
    watch = reach.reach_for(4, 0, "gloo", Store(), call)
    try:
        assert isinstance(watch, reach.ReachWatch) and watch.node == 4
    finally:
        watch.close()


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
