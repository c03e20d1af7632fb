"""A node that keeps coming back only to be lost again is kept out for a while.

A node whose link flaps (a loose cable, a switch port that resets) is named silent and dropped
each time it goes down (silence.py), and its workers, restarted by its agent, ask to join each
time it is up: admitted again and again, it would cost the job a change of generation, and
every rank a regrouping, each time. Rank 0 counts each node's admissions (admissions.py): a
node admitted ``TRIES`` times within ``WINDOW_S`` is kept out, which rank 0 says in one line,
until it has asked to join for ``QUIET_S`` without being lost meanwhile (its join is then the
same one, still waiting: a node lost again asks anew, and waits anew). The counts are rank 0's:
a new rank 0 (the old one lost) starts with none.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

TRIES = 3
"""Admissions of one node within ``WINDOW_S`` after which it is kept out."""
WINDOW_S = 300.0
QUIET_S = 20.0
"""How long a node kept out must have waited to join, its join unbroken, before it is let in."""


class Flapping:
    """Rank 0's count of each node's admissions, by its agent (its serial in our rendezvous, or
    its pid under torch's c10d one)."""

    def __init__(self, tries: int = TRIES, window_s: float = WINDOW_S, quiet_s: float = QUIET_S,
                 clock: Callable[[], float] = time.monotonic):
        self.tries, self.window_s, self.quiet_s, self.clock = tries, window_s, quiet_s, clock
        self._admitted: dict[int, list[float]] = {}
        """agent → when rank 0 admitted its node, within the window."""
        self._waiting: dict[tuple[int, int], float] = {}
        """(agent, join) → when rank 0 first found that join ready."""
        self._said: set[tuple[int, int]] = set()

    def admissible(self, agent: int, join: int) -> bool:
        """Whether the node of ``agent``, ready to join as ``join``, may be admitted now."""
        now = self.clock()
        recent = [t for t in self._admitted.get(agent, []) if now - t < self.window_s]
        self._admitted[agent] = recent
        waited = now - self._waiting.setdefault((agent, join), now)
        if len(recent) < self.tries:
            return True
        if waited >= self.quiet_s:
            log.warning("the node of agent %d waited %.0f s to join without being lost: "
                        "admitting it again", agent, waited)
            return True
        if (agent, join) not in self._said:
            self._said.add((agent, join))
            log.warning("the node of agent %d was admitted %d times in the last %.0f s and lost "
                        "each time (its link flaps?): kept out until it has waited %.0f s to "
                        "join without being lost", agent, len(recent), self.window_s,
                        self.quiet_s)
        return False

    def ready(self, joins: set[tuple[int, int]]) -> None:
        """The (agent, join) pairs ready to join at this look: a join that is not (lost again,
        or not reached) waits anew when it is."""
        for key in set(self._waiting) - joins:
            del self._waiting[key]

    def admitted(self, agent: int, join: int) -> None:
        """The node of ``agent`` was admitted (as ``join``)."""
        self._admitted.setdefault(agent, []).append(self.clock())
        self._waiting.pop((agent, join), None)
