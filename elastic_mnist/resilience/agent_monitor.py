"""What torch's agent asks its rendezvous every ``--monitor_interval`` while its workers run
(``num_nodes_waiting``), answered within a bound: the agent's thread that asks is the one that
watches its workers, and a store call held by a silent connection (a link cut silently, an
outage) held it, in torch 2.14.1, as long as TCP kept the connection, and after the heal as long
as TCP's retransmissions were backed off (tens of seconds after a minute's cut): a worker that
ended meanwhile was not seen.

So the question (the count of agents waiting, and the looks at the keep-alives beside it) is
asked in a thread of its own, one at a time (in_flight.py), and waited for ``ANSWER_S`` from
when it was asked; a question still in flight answers "nobody waits" at once. A question held
``RENEW_S`` is left to its connection: the agent opens a fresh one (``Connection.renew``,
``CONNECT_S`` at most a try, one try a question asked), which reaches a store that is back at
once, and its judgement of the keep-alives begins again on it (:meth:`Monitor.renewed`'s
caller), so that the held question, should it ever end, shares no state with what follows.
Before the agent's own thread uses the store again (a rendezvous, the exit barrier, its
shutdown), :meth:`Monitor.settle` waits for the question in flight, and renews a connection that
holds it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from elastic_mnist.errors import first_line
from elastic_mnist.resilience.agent_store import Connection
from elastic_mnist.resilience.in_flight import InFlight

log = logging.getLogger(__name__)

RETRY_S = 0.1
"""Between two tries to open the connection anew that failed at once (refused)."""

ANSWER_S = 1.0
"""How long the monitor's question is waited for, from when it was asked: a store answers in
milliseconds, and torch's agent asks again every ``--monitor_interval``."""
RENEW_S = 5.0
"""A question held this long has its connection opened anew: a store loaded for a moment
(``make scale`` measured answers slowed twofold) is no cause to open every agent's anew."""


class Monitor:
    """Agent ``serial``'s answers to ``num_nodes_waiting``: ``ask()`` on ``connection``, bounded;
    ``renewed()`` is told each time the connection was opened anew under a held question."""

    def __init__(self, serial: int, connection: Connection, ask: Callable[[], int],
                 renewed: Callable[[], None]):
        self.serial, self.connection, self._ask, self._renewed = serial, connection, ask, renewed
        self._asking = self._question()
        self.silent = False
        """Whether the last question was held past its bound (said once, until one answers)."""

    def _question(self) -> InFlight:
        return InFlight(self._ask, f"rdzv-monitor-{self.serial}", lambda _: None)

    def waiting(self) -> int:
        """The agents waiting, or 0 where the store did not answer within ``ANSWER_S``."""
        try:
            waiting = self._asking.result(ANSWER_S, lambda in_flight, left: 0.0 if in_flight
                                          else left)
        except TimeoutError:
            if self._asking.left(RENEW_S) == 0:
                self._held()
            return 0
        if self.silent:
            log.warning("agent %d reaches the rendezvous store again", self.serial)
            self.silent = False
        return waiting

    def settle(self, bound_s: float) -> None:
        """Waits for the question in flight (``ANSWER_S`` from when it was asked), and where it
        is still held, opens the connection anew, tried for ``bound_s`` at most."""
        pending = self._asking.pending()
        if pending is None:
            return
        try:
            pending.result(self._asking.left(ANSWER_S))
        except TimeoutError:
            deadline = time.monotonic() + bound_s
            while not pending.done() and not self._held() and time.monotonic() < deadline:
                time.sleep(RETRY_S)
        except Exception as e:  # noqa: BLE001 - the question's own: the next call meets it
            log.debug("agent %d's last question failed: %s", self.serial, first_line(e))

    def _held(self) -> bool:
        """A question held past its bound: said once; the connection opened anew (one try,
        ``CONNECT_S`` at most). Whether it was."""
        if not self.silent:
            log.warning("agent %d: the rendezvous store did not answer within %g s; the agent "
                        "watches its workers on and opens its connection anew", self.serial,
                        ANSWER_S)
            self.silent = True
        if not self.connection.renew():
            return False
        self._asking = self._question()  # the held one is left to the old connection
        self._renewed()
        return True
