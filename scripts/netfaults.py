"""Network faults for the chaos harness on hosts of their own (scripts/hosts.py): what each kind
does to the network, when it heals, and how the job answered it, read from the run's records.

Each fault lasts its seconds and then heals by itself (a timer), whatever the harness is doing:

    cut-node      every link of a node cut (its root ends down): to the others it is silent,
                  as a machine whose power failed; back after the heal
    cut-data      its data link cut: it reaches the store, not its peers
    cut-control   its control link cut: it reaches its peers, not the store
    cut-in        its data link dropped towards it alone: its peers hear it, it hears nothing
    cut-out       its data link dropped from it alone: it hears its peers, they hear nothing
    flap-node     every link of a node cut and healed, FLAP_DOWN_S down and FLAP_UP_S up, again
                  and again while the fault lasts
    slow-link     its data link slowed to SLOW_RATE both ways (tc tbf)
    store-outage  the store's host cut from every node (its one control link); the nodes still
                  reach each other
    store-kill    the store's outage, and a node SIGKILLed KILL_AFTER_S into it (every process
                  of its host): a fault whose recovery needs the store while it is away
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass, field

import hosts

NET_KINDS = ("cut-node", "cut-data", "cut-control", "cut-in", "cut-out", "flap-node",
             "slow-link", "store-outage", "store-kill")
DEFAULT_SECONDS = 20.0
"""How long a network fault lasts when its schedule entry does not say."""
FLAP_DOWN_S = 3.0
FLAP_UP_S = 3.0
SLOW_RATE = "4mbit"
"""A slowed link's rate: each step's all-reduce of the ConvNet's 29k gradients sends about
0.4 MB each way through a node of 2 workers' data link, most of a second at this rate."""
KILL_AFTER_S = 3.0
"""How far into the store's outage store-kill's node is killed."""
STORE_HOST = "store"
"""The host of ``elastic-mnist rendezvous`` (scripts/chaos.py's Cluster)."""
CUTS = {"cut-node": (None, "both"), "cut-data": ("data", "both"),
        "cut-control": ("control", "both"), "cut-in": ("data", "in"),
        "cut-out": ("data", "out")}
"""Each cut's link (None: every link) and direction."""


def needs_node(kind: str) -> bool:
    """The fault takes a node (all but the store's outage)."""
    return kind != "store-outage"


def strikes_store(kind: str) -> bool:
    """The fault cuts the store's host (store-kill takes a node besides)."""
    return kind in ("store-outage", "store-kill")


@dataclass
class Strike:
    """A network fault under way: made by :meth:`start`, healed by its timer or by
    :meth:`heal`, whichever comes first (both: once)."""

    network: hosts.Network
    kind: str
    host: str
    seconds: float
    at: float = 0.0
    healed: float | None = None
    flap: hosts.Flap | None = None
    victim: str | None = None
    """store-kill's node's host, whose processes are killed KILL_AFTER_S into the outage."""
    killed: float | None = None
    """When they were (the fault judged: store-kill's record counts from it)."""
    _timer: threading.Timer | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        self.at = time.time()
        if self.kind in CUTS:
            kind, direction = CUTS[self.kind]
            self.network.cut(self.host, kind, direction)
        elif self.kind == "flap-node":
            self.flap = self.network.flap(self.host, FLAP_DOWN_S, FLAP_UP_S)
        elif self.kind == "slow-link":
            self.network.slow(self.host, SLOW_RATE, "data")
        elif strikes_store(self.kind):
            self.network.cut(self.host)
            if self.victim is not None:
                kill = threading.Timer(KILL_AFTER_S, self._kill_victim)
                kill.daemon = True
                kill.start()
        else:
            raise ValueError(f"not a network fault: {self.kind}")
        self._timer = threading.Timer(self.seconds, self.heal)
        self._timer.daemon = True
        self._timer.start()

    def _kill_victim(self) -> None:
        self.killed = time.time()
        for pid in self.network.pids(self.victim):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def heal(self) -> None:
        with self._lock:
            if self.healed is not None or not self.at:
                return
            if self._timer is not None:
                self._timer.cancel()
            if self.flap is not None:
                self.flap.stop()
            self.network.heal(self.host)
            self.healed = time.time()


@dataclass
class Answer:
    """How the job answered a network fault, from its events between the fault and the end of
    its watch."""

    recovery: str
    """``none`` (nobody dropped, no restart: the job rode it out), ``in-process`` (a shrink)
    or ``restart`` (a start record: workers started again)."""
    noticed: float | None
    regrouped: float | None
    shrinks: int
    grows: int
    """Nodes admitted back in process (a flapping node: once per try)."""


def answer(events: list[dict], since: float, until: float, event_time) -> Answer:
    """The job's answer to a fault at ``since``, from its events up to ``until``."""
    inside = [e for e in events if since < event_time(e) <= until]
    starts = [e for e in inside if e["event"] == "start"]
    shrinks = [e for e in inside if e["event"] == "shrink"]
    grows = [e for e in inside if e["event"] == "grow"]
    first = (starts or shrinks or [None])[0]
    if shrinks and (not starts or event_time(shrinks[0]) < event_time(starts[0])):
        first = shrinks[0]
    recovery = "restart" if starts else "in-process" if shrinks else "none"
    noticed = regrouped = None
    if first is not None and first["event"] == "shrink":
        noticed, regrouped = (event_time(first, "detected_time"),
                              event_time(first, "regrouped_time"))
    elif first is not None:
        noticed = regrouped = event_time(first)
    return Answer(recovery, noticed, regrouped, len(shrinks), len(grows))
