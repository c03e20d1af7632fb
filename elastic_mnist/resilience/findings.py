"""What the nodes found as they tried each other (reach.py), read: by the probers while a step
waits (:class:`Cuts`), and by a change's watchers while its new group is not built
(:class:`Survey`, of what each node's first worker found as the round began: :func:`survey`).

A pair of nodes counts as cut only where both of them said what they found, in the same wait
(a handshake fails both ways in any cut; one side alone cannot tell which side is cut off), and
the nodes to drop are the fewest whose loss leaves every pair of the rest in reach of each
other (:func:`~elastic_mnist.resilience.reach.cut_off`).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from elastic_mnist.resilience.agreement import read_present
from elastic_mnist.resilience.reach import (
    CONNECT_S,
    CUTS,
    FOUND,
    Listener,
    announced,
    cut_off,
    in_words,
    unreachable,
)

log = logging.getLogger(__name__)


def survey(connect: Callable[[], Any], announced_in: str, prefix: str, node: int,
           listener: Listener) -> threading.Thread:
    """As a round of a change begins in the generation of ``prefix``: this node (``node``: its
    first rank where the change began) tries every other node that said where it listens in the
    generation the change began in (``announced_in``), in a thread, and says in the store which
    it could not reach, on ``connect()`` (the watchdog's connection, idle in a change: a store
    that does not answer holds no declaration or check-in behind it, and nothing is said)."""

    def look() -> None:
        try:
            store = connect()
            targets = {other: where for other, where in announced(store, announced_in).items()
                       if where != listener.address}
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
        it waited, only (None: what a change's survey found); ``call``: makes each store operation
        (the watchdog's, bounded); ``not_before_s``: how long the group waits before anything
        found counts; ``patience_s``: how long after that for every node's word; ``what``: the
        verdict, in words."""
        self.store, self.prefix, self.nodes = store, prefix, dict(nodes)
        self.step, self.call, self.what = step, call, what
        self.not_before_s, self.patience_s = not_before_s, patience_s

    def cut(self, waited_s: float) -> tuple[list[int], str]:
        """The group's ranks to go on without, and why, once it has waited ``waited_s`` for its
        members: nothing before ``not_before_s``, nor, until ``patience_s`` after it, before
        every node has said what it found (a node that has no listener says nothing; a verdict
        on one side's word may drop the wrong node)."""
        if waited_s < self.not_before_s:
            return [], ""
        nodes = set(self.nodes.values())
        keys = {f"{self.prefix}{FOUND}/{node}": node for node in nodes}
        found: dict[int, set[int]] = {}  # read anew at each look: a cut found may have healed
        for key, value in read_present(self.store, list(keys), self.call).items():
            said = json.loads(value)
            if said["step"] == self.step:
                found[keys[key]] = set(said["found"])
        if nodes - found.keys() and waited_s < self.not_before_s + self.patience_s:
            return [], ""
        # A pair is cut only where both of its nodes said what they found (a handshake fails
        # both ways in any cut): one node's word alone drops nobody, not even itself.
        dropped = cut_off({a: b & found.keys() for a, b in found.items()}, nodes & found.keys())
        if not dropped:
            return [], ""
        return (sorted(r for r, node in self.nodes.items() if node in dropped),
                f"{self.what} ({in_words(found)})")


class Cuts:
    """A prober's look, while its step waits, at what the generation's nodes found
    (:class:`ReachWatch`): the ranks of the nodes to go on without, as soon as every node has
    said what it found in this wait (or ``PATIENCE_S`` after the tries began), instead of at
    the hang verdict. One read a look while no node found a cut in the generation."""

    PATIENCE_S = CONNECT_S + 1.0
    """A try takes ``CONNECT_S`` at most, and each node begins when its own wait is long enough
    (its own slowest steps), looked at every ``LOOK_S``."""

    def __init__(self, store: Any, call: Callable[..., Any],
                 nodes: Callable[[], Mapping[int, int]], step: Callable[[], int]):
        """``store``: the generation's, on which ``call`` (the watchdog's bounded call) makes
        each operation; ``nodes()``: each rank's node, as its heartbeat said it; ``step()``: the
        last step this rank completed."""
        self.store, self.call, self.nodes, self.step = store, call, nodes, step
        self._survey: Survey | None = None

    def __call__(self, trying_s: float | None) -> tuple[list[int], str]:
        """``trying_s``: how long the nodes have been trying in this wait (None: the step does
        not wait for that long)."""
        if trying_s is None:
            return [], ""
        if not int(self.call(self.store.add, CUTS, 0)):
            return [], ""
        step = self.step()
        if self._survey is None or self._survey.step != step:
            self._survey = Survey(self.store, "", self.nodes(), step, self.call, not_before_s=0.0,
                                  patience_s=self.PATIENCE_S,
                                  what="cut off from its peers on the data network")
        return self._survey.cut(trying_s)
