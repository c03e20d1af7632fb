"""A change that needs the coordination store while it is away waits for it: bounded, and said.

The store is off the step's path: training goes on through an outage (``make partitions``'
store-30). A fault during one cannot be recovered without it (the declaration, the check-in, the
new group's store are all in it), and at the change's bound (twice ``--hang-timeout``) every
survivor fell back: a node killed 3 s into a 30 s outage cost a restart. So at the bound, where
the store does not answer a fresh connection within ``PROBE_S``, the change waits on, ``EXTEND_S``
at a time, up to ``STORE_WAIT_S`` from its start, said once; the first bound after the store is
heard again gives its held calls ``EXTEND_S`` more (with TCP's backoff capped, backoff.py, they
are heard within a second of the heal). Then the bound ends the process as before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from elastic_mnist.errors import first_line
from elastic_mnist.resilience.deadline import Deadline
from elastic_mnist.resilience.in_flight import within

log = logging.getLogger(__name__)

STORE_WAIT_S = 60.0
"""How long a change may wait for a store that went away, from its start: an outage of about
50 s, with the recovery after it."""
EXTEND_S = 5.0
"""The bound's steps while it waits."""
PROBE_S = 2.0
"""How long the store is given to answer a fresh connection, at each step."""


class StoreWait:
    """At the change's bound: whether it waits on for the store (``probe()``: a call on a fresh
    connection to it)."""

    def __init__(self, probe: Callable[[], object]):
        self._probe = probe
        self._change = -1.0
        self._away = self._grace = False

    def extends(self, deadline: Deadline) -> bool:
        """Whether ``deadline`` was extended (from its timer's thread): the store is away and
        the change has waited less than ``STORE_WAIT_S``, or it is heard again after it was."""
        if self._change != deadline.armed_at:  # another change: nothing seen yet
            self._change, self._away, self._grace = deadline.armed_at, False, False
        left = STORE_WAIT_S - (time.monotonic() - deadline.armed_at)
        if left <= 0:
            return False
        if self._answers():
            if not self._away or self._grace:
                return False
            self._grace = True
        elif not self._away:
            self._away = True
            log.warning("the coordination store does not answer: the recovery waits for it, up "
                        "to %g s from the fault, then leaves so that torchrun restarts the job",
                        STORE_WAIT_S)
        return deadline.extend(min(EXTEND_S, left))

    def said(self, deadline: Deadline) -> str:
        """How long the last change ran, in words."""
        waited = f"{time.monotonic() - deadline.armed_at:.0f} s"
        return f"{waited} (the coordination store was away)" if self._away else waited

    def _answers(self) -> bool:
        try:
            within(self._probe, PROBE_S, "membership-store-probe")
        except (TimeoutError, RuntimeError) as e:
            log.debug("the coordination store did not answer a fresh connection: %s",
                      first_line(e))
            return False
        return True
