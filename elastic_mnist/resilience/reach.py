"""Who is cut off from whom on the data network: a one-sided partition named.

A node that reaches the coordination store but not its peers (its data link cut, or one way of
it) keeps its pulses and heartbeats going: nothing says which side is cut off, and at the hang
verdict every rank is "alive and waiting in a collective". Named by nobody, the job restarted
(41 s in ``make partitions``).

Each node's first worker listens on the address its collectives use (``GLOO_SOCKET_IFNAME``'s
interface, else its host name's, as gloo picks it; ``NCCL_SOCKET_IFNAME`` under NCCL), and says
where in the generation's store. Once its step has waited as long as a silent peer takes to be
named (``silence.stall_after``: 1 s, or two of the slowest recent steps), it tries to connect to
every other node's listener, from that address, once a wait (again after ``TRY_AGAIN_S``), sending
each try again every ``RESEND_S`` (one lost SYN is no cut), and says in the store which nodes it
could not reach within ``CONNECT_S`` (``FOUND``); when the wait ends, it takes that back. The
probers, which look at the pulses ten times a second while they wait, look there too
(:class:`~elastic_mnist.resilience.findings.Cuts`): as soon as every node has said what it found in
this wait, the nodes to drop are the fewest whose loss leaves every pair of the rest in reach of
each other (:func:`cut_off`; a pair counts only where both of its nodes said, since one side alone
cannot tell which side is cut off), and the others go on without them in process, a few seconds
after the cut instead of at the hang verdict. The heartbeats carry the same findings, for that
verdict. One node per node tries, one connection per other node: at 1,000 nodes, a thousand
connections a node, once a wait that lasts a second or more.

A cut can also strike first inside a node (one way of its link dropped: its own collective fails at
once, naming no peer), and then every rank checks in, the cut one too, since it reaches the store:
the new group, built across the cut, could never be complete (59 s, and a restart). So as each
round of a change begins, each node's first worker tries the others again
(:func:`~elastic_mnist.resilience.findings.survey`; its listener outlives the generations), and
where the new group is still not built when the tries are done, the change's watchers drop the
nodes cut off (findings.py), in a round of the same change.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import selectors
import socket
import struct
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
from elastic_mnist.resilience.agreement import read_present
from elastic_mnist.resilience.heartbeat import Heartbeat

log = logging.getLogger(__name__)

CONNECT_S = 1.0
"""How long a node may take to answer a try: a reachable node's connection takes milliseconds
on any cluster network; a node that has not answered a try every ``RESEND_S`` for this long is
cut off."""
TRY_AGAIN_S = 5.0
"""How long a wait goes on before a node tries again: once a wait, not every look, where the
wait is a peer's long save or evaluation (a thousand connections a node at 1,000 nodes)."""
LOOK_S = 0.1
"""How often a node's first worker looks whether its step has waited long enough for a try."""
RESEND_S = 0.25
"""How often a try is sent again beside the earlier ones: TCP itself would send a lost SYN again
only after a second (and again after three), and one lost SYN is no cut."""


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
        self._closed = False
        self._thread = threading.Thread(target=self._serve, daemon=True, name="reach-listener")
        self._thread.start()

    def _serve(self) -> None:
        """Accepts for as long as the process lives: an error of one connection (aborted, no
        buffers, no file descriptors for a moment) is no reason to stop answering the others."""
        while not self._closed:
            try:
                connection, _ = self._socket.accept()
            except OSError as e:
                if not self._closed:
                    log.debug("the listener's accept failed (%s): accepting on", e)
                    time.sleep(0.01)
                continue
            connection.close()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)
        self._socket.close()


def unreachable(source: str, targets: Mapping[int, str], timeout_s: float = CONNECT_S,
                resend_s: float = RESEND_S) -> set[int]:
    """The ``targets`` (node → ``"host:port"``) that a connection from ``source`` does not
    reach within ``timeout_s``: all at once, a silent one tried again beside its earlier tries,
    on a new socket, every ``resend_s`` until one connects; a refused or reset try, or no such
    address, is as unreachable as a silent one, at once. A node this host could not even try
    (no socket, no port to bind here) is not named: that is no finding about the network. Each
    try is closed with a reset, which leaves no port of this host waiting (TIME_WAIT)."""
    reached: set[int] = set()
    bad: set[int] = set()  # refused, reset, or no such address
    untried: set[int] = set()
    tries: dict[socket.socket, int] = {}

    def close(s: socket.socket) -> None:
        with contextlib.suppress(OSError):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()

    def looked(selector: selectors.BaseSelector, timeout: float) -> None:
        for key, _ in selector.select(timeout):
            s = key.fileobj
            node = tries.pop(s)
            selector.unregister(s)
            (bad if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) else reached).add(node)
            close(s)

    with selectors.DefaultSelector() as selector:
        deadline = time.monotonic() + timeout_s
        resend = time.monotonic()
        while (waiting := set(targets) - reached - bad - untried) and \
                (now := time.monotonic()) < deadline:
            if now >= resend:
                for node in waiting:
                    host, _, port = targets[node].rpartition(":")
                    try:
                        s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
                    except OSError:
                        untried.add(node)
                        continue
                    s.setblocking(False)
                    try:
                        s.bind((source, 0))
                    except OSError:  # this host's own trouble (no port): no finding
                        close(s)
                        untried.add(node)
                        continue
                    try:
                        error = s.connect_ex((host, int(port)))
                    except (OSError, ValueError):  # no such address
                        error = errno.EINVAL
                    if error not in (0, errno.EINPROGRESS):  # refused, no route: at once
                        close(s)
                        bad.add(node)
                        continue
                    tries[s] = node
                    selector.register(s, selectors.EVENT_WRITE)
                resend = now + resend_s
            looked(selector, max(0.0, min(resend, deadline) - time.monotonic()))
        looked(selector, 0)  # done as the time ran out: looked at once more
        for s in tries:
            close(s)
    return set(targets) - reached - (untried - bad)


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


_LISTENERS: dict[str, Listener] = {}
_LISTENING = threading.Lock()


def _listener_on(address: str) -> Listener | None:
    """This process's listener on ``address``: opened once, it outlives the generations (a
    change's survey tries the nodes whose watchdogs are gone with their generation); one that
    could not be opened is tried again at the next generation."""
    with _LISTENING:
        if address not in _LISTENERS:
            try:
                _LISTENERS[address] = Listener(address)
            except OSError as e:
                log.warning("no listener on %s for the other nodes to try (%s): a node cut off "
                            "from its peers is not named", address, e)
                return None
        return _LISTENERS[address]


def node_listener(local_rank: int, backend: str) -> Listener | None:
    """The listener of the node's first worker (``local_rank`` 0), where it has a data address;
    else none."""
    address = data_address(backend) if local_rank == 0 else None
    return None if address is None else _listener_on(address)


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
    # Present only: an entry may never be written (its node lost between its count and its
    # address), and a multi_get waits for a missing key.
    lines = (v.decode().split(" ", 1) for v in read_present(store, keys, call).values())
    return {int(node): where for node, where in lines}


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
        self._tried_at: float | None = None
        """When this node last tried, in the step's current wait."""
        self._wait = 0
        """The step's waits so far: a try that outlives its wait says nothing."""
        self._saying = threading.Lock()

    def announce(self) -> None:
        """Says where this node listens, for the generation."""
        n = self.call(self.store.add, NODES, 1)
        self.call(self.store.set, f"{NODES}/{n - 1}", f"{self.node} {self.listener.address}")

    def watch(self, stalled_s: Callable[[], float | None], after_s: Callable[[], float],
              step: Callable[[], int], stop: threading.Event) -> None:
        """Looks every ``LOOK_S``, in a thread of its own, until ``stop``: :meth:`beat` with
        how long the step has waited (``stalled_s()``), the wait that calls for a try
        (``after_s()``) and the last step done (``step()``)."""

        def run() -> None:
            while not stop.wait(LOOK_S):
                self.beat(stalled_s(), after_s(), step())

        threading.Thread(target=run, daemon=True, name="reach-watch").start()

    def beat(self, stalled_s: float | None, after_s: float, step: int = 0) -> None:
        """Once the step (``step``, the last one done) has waited ``after_s``, a try in the
        background (one at a time), whose finding is said in the store for the probers
        (:class:`~elastic_mnist.resilience.findings.Cuts`); before that, nothing found."""
        if stalled_s is None or stalled_s < after_s:
            if self._tried_at is not None:
                self._wait += 1
            self.found, self._tried_at = [], None
            if self._said is not None and self._said["found"]:  # the wait is over: a cut
                self._say(step, [])  # found in it holds no more, in this step's next wait too
            return
        if self._trying is not None and self._trying.is_alive():
            return
        if self._tried_at is not None and time.monotonic() - self._tried_at < TRY_AGAIN_S:
            return
        self._tried_at = time.monotonic()
        self._trying = threading.Thread(target=self._try, args=(step, self._wait), daemon=True,
                                        name="reach-try")
        self._trying.start()

    def _say(self, step: int, found: list[int], wait: int | None = None) -> None:
        """Says in the store what this node found while the step after ``step`` waited (in its
        ``wait``-th wait: nothing once that is over), by one thread at a time (the try's, the
        watch's that takes it back)."""
        said = {"step": step, "found": found}
        with self._saying:
            if said == self._said or (wait is not None and wait != self._wait):
                return
            try:
                self.call(self.store.set, f"{FOUND}/{self.node}", json.dumps(said))
                if found:
                    self.call(self.store.add, CUTS, 1)
                self._said = said
            except Exception as e:  # noqa: BLE001 - StoreSilent, a store error: said next time
                log.debug("what this node found was not said: %s", e)

    def _try(self, step: int, wait: int) -> None:
        try:
            if self._targets is None:  # read once: every node said where as the group began
                self._targets = {node: where for node, where
                                 in announced(self.store, "", self.call).items()
                                 if node != self.node}
            found = sorted(unreachable(self.listener.host, self._targets))
            if wait == self._wait:
                self.found = found
                self._say(step, found, wait)
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

    def watch(self, stalled_s: Callable[[], float | None], after_s: Callable[[], float],
              step: Callable[[], int], stop: threading.Event) -> None:
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
    return ranks, f"cut off from its peers on the data network ({in_words(found)})"


def in_words(found: Mapping[int, set[int]]) -> str:
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
