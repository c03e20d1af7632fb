"""Our rendezvous backend (elastic_mnist/resilience/agents.py, the rooms beside it, roster.py):
several agents' handlers in this process on a real TCPStore, each in a thread as torchrun's agents
would call them, and one real launch of two torchrun agents with ``--rdzv_backend=elastic-mnist``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import select
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata

import psutil
import pytest
import torch.distributed as dist
from launch import REPO, clean_env, free_port, kill_tree
from test_listening import readme_table, resolved
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousParameters,
)
from torch.distributed.elastic.utils.store import barrier

from elastic_mnist.resilience import agents, exit_barrier, keep_alive, plugin
from elastic_mnist.resilience.agent_settings import Settings
from elastic_mnist.resilience.agents import AgentsHandler, GracefulExit
from elastic_mnist.resilience.roster import (
    LOOKED_AT_S,
    JobRecord,
    Liveness,
    Roster,
    look_interval,
)


@pytest.fixture(autouse=True)
def own_environment():
    """The handlers export variables into this process's environment: put it back after."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def store():
    """A rendezvous store served apart, as ``elastic-mnist rendezvous`` serves it."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


class Agents:
    """Handlers of one rendezvous made as torchrun makes them (``--rdzv_conf`` strings), shut
    down at the end."""

    def __init__(self, port: int, nnodes: str, **conf: object):
        self.port = port
        self.min, _, top = nnodes.partition(":")
        self.max = top or self.min
        self.conf = {"is_host": "false", "keep_alive_interval": "0.1", "last_call_timeout": "0.3",
                     **{k: str(v) for k, v in conf.items()}}
        self.made: list[AgentsHandler] = []

    def __call__(self, nproc: int = 1, **conf: object) -> AgentsHandler:
        params = RendezvousParameters("elastic-mnist", f"127.0.0.1:{self.port}", "job",
                                      int(self.min), int(self.max),
                                      **{**self.conf, **{k: str(v) for k, v in conf.items()}})
        handler = AgentsHandler(Settings.from_params(params), nproc=nproc)
        self.made.append(handler)
        return handler

    def shutdown(self) -> None:
        for handler in self.made:
            handler.shutdown()


@pytest.fixture
def make(store):
    made = Agents(store.port, "1")

    def factory(nnodes: str, **conf: object) -> Agents:
        made.min, _, top = nnodes.partition(":")
        made.max = top or made.min
        made.conf.update({k: str(v) for k, v in conf.items()})
        return made

    yield factory
    made.shutdown()


def rendezvous(handlers: list[AgentsHandler], stagger_s: float = 0.05) -> list:
    """Each handler's ``next_rendezvous()`` (or what it raised) from a thread of its own, started
    in list order ``stagger_s`` apart: the arrival order."""
    with ThreadPoolExecutor(len(handlers)) as pool:
        futures = []
        for handler in handlers:
            futures.append(pool.submit(handler.next_rendezvous))
            time.sleep(stagger_s)
        return [f.exception() or f.result() for f in futures]


def wait_for_a_waiting_node(handler: AgentsHandler, within_s: float) -> None:
    """Asks ``handler`` as torch's agent does until one node waits in the next round."""
    deadline = time.monotonic() + within_s
    while handler.num_nodes_waiting() != 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def ranks(infos: list) -> list[tuple[int, int]]:
    return [(info.rank, info.world_size) for info in infos]


def test_rounds_close_at_max_at_once_or_after_the_last_call_ranks_by_name(store, make):
    """A round closes as soon as ``--nnodes``' maximum arrived, or ``last_call_timeout`` after the
    minimum did; group ranks follow the agents' names and pids, not their arrival (in one process
    here: their serials); the agents export the rendezvous to their
    workers; the agent on the endpoint's host serves the store, the others connect to it when its
    port is taken (no ``is_host`` given: all of them are on this machine)."""
    port = free_port()
    hosted = Agents(port, "2:3", is_host=None)
    del hosted.conf["is_host"]
    try:
        a, b, c = hosted(), hosted(), hosted()
        assert a.server is not None and b.server is None and c.server is None
        start = time.monotonic()
        infos = rendezvous([b, c, a])
        assert time.monotonic() - start < 1.0  # at the maximum: no last call
        assert ranks(infos) == [(1, 3), (2, 3), (0, 3)]
        assert all(isinstance(info.store, exit_barrier.ExitStore) for info in infos)
        assert (infos[0].bootstrap_store_info.master_addr,
                infos[0].bootstrap_store_info.master_port) == ("127.0.0.1", port)
        assert b.environment == {
            "TORCH_ELASTIC_WORKER_IDENTICAL": "1", "ELASTIC_MNIST_RDZV": f"127.0.0.1:{port}",
            "ELASTIC_MNIST_RDZV_ID": "job", "ELASTIC_MNIST_AGENT": str(b.serial),
            "ELASTIC_MNIST_KEEP_ALIVE": "0.1,3", "ELASTIC_MNIST_ROUND": "0"}
        assert [a.num_nodes_waiting(), b.num_nodes_waiting()] == [0, 0]
    finally:
        hosted.shutdown()

    # 1:3 with two agents: the round waits last_call_timeout after the first, then closes.
    d, e = make("1:3", last_call_timeout=0.6)(), make("1:3")()
    start = time.monotonic()
    infos = rendezvous([d, e])
    assert 0.6 <= time.monotonic() - start < 2.0
    assert ranks(infos) == [(0, 2), (1, 2)]


def test_a_node_with_another_nproc_is_refused_in_one_line(make):
    agents_ = make("1:2", last_call_timeout=0.5)
    two, one = agents_(nproc=2), agents_(nproc=1)
    infos = rendezvous([two, one], stagger_s=0.2)
    assert ranks(infos[:1]) == [(0, 1)]  # the round closed without the refused node
    assert isinstance(infos[1], RendezvousError)
    assert str(infos[1]) == (f"this node has --nproc_per_node=1, the job's nodes have 2 (agent "
                             f"{two.serial} on {socket.gethostname()}): every node of a job "
                             f"needs the same")


def test_bad_rdzv_conf_is_one_line():
    params = RendezvousParameters("elastic-mnist", "127.0.0.1:1", "job", 1, 1,
                                  keep_alive_interval="soon")
    with pytest.raises(ValueError, match=r"^--rdzv_conf keep_alive_interval='soon': a number of "
                                         r"seconds above 0 is expected$"):
        Settings.from_params(params)


class Proxy:
    """A TCP proxy in front of the store whose :meth:`pause` holds every byte until
    :meth:`resume`: the store stalls for its clients, their connections stay open; :meth:`cut`
    closes every connection made so far, as a store's restart or a network fault would."""

    def __init__(self, port: int):
        self.target = port
        self.connections: list[socket.socket] = []
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.flowing = threading.Event()
        self.flowing.set()
        threading.Thread(target=self._accept, daemon=True).start()

    def pause(self) -> None:
        self.flowing.clear()

    def resume(self) -> None:
        self.flowing.set()

    def cut(self) -> None:
        for sock in self.connections:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _accept(self) -> None:
        while True:
            client, _ = self.server.accept()
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self.connections += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        peer = {a: b, b: a}
        while True:
            for sock in select.select([a, b], [], [], 0.05)[0]:
                self.flowing.wait()
                data = sock.recv(65536)
                if not data:
                    a.close()
                    b.close()
                    return
                peer[sock].sendall(data)


def test_keep_alives_go_on_after_a_store_stall_and_a_dead_agent_is_seen_in_time(store, caplog):
    """The store stalls for 1 s, over three times interval × attempts (0.1 s × 3). torch 2.14's own
    keep-alive never writes again after that (torchrun-facts.md, fact 16); ours go on as soon as
    the store answers, and nobody was judged dead meanwhile: the readers' own counters stood
    still too. An agent whose keep-alive stops is judged dead within interval × attempts (and
    one read), an agent that shut down at once. Connections cut: each keep-alive says so once,
    connects again and goes on."""
    proxy = Proxy(store.port)
    agents_ = Agents(proxy.port, "1")
    try:
        a, b, c, d = (agents_() for _ in range(4))
        direct = Roster(store, "job")
        reader = Liveness(direct, a.serial, 3)
        serials = [a.serial, b.serial, c.serial, d.serial]
        time.sleep(0.35)
        assert reader.dead(serials) == set()

        before = direct.keep_alives(serials)
        proxy.pause()
        for _ in range(10):  # judged all along the stall
            time.sleep(0.1)
            assert reader.dead(serials) == set()
        assert direct.keep_alives(serials) == before  # nothing got through
        proxy.resume()
        time.sleep(0.5)
        after = direct.keep_alives(serials)
        assert all(later >= earlier + 2 for earlier, later in zip(before, after)), (before, after)
        assert reader.dead(serials) == set()

        c.keep_alive.stop()  # c's process froze or died: its counter stands still
        d.shutdown()
        stopped = time.monotonic()
        assert reader.dead(serials) == {d.serial}
        while reader.dead(serials) != {c.serial, d.serial}:
            assert time.monotonic() - stopped < 0.1 * 3 + 0.2 + 0.2
            time.sleep(0.02)

        caplog.set_level(logging.WARNING, logger=keep_alive.__name__)
        before = direct.keep_alives(serials[:2])
        proxy.cut()
        time.sleep(0.6)
        after = direct.keep_alives(serials[:2])
        assert all(later >= earlier + 2 for earlier, later in zip(before, after)), (before, after)
        said = sorted(r.getMessage().split(" (")[0] for r in caplog.records)
        assert said == sorted([f"agent {n}'s keep-alive cannot reach the store" for n in serials[:2]]
                              + [f"agent {n}'s keep-alive reaches the store again"
                                 for n in serials[:2]]), said
    finally:
        proxy.resume()
        agents_.shutdown()


def test_departures_are_read_each_once_and_one_unnamed_hides_none_after_it(store):
    """An agent that shuts down is named in the order of departures: a reader reads each new
    one once (asking every agent whether it left, whenever one did, was N² operations); one lost
    between its count and its name is looked for again, and the ones after it are read."""
    roster = Roster(store, "job")
    for serial in (1, 2, 3, 4):
        roster.keep_alive(serial)
    reader = Liveness(Roster(store.clone(), "job"), 1, 3)
    assert reader.dead([1, 2, 3, 4]) == set()
    store.add(roster.key("gone"), 1)  # agent 2 counted itself and was lost before its name
    roster.leave(3)
    assert reader.dead([1, 2, 3, 4]) == {3} and reader.unread == {0}
    store.set(roster.key("gone/at/0"), "2")  # named late
    assert reader.dead([1, 2, 3, 4]) == {2, 3} and reader.unread == set()


def test_an_agent_reads_no_more_than_16_keep_alives_a_second_while_its_workers_run(store,
                                                                                   make):
    """Between rounds, each agent looks at the job's agents' keep-alives (to know the dead at
    the exit barrier) twice per keep-alive interval, and no more than LOOKED_AT_S keep-alives a
    second: each of N agents reading all N every 2.5 s was N² reads (make scale)."""
    assert look_interval(5.0, 4) == look_interval(5.0, 40) == 2.5
    assert look_interval(5.0, 1000) == 1000 / LOOKED_AT_S
    agent = make("1", keep_alive_interval=5)()
    [info] = rendezvous([agent])
    assert ranks([info]) == [(0, 1)]
    roster = Roster(store, "job")
    nodes = [agent.serial] + [agent.serial + n for n in range(1, 200)]
    for serial in nodes[1:]:
        roster.keep_alive(serial)
    roster.publish_job(JobRecord(round=agent.round, launch="x", generation=1, nodes=nodes,
                                 world_size=200, in_process=True, run_id="job", finished=False))
    looked = time.monotonic()
    agent.num_nodes_waiting()
    assert agent.next_look - looked == pytest.approx(200 / LOOKED_AT_S, abs=0.5)
    read = agent.liveness.watch.seen.copy()
    assert len(read) == 200
    roster.keep_alive(nodes[5])  # a look now would see it move
    agent.num_nodes_waiting()  # not due: nothing read
    assert agent.liveness.watch.seen == read


def test_restart_path_moves_the_round_and_the_others_count_the_waiting(store, make):
    """An agent whose workers failed, with no job running in process, moves the rendezvous to the
    next round and arrives there; the others' ``num_nodes_waiting()`` counts it, so they restart
    as torch's agents do, into one round. A job that runs in process but whose beat stood
    still (every worker failed at once) is dead: the restart path again."""
    agents_ = make("1:3", keep_alive_interval=0.1, last_call_timeout=0.3)
    a, b = agents_(), agents_()
    assert ranks(rendezvous([a, b])) == [(0, 2), (1, 2)]

    with ThreadPoolExecutor(1) as pool:
        restarted = pool.submit(a.next_rendezvous)  # a's workers failed
        wait_for_a_waiting_node(b, within_s=5)
        b_info = b.next_rendezvous()  # as torch's agent does when a node waits
        a_info = restarted.result(timeout=5)
    assert (a.round, b.round) == (1, 1)
    assert ranks([a_info, b_info]) == [(0, 2), (1, 2)]
    assert a.num_nodes_waiting() == b.num_nodes_waiting() == 0

    direct = Roster(a.store, "job")
    # A job whose beat may stand still up to 1 s (a recovery under way: no rank 0 beats yet).
    direct.publish_job(JobRecord(round=1, launch="x", generation=0, nodes=[a.serial, b.serial],
                                 world_size=2, in_process=True, run_id="job", finished=False,
                                 quiet_s=1.0))
    with ThreadPoolExecutor(1) as pool:
        start = time.monotonic()
        restarted = pool.submit(b.next_rendezvous)  # no beat: the job is dead
        wait_for_a_waiting_node(a, within_s=5)
        # Judged by b's own keep-alive, not at once, and not within the job's quiet time.
        assert time.monotonic() - start >= 1.0
        a.next_rendezvous()
        assert restarted.result(timeout=5).rank == 1 and b.round == 2  # a's serial first

    # A job that recovers by restarts (NCCL, --recovery restart) says so in the records: an agent
    # that comes late moves everyone to the next round at once, as under c10d, not after its
    # last call.
    direct.publish_job(JobRecord(round=2, launch="", generation=0, nodes=[], world_size=2,
                                 in_process=False, run_id="job", finished=False))
    late = agents_(last_call_timeout=30)
    with ThreadPoolExecutor(1) as pool:
        arrived = pool.submit(late.next_rendezvous)
        wait_for_a_waiting_node(a, within_s=3)
        infos = rendezvous([a, b])
        assert sorted(ranks([*infos, arrived.result(timeout=5)])) == [(0, 3), (1, 3), (2, 3)]


def test_beyond_the_maximum_a_node_waits_and_enters_when_one_leaves_or_leaves_when_closed(
        make, caplog):
    """With no job running in process (a program that publishes no job record), an agent that
    finds the round closed at ``--nnodes``' maximum waits ``last_call_timeout`` for a record,
    then says in one line why it waits; when a member's agent shuts down, it moves the
    rendezvous on and the survivor restarts into a round with it (as torch's redundancy list
    does). Once the rendezvous is closed (``set_closed``), a waiting agent leaves with exit 0 and
    a new one is refused."""
    caplog.set_level(logging.WARNING, logger=agents.__name__)
    agents_ = make("1:2", last_call_timeout=0.3)
    a, b = agents_(), agents_()
    assert ranks(rendezvous([a, b])) == [(0, 2), (1, 2)]
    c = agents_()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(c.next_rendezvous)
        time.sleep(0.6)
        assert not waiting.done()
        assert [r.getMessage() for r in caplog.records] == [
            "the job runs at its --nnodes maximum of 2 nodes: this node enters when one leaves"]
        b.shutdown()  # b's node left
        wait_for_a_waiting_node(a, within_s=5)
        a_info = a.next_rendezvous()
        c_info = waiting.result(timeout=5)
    assert (c.round, a.round) == (1, 1)
    assert ranks([c_info, a_info]) == [(1, 2), (0, 2)]  # by name: here a's serial, not arrival

    d = agents_()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(d.next_rendezvous)
        time.sleep(0.4)
        a.set_closed()
        assert c.is_closed()
        with pytest.raises(GracefulExit):
            waiting.result(timeout=3)
    with pytest.raises(RendezvousClosedError, match=r"^the rendezvous job is closed \(agent"):
        agents_().next_rendezvous()


def beat(direct: Roster, stop: threading.Event) -> None:
    while not stop.wait(0.1):
        direct.beat()


def test_a_node_that_comes_as_the_job_starts_waits_for_it_past_its_last_call(store, make):
    """An agent that comes after the round closed but before its job is published (its workers
    still import torch) waits for the job past its last call, nobody restarting meanwhile (it
    then joins it, below); once one of the round's agents is gone, it moves the rendezvous on
    after its last call, and the one left restarts into the next round with it."""
    agents_ = make("2:3", last_call_timeout=0.2)  # the next round waits for both
    a, b = agents_(), agents_()
    assert ranks(rendezvous([a, b])) == [(0, 2), (1, 2)]
    c = agents_()
    with ThreadPoolExecutor(1) as pool:
        arriving = pool.submit(c.next_rendezvous)
        time.sleep(1.0)  # five last calls
        assert not arriving.done()
        assert a.num_nodes_waiting() == b.num_nodes_waiting() == 0
        b.shutdown()
        wait_for_a_waiting_node(a, within_s=3)
        a_info = a.next_rendezvous()
        c_info = arriving.result(timeout=3)
    assert sorted(ranks([a_info, c_info])) == [(0, 2), (1, 2)] and c.round == a.round == 1


def live_job(store, agents_: Agents) -> tuple:
    """Two agents that formed round 0, and the job of their workers, published in process with
    its beat going (until the returned event is set): ``(a, b, records, job, stop)``."""
    a, b = agents_(), agents_()
    assert ranks(rendezvous([a, b])) == [(0, 2), (1, 2)]
    direct = Roster(store, "job")
    job = JobRecord(round=0, launch="x", generation=0, nodes=[a.serial, b.serial], world_size=2,
                    in_process=True, run_id="job", finished=False)
    direct.publish_job(job)
    stop = threading.Event()
    threading.Thread(target=beat, args=(direct, stop), daemon=True).start()
    return a, b, direct, job, stop


def test_a_node_joins_the_live_job_waits_at_the_maximum_and_leaves_when_it_finished(
        store, make, caplog):
    """While rank 0 publishes a live job in process, an agent that arrives joins it at once, with
    the rank its workers will have once admitted; nobody restarts (``num_nodes_waiting()`` 0).
    At ``--nnodes``' maximum the next one waits, saying why in one line, and enters when a node
    leaves; one still waiting when the job finishes leaves with exit 0; an agent that comes after
    the end fails, as torch's c10d does for a closed rendezvous."""
    agents_ = make("1:3", last_call_timeout=0.2)
    a, b, direct, job, stop = live_job(store, agents_)
    try:
        c = agents_()
        start = time.monotonic()
        info = c.next_rendezvous()
        assert time.monotonic() - start < 1.0
        assert (info.rank, info.world_size, c.round, c.join) == (2, 3, 0, 0)
        assert c.environment["ELASTIC_MNIST_JOIN"] == "0"
        assert os.environ["ELASTIC_MNIST_JOIN"] == "0"
        assert direct.joins(0) == [(0, c.serial)]
        assert a.num_nodes_waiting() == b.num_nodes_waiting() == 0

        caplog.set_level(logging.WARNING, logger=agents.__name__)
        d = agents_()
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(d.next_rendezvous)
            time.sleep(0.6)
            assert not waiting.done()
            said = [r.getMessage() for r in caplog.records if "maximum" in r.getMessage()]
            assert said == [("the job runs at its --nnodes maximum of 3 nodes: this node enters "
                             "when one leaves")]
            # b's node left (a shrink), c's workers were admitted (a grow): room for d
            direct.publish_job(JobRecord(**{**job.__dict__, "generation": 2,
                                            "nodes": [a.serial, c.serial], "world_size": 2}))
            info = waiting.result(timeout=3)
        assert (info.rank, info.world_size, d.join) == (2, 3, 1)

        e = agents_()
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(e.next_rendezvous)
            time.sleep(0.4)
            assert not waiting.done()
            direct.publish_job(JobRecord(**{**job.__dict__, "nodes": [a.serial, c.serial],
                                            "finished": True}))
            with pytest.raises(GracefulExit) as left:
                waiting.result(timeout=3)
        assert left.value.code == 0
        with pytest.raises(RendezvousClosedError, match="a new job needs a --rdzv_id"):
            agents_().next_rendezvous()
    finally:
        stop.set()


def test_at_the_end_the_exit_barrier_waits_for_a_live_node_that_asked_to_join(store, make):
    """A node that asked to join (its ticket answered, its workers starting) when the job
    finishes still needs the store: its workers learn there that the job ended without them,
    and its agent then meets the others at the exit barrier. So the job's agents, the one
    serving the store among them, wait at the barrier for that node's agent while it lives,
    and leave it once it arrived, or shut down, or died."""
    agents_ = make("1:3", last_call_timeout=0.2, keep_alive_interval=0.1)
    a, b, direct, job, stop = live_job(store, agents_)
    try:
        c = agents_()
        assert c.next_rendezvous().rank == 2 and c.join == 0
    finally:
        stop.set()
    direct.publish_job(JobRecord(**{**job.__dict__, "finished": True}))  # c never admitted

    with ThreadPoolExecutor(2) as pool:
        left = [pool.submit(barrier, h.exit_store, world_size=2, key_prefix="t",
                            barrier_timeout=5) for h in (a, b)]
        time.sleep(0.8)  # c's workers start, read that the job finished, exit 0
        assert not any(f.done() for f in left), "the store's users left before c's agent"
        c_arrived = time.monotonic()
        barrier(c.exit_store, world_size=3, key_prefix="t", barrier_timeout=5)
        for f in left:
            f.result(timeout=5)
        assert time.monotonic() - c_arrived < 0.5


def test_a_node_admitted_counts_until_the_job_record_moves_on_then_not_if_dropped(store, make):
    """A node admitted in process counts as the job's while the job's record is still of the
    generation before its own (its admission ahead of the record naming it: a late node at
    --nnodes' maximum waits); once the record is of its generation or later and does not name it
    (dropped: its worker frozen, its agent alive, waiting for it forever), it is out of the job
    like any dropped node: a late node takes its place, and the exit barrier does not wait for
    it, though it waits for a live node that asked to join and was not admitted."""
    agents_ = make("1:3", last_call_timeout=0.2, keep_alive_interval=0.1)
    a, b, direct, job, stop = live_job(store, agents_)
    try:
        c = agents_()
        assert c.next_rendezvous().rank == 2 and c.join == 0
        direct.mark_admitted(0, c.join, launch="x", generation=1)  # the record is still at 0
        assert direct.pending_joins(0, job.nodes, set(), job) == [(0, c.serial)]
        d = agents_()
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(d.next_rendezvous)
            time.sleep(0.6)
            assert not answer.done(), "d entered beyond --nnodes' maximum"
            job = JobRecord(**{**job.__dict__, "generation": 2})  # c dropped in generation 2
            direct.publish_job(job)
            assert (answer.result(timeout=5).rank, d.join) == (2, 1)
    finally:
        stop.set()
    direct.publish_job(JobRecord(**{**job.__dict__, "finished": True}))

    with ThreadPoolExecutor(3) as pool:
        left = [pool.submit(barrier, h.exit_store, world_size=2, key_prefix="t",
                            barrier_timeout=5) for h in (a, b)]
        time.sleep(0.5)
        assert not any(f.done() for f in left), "d asked to join, not admitted: waited for"
        left.append(pool.submit(barrier, d.exit_store, world_size=2, key_prefix="t",
                                barrier_timeout=5))
        for f in left:
            f.result(timeout=3)  # c lives (its keep-alive goes on) and is not waited for


def test_rank_0_marks_the_joins_it_admits_for_the_agents(store):
    """What the agents read (:meth:`Roster.admitted`) is written by rank 0's admission of a
    grow's joins, with the launch and the generation that admits them."""
    from types import SimpleNamespace

    from elastic_mnist.resilience.admissions import Admissions

    member = SimpleNamespace(env=SimpleNamespace(rank=0), store=store, launch="x",
                             joining=True)
    admissions = Admissions(member, Roster(store, "job"), "job", 0)
    try:
        admissions.admit({"generation": 3, "joins": [{"join": 0, "agent": 5},
                                                      {"join": 2, "agent": 6}]},
                         SimpleNamespace(generation=4, step=7, evaluated_step=0))
    finally:
        admissions.close()
    roster = Roster(store, "job")
    assert [roster.admitted(0, j) for j in range(3)] == [
        {"launch": "x", "generation": 4}, None, {"launch": "x", "generation": 4}]


def test_the_exit_barrier_waits_for_live_agents_only_and_returns_at_once(store, make):
    """torch's own barrier function (what the agent's ``_exit_barrier`` calls) on our exit
    stores: it returns within a tenth of a second of the last live agent's arrival, waits for
    no agent that is dead (its keep-alive stood still) or gone (shut down), is bounded by the
    barrier's timeout, and the exit store refuses, by name, whatever else it is asked."""
    agents_ = make("4", keep_alive_interval=0.1)
    a, b, dead, gone = (agents_() for _ in range(4))
    infos = rendezvous([a, b, dead, gone])
    assert ranks(infos) == [(i, 4) for i in range(4)]
    dead.keep_alive.stop()
    gone.shutdown()

    returned = {}

    def arrive(name: str, info) -> None:
        barrier(info.store, world_size=4, key_prefix="torchelastic/agent/terminal_state",
                barrier_timeout=10)
        returned[name] = time.monotonic()

    first = threading.Thread(target=arrive, args=("a", infos[0]))
    first.start()
    for _ in range(6):  # b's workers run on; its agent asks as torch's does
        b.num_nodes_waiting()
        time.sleep(0.1)
    assert "a" not in returned  # b is alive and has not arrived
    b_arrived = time.monotonic()
    arrive("b", infos[1])
    first.join(timeout=5)
    assert returned["a"] - b_arrived < 0.1 + 0.05 and returned["b"] - b_arrived < 0.1 + 0.05

    # The job's record names the agents to wait for: one alive that never arrives bounds the
    # barrier by its timeout.
    late, idle = agents_(), agents_()
    late.round = 0
    Roster(store, "job").publish_job(JobRecord(
        round=0, launch="x", generation=1, nodes=[late.serial, idle.serial], world_size=2,
        in_process=True, run_id="job", finished=False))
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError, match=rf"timed out after 0.5s: agent\(s\) "
                                                  rf"{idle.serial} of the job are alive"):
        barrier(late.exit_store, world_size=2, key_prefix="x", barrier_timeout=0.5)
    assert time.monotonic() - start < 1.0

    with pytest.raises(RuntimeError, match=r"asked the exit store for get\(\)"):
        infos[0].store.get("torchelastic/agent/terminal_state/last_member")


def test_the_backend_is_registered_as_torchrun_finds_it():
    """pyproject.toml registers the entry point that torchrun loads (``torchrun.handlers``),
    and what it names makes handlers; where the package is installed, its metadata says so too."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]
    assert declared["torchrun.handlers"] == {"elastic-mnist": "elastic_mnist.resilience.plugin:backend"}
    assert plugin.backend() is plugin.create_handler
    installed = [ep for ep in metadata.entry_points(group="torchrun.handlers")
                 if ep.name == "elastic-mnist"]
    if installed:
        assert installed[0].value == "elastic_mnist.resilience.plugin:backend"


def test_importing_the_backend_first_registers_it_without_a_warning():
    """torch loads the entry point as its rendezvous package is first imported: a process that
    imports agents.py first starts that import from agents.py's own imports. The entry point's
    module imports nothing, so torch never finds a module half made (it warned, with a
    traceback, and registered no backend), and the backend is registered."""
    installed_backend()
    # Registering another creator under a registered name is refused (torch's public
    # register): the refusal says that ours is registered.
    script = ("import elastic_mnist.resilience.agents\n"
              "from torch.distributed.elastic.rendezvous import registry\n"
              "try:\n    registry.handler_registry.register('elastic-mnist', print)\n"
              "except ValueError as e:\n    print(e)\n")
    result = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True,
                            text=True, env=clean_env(), timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Exception while registering" not in result.stderr, result.stderr
    assert "is already registered with '<function create_handler" in result.stdout, result.stdout


def installed_backend() -> None:
    """Fails, saying how to mend it, when torchrun in this environment cannot find the backend."""
    if not any(ep.name == "elastic-mnist"
               for ep in metadata.entry_points(group="torchrun.handlers")):
        pytest.fail("the elastic-mnist rendezvous backend is not installed in this environment "
                    "(torchrun.handlers entry point): run `make install` (pip install -e .) "
                    "again after pyproject.toml changed")


@pytest.mark.slow
def test_torchrun_agents_meet_on_our_backend_and_exit_together(tmp_path):
    """Three real torchrun agents, ``--rdzv_backend=elastic-mnist --nnodes=2``, one worker each
    (tests/programs/rendezvous_env.py), the first serving the store. Two form the round: their
    workers get torchrun's variables, consistent with it, and ours. The third waits, with one
    line, and exits 0 once their job is over (torch's own RendezvousGracefulExitError would
    make torchrun exit 1). The two pass the exit barrier within 2 s of their workers' end and
    exit 0; torch's agent asks the exit store nothing it does not know."""
    installed_backend()
    port, go = free_port(), tmp_path / "go"
    env = clean_env(LOGLEVEL="INFO", GO_FILE=str(go))
    names = ("a", "b", "c")

    def agent(name: str) -> subprocess.Popen:
        conf = f"is_host={str(name == 'a').lower()},keep_alive_interval=0.5,last_call_timeout=0.5"
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
             "--rdzv_backend=elastic-mnist", f"--rdzv_endpoint=127.0.0.1:{port}",
             "--rdzv_id=meet", "--monitor_interval=0.1", "--max_restarts=0",
             f"--rdzv_conf={conf}", str(REPO / "tests" / "programs" / "rendezvous_env.py")],
            env=env, stdout=open(tmp_path / f"{name}.log", "w"),
            stderr=subprocess.STDOUT)

    procs = {name: agent(name) for name in names}

    def log(name: str) -> str:
        return (tmp_path / f"{name}.log").read_text()

    try:
        deadline = time.monotonic() + 120
        while sum("maximum" in log(n) or '"rendezvous_env"' in log(n) for n in names) < 3:
            assert time.monotonic() < deadline, [log(n) for n in names]
            time.sleep(0.05)
        go.touch()  # the workers end
        codes, ended = {}, {}
        while len(codes) < 3:
            for name, proc in procs.items():
                if name not in codes and proc.poll() is not None:
                    codes[name], ended[name] = proc.returncode, time.time()
            assert time.monotonic() < deadline, [log(n) for n in names]
            time.sleep(0.02)
    finally:
        for proc in procs.values():
            kill_tree(proc.pid)
    out = {name: log(name) for name in names}
    assert codes == {"a": 0, "b": 0, "c": 0}, out
    ran = [n for n in names if '"rendezvous_env"' in out[n]]
    waited = [n for n in names if n not in ran]
    assert len(ran) == 2 and len(waited) == 1, out

    seen = [json.loads(line[line.index("{"):]) for name in ran for line in out[name].splitlines()
            if '"rendezvous_env"' in line]
    by_rank = {s["RANK"]: s for s in seen}
    assert sorted(by_rank) == ["0", "1"], out
    assert len({s["ELASTIC_MNIST_AGENT"] for s in seen}) == 2
    for rank, s in by_rank.items():
        assert (s["WORLD_SIZE"], s["GROUP_RANK"], s["GROUP_WORLD_SIZE"], s["LOCAL_RANK"]) == \
            ("2", rank, "2", "0")
        assert (s["ELASTIC_MNIST_RDZV"], s["ELASTIC_MNIST_RDZV_ID"], s["ELASTIC_MNIST_ROUND"],
                s["ELASTIC_MNIST_KEEP_ALIVE"], s["ELASTIC_MNIST_JOIN"]) == \
            (f"127.0.0.1:{port}", "meet", "0", "0.5,3", None)
        assert (s["MASTER_ADDR"], s["MASTER_PORT"], s["TORCHELASTIC_USE_AGENT_STORE"],
                s["TORCH_ELASTIC_WORKER_IDENTICAL"]) == ("127.0.0.1", str(port), "True", "1")
    said = out[waited[0]]
    assert said.count("the job runs at its --nnodes maximum of 2 nodes: this node enters when "
                      "one leaves") == 1, said
    assert "the job of round 0 has finished: agent" in said, said

    # From the workers' end: torch's agent sees them done (--monitor_interval), passes our exit
    # barrier, and exits; the last of it, the interpreter's teardown of torch, takes a second or
    # more on a busy machine (as it does under torch's own c10d backend).
    last_worker = max(json.loads(line[line.index("{"):])["worker_ended"]
                      for name in ran for line in out[name].splitlines() if "worker_ended" in line)
    passed = [logged_at(out[n], "Done waiting for other agents", last_worker) - last_worker
              for n in ran]
    exited = [ended[n] - last_worker for n in names]
    print(f"after the workers' end: exit barrier passed at {passed[0]:.2f} s and "
          f"{passed[1]:.2f} s, torchrun exited at {', '.join(f'{t:.2f}' for t in exited)} s")
    assert max(passed) < 2.0, (passed, out)
    assert max(exited) < 2.0 + 8.0, (exited, out)
    assert not any("asked the exit store for" in text for text in out.values()), out


def logged_at(text: str, what: str, near: float) -> float:
    """When torch's agent logged its line that says ``what`` (its ``LOGLEVEL`` lines carry the
    time of day only: the day is ``near``'s)."""
    lines = [line for line in text.splitlines() if what in line]
    assert lines, f"torch's agent did not log {what!r}:\n{text}"
    line = lines[0]
    clock = datetime.time.fromisoformat(line.split()[1])
    day = datetime.datetime.fromtimestamp(near).date()
    return datetime.datetime.combine(day, clock).timestamp()


def test_the_agent_serving_the_store_listens_where_operations_md_says():
    """The agent on the endpoint's host serves the store on the address the host resolves to
    (``localhost``: this machine alone), the ``our-rendezvous`` row of docs/operations.md."""
    port = free_port()
    params = RendezvousParameters("elastic-mnist", f"localhost:{port}", "job", 1, 1,
                                  is_host="true", keep_alive_interval="0.1")
    handler = AgentsHandler(Settings.from_params(params), nproc=1)
    try:
        found = [c.laddr.ip for c in psutil.Process().net_connections(kind="tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    finally:
        handler.shutdown()
    assert readme_table()["our-rendezvous"]["address"] == "--host"
    assert found == [resolved("localhost")]


def test_a_job_record_written_by_a_newer_version_is_read_without_its_new_fields(store):
    """Nodes of one job may run different versions of the package for a while (a rolling
    upgrade): a field this version does not know is left out, not a crash of its agent."""
    roster = Roster(store, "mixed")
    record = JobRecord(round=0, launch="x", generation=1, nodes=[1], world_size=2,
                       in_process=True, run_id="mixed", finished=False)
    store.set(roster.key("job"), json.dumps({**dataclasses.asdict(record), "newer": 1}))
    assert roster.job() == record


def test_a_job_that_recovers_by_restarts_keeps_the_whole_round_at_the_exit_barrier(store, make):
    """A job record that admits nobody (NCCL, --recovery restart) names no nodes: the exit
    barrier then waits for the round's agents, not for this one alone."""
    agents_ = make("1:2", last_call_timeout=0.2)
    a, b = agents_(), agents_()
    assert ranks(rendezvous([a, b])) == [(0, 2), (1, 2)]
    Roster(store, "job").publish_job(JobRecord(round=0, launch="", generation=0, nodes=[],
                                               world_size=2, in_process=False, run_id="job",
                                               finished=False))
    with pytest.raises(dist.DistStoreError, match=f"agent.s. {b.serial} of the job"):
        a.barrier.wait(0.5)


def test_the_agent_serving_the_store_lingers_for_agents_that_wait_to_enter_only():
    """At its end the agent serving the store waits for an agent that waits to enter the job
    (at --nnodes' maximum) to see that the job ended and leave, so that it never loses the store
    first; not for one killed as it waited, once judged dead, nor beyond."""
    port = free_port()

    def handler(is_host: bool) -> AgentsHandler:
        params = RendezvousParameters("elastic-mnist", f"127.0.0.1:{port}", "job", 1, 2,
                                      is_host=str(is_host).lower(), keep_alive_interval="0.1",
                                      last_call_timeout="0.2")
        return AgentsHandler(Settings.from_params(params), nproc=1)

    host, other = handler(True), handler(False)
    silent = handler(False)
    late = None
    try:
        assert ranks(rendezvous([host, other])) == [(0, 2), (1, 2)]
        silent.roster.set_waiting(silent.serial, True)
        silent.keep_alive.stop()  # SIGKILLed as it waited to enter
        deadline = time.monotonic() + 2  # the host's agent looks on, as torch's agent asks it
        while silent.serial not in host.liveness.dead([silent.serial]):
            host.num_nodes_waiting()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        late = handler(False)
        with ThreadPoolExecutor(3) as pool:
            waiting = pool.submit(late.next_rendezvous)
            time.sleep(0.6)  # at the maximum: it waits
            assert not waiting.done()
            assert host.roster.waiting_agents() == [silent.serial, late.serial]
            barriers = [pool.submit(h.barrier.wait, 5.0) for h in (host, other)]
            for barrier in barriers:
                barrier.result(timeout=5)
            start = time.monotonic()
            host.shutdown()
            took = time.monotonic() - start
            assert waiting.done(), "the host left while an agent still read its store"
            assert isinstance(waiting.exception(), GracefulExit)
        assert took < exit_barrier.LINGER_S * 0.8, took  # not held up by the silent one
    finally:
        for h in (other, silent, late):
            if h is not None:
                h.shutdown()


def test_a_rank_0_of_an_older_round_stops_speaking_for_the_job(store):
    """Once our rendezvous moved on to a later round (the job's agents restart it), its rank 0
    neither beats nor publishes: its beat or record would pass for the next round's job."""
    from types import SimpleNamespace

    from elastic_mnist.env import Rendezvous
    from elastic_mnist.resilience.admissions import Admissions

    admissions = Admissions.__new__(Admissions)  # its rank 0's reading, without its thread
    admissions.member = SimpleNamespace(env=SimpleNamespace(
        rendezvous=Rendezvous("127.0.0.1", store.port, "job", backend="elastic-mnist")))
    admissions.records, admissions.round = Roster(store, "job"), 0
    store.set(admissions.records.key("round"), "0")  # as the first agent's registration sets it
    assert not admissions._moved_on()
    admissions.records.bump_round(0)
    assert admissions._moved_on()
    admissions.member.env.rendezvous = Rendezvous("127.0.0.1", store.port, "job")  # c10d's
    assert not admissions._moved_on()
