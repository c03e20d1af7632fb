"""Who is cut off from whom on the data network: a one-sided partition named.

A node that reaches the coordination store but not its peers (its data link cut, or one way of
it) keeps its pulses and heartbeats going: nothing says which side is cut off, and at the hang
verdict every rank is "alive and waiting in a collective". Named by nobody, the job restarted
(41 s in ``make partitions``).

Each node's first worker listens on the address its collectives use (``GLOO_SOCKET_IFNAME``'s
interface, else its host name's, as gloo picks it; ``NCCL_SOCKET_IFNAME`` under NCCL), and says
where in the generation's store. Once its step has waited half the hang deadline, it tries to
connect to every other node's listener, from that address, every beat, and says in its
heartbeat which nodes it could not reach within ``CONNECT_S``. At the verdict the probers read
that in the heartbeats they read anyway: the nodes to drop are the fewest whose loss leaves
every pair of the rest in reach of each other (:func:`cut_off`), and the others go on without
them in process. One node per node probes, one connection per other node: at 1,000 nodes, a
thousand connections a node, once a beat, only while the job is stuck.
"""

from __future__ import annotations

import contextlib
import functools
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

    def announce(self) -> None:
        """Says where this node listens, for the generation."""
        n = self.call(self.store.add, NODES, 1)
        self.call(self.store.set, f"{NODES}/{n - 1}", f"{self.node} {self.listener.address}")

    def beat(self, stalled_s: float | None, deadline_s: float) -> None:
        """Once a beat: once the step has waited half the deadline, a try in the background
        (one at a time); before that, nothing found."""
        if stalled_s is None or stalled_s < deadline_s / 2:
            self.found = []
        elif self._trying is None or not self._trying.is_alive():
            self._trying = threading.Thread(target=self._try, daemon=True, name="reach-try")
            self._trying.start()

    def _try(self) -> None:
        try:
            if self._targets is None:  # read once: every node said where as the group began
                count = int(self.call(self.store.add, NODES, 0))
                keys = [f"{NODES}/{n}" for n in range(count)]
                lines = (v.decode().split(" ", 1) for v in self.call(self.store.multi_get, keys))
                self._targets = {int(node): where for node, where in lines
                                 if int(node) != self.node}
            self.found = sorted(unreachable(self.listener.host, self._targets))
        except Exception as e:  # noqa: BLE001 - StoreSilent, a store error: nothing found
            log.debug("no try to reach the other nodes: %s", e)

    def close(self) -> None:
        self.listener.close()


class NoReach:
    """A worker that does not try: not its node's first, or no data address."""

    node = -1
    found: tuple[int, ...] = ()

    def announce(self) -> None:
        pass

    def beat(self, stalled_s: float | None, deadline_s: float) -> None:
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
    said = "; ".join(f"node of rank {a} could not reach the node(s) of rank(s) "
                     f"{', '.join(map(str, sorted(b)))}" for a, b in sorted(found.items()))
    return ranks, f"cut off from its peers on the data network ({said})"


def reach_for(rank: int, local_rank: int, backend: str, store: Any,
              call: Callable[..., Any]) -> ReachWatch | NoReach:
    """The node's first worker's watch (``local_rank`` 0), where it has a data address to
    listen on; else none."""
    address = data_address(backend) if local_rank == 0 else None
    if address is None:
        return NO_REACH
    try:
        listener = Listener(address)
    except OSError as e:
        log.warning("no listener on %s for the other nodes to try (%s): a node cut off from "
                    "its peers is not named", address, e)
        return NO_REACH
    return ReachWatch(rank - local_rank, listener, store, call)
