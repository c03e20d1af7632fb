"""Every kind of connection the job makes to the coordination store, cut silently, and the bound
of each wait on it (issue 42, item 5; docs/recovery.md, "Every wait, and its bound").

A link cut silently (no FIN, no RST) leaves a connection open and its calls unanswered. Here the
cut is a relay between the store and its clients that stops relaying (:class:`SilentRelay`): it
holds every byte, both ways, and closes nothing, so that a client's call waits for an answer that
never comes, as across a cut link. A real cut between hosts of their own is ``make
partitions``' (control-30, store-30). In seconds: each bound is set small.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import threading
import time

import pytest
import torch
from torch.distributed import PrefixStore, TCPStore
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters

from elastic_mnist.env import DistEnv
from elastic_mnist.errors import EXIT_GAVE_UP
from elastic_mnist.resilience import (
    agent_monitor,
    agent_store,
    keep_alive,
    recovery,
    store_wait,
    watchdog,
)
from elastic_mnist.resilience.agent_settings import Settings
from elastic_mnist.resilience.agents import AgentsHandler
from elastic_mnist.resilience.board import NodeBoard
from elastic_mnist.resilience.fence import Fence
from elastic_mnist.resilience.membership import Membership
from elastic_mnist.resilience.roster import Roster
from elastic_mnist.resilience.speaker import Speaker


class SilentRelay:
    """A TCP relay in front of a store's port: it relays until :meth:`cut`, then holds every
    byte both ways and closes nothing, until :meth:`heal`. :meth:`hold_existing` holds the
    connections made so far only, for good: as after a heal, where a connection that waited
    through the cut waits on as long as TCP's retransmissions were backed off, and a fresh one
    answers at once."""

    def __init__(self, port: int):
        self.target = port
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.open = threading.Event()
        self.open.set()
        self.sockets: list[socket.socket] = []
        self.flows: list[threading.Event] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self.sockets += [client, upstream]
            flowing = threading.Event()
            flowing.set()
            self.flows.append(flowing)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b, flowing), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket,
              flowing: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                self.open.wait()  # cut: held here, unanswered, nothing closed
                flowing.wait()
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def cut(self) -> None:
        self.open.clear()

    def heal(self) -> None:
        self.open.set()

    def hold_existing(self) -> None:
        for flowing in self.flows:
            flowing.clear()

    def close(self) -> None:
        self.heal()
        for flowing in self.flows:
            flowing.set()
        self.server.close()
        for s in self.sockets:
            with contextlib.suppress(OSError):
                s.close()


@pytest.fixture
def relay():
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=30))
    relay = SilentRelay(server.port)
    yield relay
    relay.close()


def client(relay: SilentRelay, timeout_s: float = 30.0) -> TCPStore:
    return TCPStore("127.0.0.1", relay.port, is_master=False,
                    timeout=datetime.timedelta(seconds=timeout_s))


def waited(call, bound_s: float) -> tuple[float, object]:
    """How long ``call()`` took (in a thread), and what it returned or raised; None for the
    time where it had not returned within ``bound_s`` (it is left to its thread)."""
    out: list[object] = []

    def run():
        try:
            out.append(call())
        except Exception as e:  # noqa: BLE001 - returned, for the test to look at
            out.append(e)

    began = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(bound_s)
    return (None if thread.is_alive() else time.monotonic() - began), (out[0] if out else None)


def test_torchs_own_store_calls_wait_past_their_timeout_on_a_silent_connection(relay):
    """The fact that every bound below answers (torch 2.14.1): a ``get`` on a connection whose
    store went silent waits past the store's timeout, for as long as TCP keeps the connection
    (about 15 minutes); it completes once the store is heard again."""
    store = client(relay, timeout_s=0.3)
    store.set("k", "v")
    relay.cut()
    took, _ = waited(lambda: store.get("k"), 1.2)
    assert took is None  # still waiting, four times its timeout later
    relay.heal()
    took, value = waited(lambda: store.get("k"), 5)
    assert value == b"v"


def test_the_fence_waits_ask_s_and_a_steps_check_not_at_all(relay, tmp_path):
    """The writers' fence (fence.py): a commit's check waits ``ask_s`` for its question, then
    the folder decides; a step's check waits for no question in flight."""
    store = client(relay)
    store.set("generation", "0")
    fence = Fence(lambda: store.get("generation") and None,  # asks; the job holds it
                  fallback=lambda: None, ask_s=0.3)
    fence.check()
    relay.cut()
    took, _ = waited(fence.check, 2)
    assert took is not None and 0.3 <= took < 0.8
    took, _ = waited(lambda: fence.check(recent=True), 2)
    assert took is not None and took < 0.1


def test_the_watchdogs_calls_wait_store_timeout(relay, monkeypatch):
    """The watchdog (watchdog.py): each call waits ``STORE_TIMEOUT`` (2 s; 0.3 here), and a
    call while one is still held fails at once."""
    monkeypatch.setattr(watchdog, "STORE_TIMEOUT", datetime.timedelta(seconds=0.3))
    store = PrefixStore("g0", client(relay))
    dog = watchdog.Watchdog(DistEnv(rank=0, world_size=2, launched=True), store, floor_s=1.0,
                            report=lambda record: None)
    try:
        relay.cut()
        took, error = waited(lambda: dog._call(store.get, "x"), 2)
        assert took is not None and 0.3 <= took < 0.8 and isinstance(error, watchdog.StoreSilent)
        took, error = waited(lambda: dog._call(store.get, "x"), 2)
        assert took is not None and took < 0.1 and isinstance(error, watchdog.StoreSilent)
    finally:
        relay.heal()
        dog.close(wait=False)


def test_the_nodes_record_never_holds_the_pulse(relay):
    """The node's pulse record (speaker.py): the pulse hands it over and goes on, whatever the
    store; the record arrives once the store is heard again."""
    store, reader = client(relay), client(relay)
    speaker = Speaker(store, "node/a", fresh=lambda: client(relay))
    try:
        relay.cut()
        for n in range(5):
            took, _ = waited(lambda n=n: speaker.say(f"{n}"), 1)
            assert took is not None and took < 0.05
        relay.heal()
        deadline = time.monotonic() + 10
        while not (reader.check(["node/a"]) and reader.get("node/a") == b"4"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        speaker.close()


def test_opening_a_connection_to_a_silent_store_waits_past_its_timeout(relay):
    """Why every fresh connection below is opened in a thread and waited for a bound
    (in_flight.py's ``within``): a store that accepts and then says nothing (a frozen store, a
    cut past the accept) holds the opening of a TCPStore client past its timeout (torch
    2.14.1)."""
    relay.cut()
    took, _ = waited(lambda: client(relay, timeout_s=0.3), 1.2)
    assert took is None


def test_an_agents_monitor_and_keep_alive_go_on_on_fresh_connections(relay, monkeypatch,
                                                                      caplog):
    """Our rendezvous handler (agents.py) on a connection held for good: torch's agent's
    ``num_nodes_waiting``, asked from the thread that watches its workers, answers within
    ``ANSWER_S`` (agent_monitor.py; 0.3 s here), and goes on on a fresh connection once the
    question was held ``RENEW_S`` (0.3 s here); the
    keep-alive, on its own, raises its counter again within ``HELD_S`` (0.5 s here) and a
    keep-alive interval; the agent's shutdown returns."""
    monkeypatch.setattr(agent_monitor, "ANSWER_S", 0.3)
    monkeypatch.setattr(agent_monitor, "RENEW_S", 0.3)
    monkeypatch.setattr(keep_alive, "HELD_S", 0.5)
    params = RendezvousParameters("elastic-mnist", f"127.0.0.1:{relay.port}", "job", 1, 1,
                                  is_host="false", keep_alive_interval="0.1",
                                  last_call_timeout="0")
    handler = AgentsHandler(Settings.from_params(params), nproc=1)
    try:
        handler.next_rendezvous()
        assert handler.num_nodes_waiting() == 0
        while Roster(handler.store, "job").keep_alives([handler.serial]) < [2]:
            time.sleep(0.05)  # the keep-alive's own connection is open, and raises
        relay.hold_existing()
        direct = client(relay)
        before = Roster(direct, "job").keep_alives([handler.serial])
        took, waiting = waited(handler.num_nodes_waiting, 5)
        assert took is not None and 0.3 <= took < 0.3 + agent_store.CONNECT_S and waiting == 0
        took, _ = waited(handler.num_nodes_waiting, 5)
        assert took is not None and took < 0.3  # answered on the fresh connection
        assert not handler.monitor.silent
        deadline = time.monotonic() + 0.5 + keep_alive.CONNECT_S + 0.1 + 1
        while Roster(direct, "job").keep_alives([handler.serial]) == before:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert any("did not answer within 0.3 s" in m for m in said), said
        assert any("reaches the rendezvous store again" in m for m in said), said
    finally:
        took, _ = waited(handler.shutdown, 5)
        assert took is not None


def test_a_rendezvous_call_waits_join_timeout_at_most_then_the_agent_leaves(relay):
    """Every call of our rendezvous on the agent's connection (agent_store.Connection: its
    rounds, its exit barrier, its shutdown) waits ``join_timeout`` at most (0.3 s here), then
    says so in one line: a silent store held it about 15 minutes."""
    connection = agent_store.Connection(client(relay), lambda: client(relay), bound_s=0.3)
    connection.set("k", "v")
    assert connection.get("k") == b"v" and connection.port == relay.port
    relay.hold_existing()
    took, error = waited(lambda: connection.get("k"), 2)
    assert took is not None and 0.3 <= took < 0.8
    assert isinstance(error, RendezvousConnectionError)
    assert str(error) == ("the rendezvous store did not answer get() within 0.3 s (join_timeout "
                          "of --rdzv_conf): this agent leaves")
    took, value = waited(lambda: connection.get("k"), 3)  # the next: on a fresh connection
    assert took is not None and took < 0.3 and value == b"v"


def test_a_faults_declaration_waits_the_changes_bound(relay, tmp_path, monkeypatch, caplog):
    """A fault declared while the store is silent (membership.py, recovery.py): the declaration
    waits, and the change's bound, which runs from it and waits on for the store
    (store_wait.py: 1 s here, said), ends the process in one line (EXIT_GAVE_UP) where nothing
    says the job went on without it."""
    left: list[int] = []
    monkeypatch.setattr(recovery, "end_process", left.append)
    monkeypatch.setattr(recovery, "DROPPED_QUESTION_S", 0.2)
    for name, value in (("STORE_WAIT_S", 1.0), ("EXTEND_S", 0.2), ("PROBE_S", 0.1)):
        monkeypatch.setattr(store_wait, name, value)
    env = DistEnv(rank=0, world_size=2, launched=True)
    member = Membership(env, torch.device("cpu"), PrefixStore("launch", client(relay)),
                        generation=0, pg_timeout_s=10, bound_s=0.5,
                        board=NodeBoard(tmp_path / "board", "board", 1, 0))
    try:
        relay.cut()
        took, _ = waited(lambda: member.declare("hung", [1]), 0.2)
        assert took is None  # held by the store
        assert member._declaring.acquire(timeout=0.1)  # and no lock with it: a move to the
        member._declaring.release()  # next generation is not held by the store
        began = time.monotonic()
        while not left:
            assert time.monotonic() < began + 3
            time.sleep(0.02)
        assert left == [EXIT_GAVE_UP] and time.monotonic() - began >= 0.8  # past the bound
        said = [r.getMessage() for r in caplog.records if r.levelname in ("WARNING", "ERROR")]
        assert said[0].startswith("the coordination store does not answer: the recovery waits "
                                  "for it, up to 1 s from the fault"), said
        assert said[-1].startswith("recovery in process failed while detecting the fault: no "
                                   "step completed within 1 s (the coordination store was "
                                   "away) of the fault"), said
    finally:
        relay.heal()
        member.close()


def test_every_connection_is_listed_with_its_bound():
    """The table in docs/recovery.md names each kind of connection this module cuts."""
    from pathlib import Path

    text = (Path(__file__).parent.parent / "docs" / "recovery.md").read_text()
    section = text.split("## Every wait, and its bound", 1)[1].split("\n## ", 1)[0]
    for kind in ("the writers' fence", "the watchdog", "the node's pulse record",
                 "a fault's declaration", "the recovery", "the agent's monitor",
                 "the agent's keep-alive"):
        assert kind in section, kind
