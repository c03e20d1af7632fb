"""An agent's keep-alive (agents.py), its one job: a counter in the rendezvous store that a thread
of the agent's own raises for as long as the agent's process lives, which the others read to tell
a live agent from a dead one (roster.py's ``Liveness``). A store that stalls holds it up, never
stops it: a raise held past ``HELD_S`` (a link cut silently, an outage) is left to its
connection, and the next goes on a fresh one, opened within ``CONNECT_S`` (in_flight.py), since
after the heal a held connection waits as long as TCP's retransmissions were backed off (tens
of seconds after a minute's cut), where a fresh one answers at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch.distributed as dist

from elastic_mnist.backoff import cap_connections
from elastic_mnist.errors import first_line
from elastic_mnist.resilience.in_flight import within
from elastic_mnist.resilience.roster import Roster

log = logging.getLogger(__name__)

HELD_S = 2.0
"""A raise not answered in this long (or in a keep-alive interval, where that is longer) is
left to its connection: a store answers in milliseconds."""

CONNECT_S = 2.0
"""How long the opening of a fresh connection is waited for, each keep-alive."""


class KeepAlive:
    """Agent ``serial``'s keep-alive: a thread that raises its counter every ``interval_s``, on
    a store connection of its own, from start until :meth:`stop`. A raise held past
    ``HELD_S``, or one that fails, is said once, then the thread connects again and goes on."""

    def __init__(self, connect: Callable[[], dist.Store], run_id: str, serial: int,
                 interval_s: float):
        self.connect, self.run_id, self.serial, self.interval_s = (connect, run_id, serial,
                                                                   interval_s)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"rdzv-keep-alive-{serial}")
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()

    def _run(self) -> None:
        roster, failing = None, False
        while not self.stopped.wait(self.interval_s):
            try:
                cap_connections()  # the agent's, opened since (backoff.py)
                if roster is None:
                    roster = Roster(within(self.connect, CONNECT_S, "rdzv-connect"), self.run_id)
                within(lambda r=roster: r.keep_alive(self.serial),
                       max(HELD_S, self.interval_s), "rdzv-keep-alive-raise")
                if failing:
                    log.warning("agent %d's keep-alive reaches the store again", self.serial)
                    failing = False
            except Exception as e:  # noqa: BLE001 - never stop while the agent lives
                roster = None  # a held call keeps its connection: the next opens a fresh one
                if not failing and not self.stopped.is_set():
                    why = ("no answer in time" if isinstance(e, TimeoutError)
                           else first_line(e))
                    log.warning("agent %d's keep-alive cannot reach the store (%s): it tries "
                                "again every %gs", self.serial, why, self.interval_s)
                    failing = True
