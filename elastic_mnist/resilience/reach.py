"""Who is cut off from whom on the data network: a one-sided partition named.

A node that reaches the coordination store but not its peers (its data link cut, or one way of
it) keeps its pulses and heartbeats going: nothing says which side is cut off, and at the hang
verdict every rank is "alive and waiting in a collective". Named by nobody, the job restarted
(41 s in ``make partitions``).

Each node's first worker listens on the address its collectives use (``GLOO_SOCKET_IFNAME``'s
interface, else its host name's, as gloo picks it; ``NCCL_SOCKET_IFNAME`` under NCCL), and says
where in the generation's store. Once its step has waited as long as a silent peer takes to be
named (``silence.stall_after``: 1 s, or two of the slowest recent steps), it tries to connect to
every other node's listener, from that address, every beat, and says in the store which nodes it
could not reach within ``CONNECT_S`` (``FOUND``). The probers, which look at the pulses ten times
a second while they wait, look there too (:class:`Cuts`): as soon as every node has said what it
found in this wait, the nodes to drop are the fewest whose loss leaves every pair of the rest in
reach of each other (:func:`cut_off`), and the others go on without them in process, a few
seconds after the cut instead of at the hang verdict. The heartbeats carry the same findings, for
that verdict. One node per node tries, one connection per other node: at 1,000 nodes, a thousand
connections a node, once a beat, only while the job is stuck.

A cut can also strike first inside a node (one way of its link dropped: its own collective fails
at once, naming no peer), and then every rank checks in, the cut one too, since it reaches the
store: the new group, built across the cut, could never be complete (59 s, and a restart). So as
a change begins, each node's first worker tries the others once more (:func:`survey`; its
listener outlives the generations), and where the new group is still not built when the tries
are done, the change's watchers drop the nodes cut off (:class:`Survey`), in a round of the
same change.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import json
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from elastic_mnist.addresses import (
    IFNAME,
    bindable_addresses,
    gloo_address,
    ifname_is_set,
    interface_address,
)
from elastic_mnist.resilience.heartbeat import Heartbeat

log = logging.getLogger(__name__)

CONNECT_S = 2.5
"""How long a connection to a peer's listener may take: a reachable node's takes milliseconds
on any cluster network, and TCP retries a lost SYN after a second (and again after three): one
lost SYN is no cut."""


def data_address(backend: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """The address this host's collectives use, as the backend picks it (addresses.py): the
    first interface that ``GLOO_SOCKET_IFNAME`` names (``NCCL_SOCKET_IFNAME`` under NCCL, where
    a name that excludes, ``^...``, picks none), else the host name's first address that binds
    here. None where the interfaces named have no address."""
    return _address(environ.get("NCCL_SOCKET_IFNAME" if backend == "nccl" else IFNAME))


@functools.lru_cache(maxsize=8)
def _address(names: str | None) -> str | None:
    """:func:`data_address` for the interfaces ``names``: looked up once per process (the host
    name's resolution, a DNS query perhaps, is not made again at every change of generation)."""
    if ifname_is_set(names) and not names.startswith("^"):
        for name in filter(None, names.split(",")):
            found = interface_address(name.lstrip("="))
            if found is not None:
                return found
        return None
    return gloo_address(bindable_addresses(socket.gethostname()))


class Listener:
    """This node's listener on its data address: it accepts a connection and closes it."""

    def __init__(self, address: str):
        self._socket = socket.create_server((address, 0), backlog=1024)
        host, port = self._socket.getsockname()[:2]
        self.address = f"{host}:{port}"
        self.host = address
        self._thread = threading.Thread(target=self._serve, daemon=True, name="reach-listener")
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self._socket.accept()
            except OSError:  # closed
                return
            connection.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)
        self._socket.close()


def unreachable(source: str, targets: Mapping[int, str], timeout_s: float = CONNECT_S
                ) -> set[int]:
    """The ``targets`` (node → ``"host:port"``) that a connection from ``source`` does not
    reach within ``timeout_s``: all at once, each with its own socket (a refused or reset
    connection is as unreachable as a silent one)."""
    pending: dict[socket.socket, int] = {}
    failed: set[int] = set()
    with selectors.DefaultSelector() as selector:
        for node, address in targets.items():
            host, _, port = address.rpartition(":")
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
            s.setblocking(False)
            try:
                s.bind((source, 0))
                s.connect_ex((host, int(port)))
            except (OSError, ValueError):  # no such address: not reached
                s.close()
                failed.add(node)
                continue
            pending[s] = node
            selector.register(s, selectors.EVENT_WRITE)
        deadline = time.monotonic() + timeout_s
        while pending and (left := deadline - time.monotonic()) > 0:
            for key, _ in selector.select(left):
                s = key.fileobj
                node = pending.pop(s)
                selector.unregister(s)
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    failed.add(node)
                s.close()
        for key, _ in selector.select(0):  # done as the time ran out: looked at once more
            s = key.fileobj
            node = pending.pop(s)
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                failed.add(node)
            s.close()
        for s, node in pending.items():
            failed.add(node)
            s.close()
    return failed


def cut_off(unreachable_from: Mapping[int, set[int]], nodes: set[int]) -> list[int]:
    """Nodes to drop so that every pair of the rest reach each other, by what each node found
    (``unreachable_from``: node → the nodes it could not reach; a pair is cut when either side
    says so). Greedy, not the fewest in every graph: the node in the most cut pairs goes first,
    the higher node first among equals, so that node 0 (the job's rank 0) stays where it can;
    of two nodes cut from each other, the other goes, whichever side was cut. Empty when
    nothing is cut, or when no node reported."""
    cut = {frozenset((a, b)) for a, found in unreachable_from.items() for b in found
           if a != b and a in nodes and b in nodes}
    dropped: list[int] = []
    while cut:
        counts: dict[int, int] = {}
        for pair in cut:
            for node in pair:
                counts[node] = counts.get(node, 0) + 1
        worst = max(counts, key=lambda node: (counts[node], node))
        dropped.append(worst)
        cut = {pair for pair in cut if worst not in pair}
    return sorted(dropped)


NODES = "elastic_mnist/reach/nodes"
"""How many nodes said where they listen, in the generation's store; ``NODES/<n>`` says the
n-th: ``"<node> <host:port>"``."""


@functools.lru_cache(maxsize=8)
def _listener_on(address: str) -> Listener | None:
    """This process's listener on ``address``: opened once, it outlives the generations (a
    change's survey tries the nodes whose watchdogs are gone with their generation)."""
    try:
        return Listener(address)
    except OSError as e:
        log.warning("no listener on %s for the other nodes to try (%s): a node cut off from "
                    "its peers is not named", address, e)
        return None


def node_listener(local_rank: int, backend: str) -> Listener | None:
    """The listener of the node's first worker (``local_rank`` 0), where it has a data address;
    else none."""
    address = data_address(backend) if local_rank == 0 else None
    return None if address is None else _listener_on(address)


class ReachWatch:
    """A node's first worker, in one generation: its listener, and its tries to reach the other
    nodes while its step waits. Every other worker has none (:data:`NO_REACH`)."""

    def __init__(self, node: int, listener: Listener, store: Any,
                 call: Callable[..., Any]):
        """``node``: this node's first rank; ``store``: the generation's, on which ``call``
        (the watchdog's bounded call) makes each operation."""
        self.node, self.listener, self.store, self.call = node, listener, store, call
        self.found: list[int] = []
        """The nodes not reached at the last try; none while the step goes on."""
        self._targets: dict[int, str] | None = None
        self._trying: threading.Thread | None = None
        self._said: dict[str, Any] | None = None
        """What this node last said it found, in the store."""

    def announce(self) -> None:
        """Says where this node listens, for the generation."""
        n = self.call(self.store.add, NODES, 1)
        self.call(self.store.set, f"{NODES}/{n - 1}", f"{self.node} {self.listener.address}")

    def beat(self, stalled_s: float | None, after_s: float, step: int = 0) -> None:
        """Once a beat: once the step (``step``, the last one done) has waited ``after_s``, a
        try in the background (one at a time), whose finding is said in the store for the
        probers (:class:`Cuts`); before that, nothing found."""
        if stalled_s is None or stalled_s < after_s:
            self.found = []
        elif self._trying is None or not self._trying.is_alive():
            self._trying = threading.Thread(target=self._try, args=(step,), daemon=True,
                                            name="reach-try")
            self._trying.start()

    def _try(self, step: int) -> None:
        try:
            if self._targets is None:  # read once: every node said where as the group began
                self._targets = {node: where for node, where
                                 in announced(self.store, "", self.call).items()
                                 if node != self.node}
            self.found = sorted(unreachable(self.listener.host, self._targets))
            said = {"step": step, "found": self.found}
            if said != self._said:
                self.call(self.store.set, f"{FOUND}/{self.node}", json.dumps(said))
                if self.found:
                    self.call(self.store.add, CUTS, 1)
                self._said = said
        except Exception as e:  # noqa: BLE001 - StoreSilent, a store error: nothing found
            log.debug("no try to reach the other nodes: %s", e)

    def close(self) -> None:
        """Nothing to close: the listener is the process's (:func:`node_listener`)."""


class NoReach:
    """A worker that does not try: not its node's first, or no data address."""

    node = -1
    found: tuple[int, ...] = ()

    def announce(self) -> None:
        pass

    def beat(self, stalled_s: float | None, after_s: float, step: int = 0) -> None:
        pass

    def close(self) -> None:
        pass


NO_REACH = NoReach()


def cut_off_ranks(heartbeats: Mapping[int, Heartbeat]) -> tuple[list[int], str]:
    """The ranks of the nodes to go on without, by what the heartbeats say each node could not
    reach (:func:`cut_off`), and why; none where nothing is cut."""
    nodes = {beat.node for beat in heartbeats.values()}
    found = {beat.node: set(beat.unreachable) for beat in heartbeats.values() if beat.unreachable}
    dropped = cut_off(found, nodes)
    if not dropped:
        return [], ""
    ranks = sorted(r for r, beat in heartbeats.items() if beat.node in dropped)
    return ranks, f"cut off from its peers on the data network ({_said(found)})"


def _said(found: Mapping[int, set[int]]) -> str:
    """What each node found, in words."""
    return "; ".join(f"node of rank {a} could not reach the node(s) of rank(s) "
                     f"{', '.join(map(str, sorted(b)))}" for a, b in sorted(found.items()) if b)


def reach_for(rank: int, local_rank: int, backend: str, store: Any,
              call: Callable[..., Any]) -> ReachWatch | NoReach:
    """The node's first worker's watch (``local_rank`` 0), where it has a data address to
    listen on; else none."""
    listener = node_listener(local_rank, backend)
    if listener is None:
        return NO_REACH
    return ReachWatch(rank - local_rank, listener, store, call)


# --- a change's survey --------------------------------------------------------------------------

FOUND = "elastic_mnist/reach/found"
"""What each node's first worker found, in the generation's store: ``FOUND/<node>``,
``{"step": S, "found": [...]}``, the nodes it could not reach while the step after S waited
(``step`` null: as a change began)."""
CUTS = "elastic_mnist/reach/cuts"
"""How many times a node of the generation found another it could not reach: while none has, a
prober's look is one read."""


def announced(store: Any, prefix: str, call: Callable[..., Any] = lambda f, *a: f(*a)
              ) -> dict[int, str]:
    """Where each node of the generation of ``prefix`` listens, as its first worker said (node
    → ``"host:port"``)."""
    count = int(call(store.add, f"{prefix}{NODES}", 0))
    keys = [f"{prefix}{NODES}/{n}" for n in range(count)]
    lines = (v.decode().split(" ", 1) for v in (call(store.multi_get, keys) if keys else []))
    return {int(node): where for node, where in lines}


def survey(store: Any, prefix: str, node: int, listener: Listener) -> threading.Thread:
    """As a change of the generation of ``prefix`` begins: this node (its first rank, ``node``)
    tries every other node that said where it listens in that generation, in a thread, and says
    in ``store`` which it could not reach (nothing where the store does not answer)."""

    def look() -> None:
        try:
            targets = {other: where for other, where in announced(store, prefix).items()
                       if other != node}
            store.set(f"{prefix}{FOUND}/{node}", json.dumps(
                {"step": None, "found": sorted(unreachable(listener.host, targets))}))
        except Exception as e:  # noqa: BLE001 - a store error: nothing said
            log.debug("no survey of the other nodes: %s", e)

    thread = threading.Thread(target=look, daemon=True, name="reach-survey")
    thread.start()
    return thread


class Survey:
    """What the nodes found as a change began, read by its watchers while the new group is not
    built: the nodes it cannot be built across (:func:`cut_off`)."""

    def __init__(self, store: Any, prefix: str, nodes: Mapping[int, int],
                 step: int | None = None, call: Callable[..., Any] = lambda f, *a: f(*a),
                 not_before_s: float = CONNECT_S, patience_s: float = CONNECT_S,
                 what: str = "the new group cannot be built across a cut on the data network"):
        """``prefix``: the surveyed generation's, in ``store``; ``nodes``: each rank of the
        group → its node there (its first rank); ``step``: what was found while the step after
        it waited, only (None: whatever was found last); ``call``: makes each store operation
        (the watchdog's, bounded); ``not_before_s``: how long the group waits before anything
        found counts; ``patience_s``: how long after that for every node's word; ``what``: the
        verdict, in words."""
        self.store, self.prefix, self.nodes = store, prefix, dict(nodes)
        self.step, self.call, self.what = step, call, what
        self.not_before_s, self.patience_s = not_before_s, patience_s
        self.found: dict[int, set[int]] = {}

    def cut(self, waited_s: float) -> tuple[list[int], str]:
        """The group's ranks to go on without, and why, once it has waited ``waited_s`` for its
        members: nothing before ``not_before_s``, nor, until ``patience_s`` after it, before
        every node has said what it found (a node that has no listener says nothing; a verdict
        on one side's word may drop the wrong node)."""
        if waited_s < self.not_before_s:
            return [], ""
        nodes = set(self.nodes.values())
        for node in sorted(nodes - self.found.keys()):
            key = f"{self.prefix}{FOUND}/{node}"
            if self.call(self.store.check, [key]):
                said = json.loads(self.call(self.store.get, key))
                if self.step is None or said["step"] == self.step:
                    self.found[node] = set(said["found"])
        if nodes - self.found.keys() and waited_s < self.not_before_s + self.patience_s:
            return [], ""
        dropped = cut_off(self.found, nodes)
        if not dropped:
            return [], ""
        return (sorted(r for r, node in self.nodes.items() if node in dropped),
                f"{self.what} ({_said(self.found)})")


class Cuts:
    """A prober's look, while its step waits, at what the generation's nodes found
    (:class:`ReachWatch`): the ranks of the nodes to go on without, as soon as every node has
    said what it found in this wait (or ``PATIENCE_S`` after the tries began), instead of at
    the hang verdict. One read a look while no node found a cut in the generation."""

    PATIENCE_S = CONNECT_S + 1.5
    """A try takes ``CONNECT_S`` at most, and each node begins at its own watchdog's beat (a
    second apart at most)."""

    def __init__(self, store: Any, call: Callable[..., Any], world_size: int,
                 step: Callable[[], int]):
        """``store``: the generation's, on which ``call`` (the watchdog's bounded call) makes
        each operation; ``step()``: the last step this rank completed."""
        self.store, self.call, self.world_size, self.step = store, call, world_size, step
        self._nodes: dict[int, int] | None = None
        self._survey: Survey | None = None

    def __call__(self, trying_s: float | None) -> tuple[list[int], str]:
        """``trying_s``: how long the nodes have been trying in this wait (None: the step does
        not wait for that long)."""
        if trying_s is None:
            self._survey = None
            return [], ""
        if not int(self.call(self.store.add, CUTS, 0)):
            return [], ""
        step = self.step()
        if self._survey is None or self._survey.step != step:
            if self._nodes is None:  # ranks are numbered node by node, from each node's first
                firsts = sorted(announced(self.store, "", self.call))
                self._nodes = {r: firsts[max(0, bisect.bisect_right(firsts, r) - 1)]
                               for r in range(self.world_size)} if firsts else {}
            self._survey = Survey(self.store, "", self._nodes, step, self.call, not_before_s=0.0,
                                  patience_s=self.PATIENCE_S,
                                  what="cut off from its peers on the data network")
        return self._survey.cut(trying_s)
