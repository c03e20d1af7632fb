"""One worker speaks for its node in a change's agreement: its siblings hand it what it needs on
their node's board, and take from the board what it learns.

A fault's survivors each made five operations on the coordination store: the fault's read as
they were woken, a check-in of two, a wait for the membership's record and its read. At 1,000
nodes of 8 that is 40,000 operations within a second or two of a hang's verdict (its survivors
wait for nobody's silence), beside the 20,600 a second of the steady state (``make scale``).
Through the node's board (board.py: a mailbox per worker, written by it alone) a node makes
them once:

- **the fault**: the node's first rank reads it as it is woken, and posts it; its siblings, woken
  at the same moment, take it from the board (each reads it itself where nothing is posted
  within ``FAULT_WAIT_S``: the first rank is the hung one, say; the watchers and backups read
  it themselves);
- **the check-in**: each survivor posts where it stood; the node's *relay* (its first rank that
  the fault does not name and that does not agree by itself) gathers its siblings' positions
  (``GATHER_S`` at most), checks them in at once (one arrival, a line each), and posts whom it
  checked in; a sibling it did not name checks itself in;
- **the membership's record**: the relay waits for it, reads it and posts it; its siblings take
  it from the board, or wait for it and read it themselves where the relay posted that it
  could not, or fell silent (its pulse on the board stood still for ``RELAY_SILENT_S``).

The generation's watchers and backup watchers (agreement.py) agree by themselves: they close the
membership for all, and must not wait on a node that may be the one lost. Every path ends where
the rank's own would: what a relay fails to do, its siblings do themselves, and a rank checked in
twice is one member (``close_membership``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from elastic_mnist.env import DistEnv
from elastic_mnist.resilience.agreement import (
    backup_watchers,
    check_in_all,
    decode_ranks,
    decoded_record,
    encode_ranks,
    encoded_record,
    watchers,
)
from elastic_mnist.resilience.board import NodeBoard

FAULT_WAIT_S = 0.05
"""How long a woken rank looks on the board for the fault its node's first rank reads, before
it reads the fault itself."""
GATHER_S = 0.2
"""How long a relay waits for its siblings' positions before it checks in those it has."""
CONFIRM_S = 0.5
"""How much longer than ``GATHER_S`` a sibling waits to be named among those checked in."""
RELAY_SILENT_S = 1.0
"""A relay whose pulse on the board stood still this long is frozen or gone: its siblings do
its work themselves (a live one's pulse moves every 0.1 s; a second covers a starved CPU)."""
FIRST_LOOK_S, MOST_LOOK_S = 0.002, 0.02
"""The pause between two looks at the board: doubling from the first to the most."""


def node_ranks(env: DistEnv) -> range:
    """The ranks of this rank's node (ranks are numbered node by node)."""
    first = env.rank - env.local_rank
    return range(first, first + env.local_world_size)


def by_themselves(expected: set[int]) -> set[int]:
    """The ranks, of ``expected``, that agree by themselves: the watchers and the backups."""
    return set(watchers(expected)) | set(backup_watchers(expected))


def relay_of(env: DistEnv, expected: set[int], alone: set[int] | None = None) -> int | None:
    """The rank that checks in for this rank's node, and reads the record for it: its first
    expected rank that does not agree by itself (None where this rank agrees by itself).
    ``alone``: :func:`by_themselves` of ``expected``, where the caller has it (it sorts the
    ranks: milliseconds at 8,000)."""
    alone = by_themselves(expected) if alone is None else alone
    if env.rank in alone or env.rank not in expected:
        return None
    return next(r for r in node_ranks(env) if r in expected and r not in alone)


class Relay:
    """A worker's side of its node's board in a change: its own mailbox, and its siblings'."""

    def __init__(self, board: NodeBoard):
        self.board = board
        self._message: dict[str, Any] = {}
        self._lock = threading.Lock()  # the wake-up thread posts the fault, the trainer the rest
        self._alone: tuple[int, set[int]] = (-1, set())
        """A generation, and its ranks that agree by themselves (its one fault names whom it
        expects)."""

    def alone(self, generation: int, expected: set[int]) -> set[int]:
        """:func:`by_themselves` of ``generation``'s ``expected`` ranks, found once."""
        if self._alone[0] != generation:
            self._alone = (generation, by_themselves(expected))
        return self._alone[1]

    def post(self, generation: int, rank: int, **fields: Any) -> None:
        """``fields`` in this process's mailbox, as ``rank`` of ``generation``, beside what it
        posted there already in that generation. A field that does not fit is posted as None:
        its readers do without it."""
        with self._lock:
            if generation < self._message.get("g", generation):
                return  # a late word on a generation that is over: nobody reads it now
            if (self._message.get("g"), self._message.get("rank")) != (generation, rank):
                self._message = {"g": generation, "rank": rank}
            self._message.update(fields)
            if not self.board.post(self._message):
                self._message.update(dict.fromkeys(fields))
                if not self.board.post(self._message):  # the rest does not fit either
                    self._message = {"g": generation, "rank": rank, **dict.fromkeys(fields)}
                    self.board.post(self._message)

    def _messages(self, generation: int) -> dict[int, tuple[int, dict[str, Any]]]:
        """rank → (its slot, its message): the siblings' mailboxes of ``generation``."""
        found = {}
        for slot in range(self.board.slots):
            message = self.board.read(slot)
            if message is not None and message.get("g") == generation:
                found[message["rank"]] = (slot, message)
        return found

    def _look(self, until: Callable[[dict[int, tuple[int, dict[str, Any]]]], Any],
              generation: int, timeout_s: float, speaker: int | None = None) -> Any:
        """``until(messages)`` once it is not None, looked at with pauses that double; None
        after ``timeout_s``, or once ``speaker`` is no help: its pulse on the board stood still
        for RELAY_SILENT_S; it posted nothing in this generation for as long (it never came, or
        it is on no board of this node's: one node's ranks under two agents of one pid, say);
        it posts for a later generation already (it went on: what it read is in the store)."""
        deadline = time.monotonic() + timeout_s
        pause, slot, count, since = FIRST_LOOK_S, None, None, time.monotonic()
        while True:
            messages = self._messages(generation)
            found = until(messages)
            now = time.monotonic()
            if found is not None or now >= deadline:
                return found
            if speaker is not None and speaker in messages:
                slot = messages[speaker][0]
            elif slot is not None:
                now_there = self.board.read(slot)
                if now_there is not None and now_there.get("g") != generation:
                    return None
            if slot is not None:
                pulse = self.board.counts()[slot]
                if pulse != count:
                    count, since = pulse, now
            if speaker is not None and now - since >= RELAY_SILENT_S:
                return None
            time.sleep(min(pause, max(0.0, deadline - now)))
            pause = min(2 * pause, MOST_LOOK_S)

    def fault(self, generation: int, rank: int, first: bool, read: Callable[[], bytes]) -> str:
        """The generation's fault, as a woken rank learns it: ``read()`` from the store by the
        node's ``first`` rank (posted for the others), taken from the board by the others."""
        if not first:
            posted = self._look(lambda messages: next(
                (m["fault"] for _, m in messages.values() if m.get("fault")), None),
                generation, FAULT_WAIT_S)
            if posted is not None:
                return posted
        value = read().decode()
        self.post(generation, rank, fault=value)
        return value

    def check_in(self, store: dist.Store, prefix: str, env: DistEnv, generation: int,
                 position: str, expected: set[int]) -> None:
        """This rank checked in (``agreement.check_in``): by its node's relay, or by itself."""
        alone = self.alone(generation, expected)
        relay = relay_of(env, expected, alone)
        if relay is None:
            check_in_all(store, prefix, {env.rank: position})
            return
        self.post(generation, env.rank, position=position)
        if env.rank == relay:
            mine = [r for r in node_ranks(env) if r in expected and r not in alone]

            def posted(messages: dict[int, tuple[int, dict[str, Any]]]) -> dict[int, str]:
                return {r: messages[r][1]["position"] for r in mine
                        if r in messages and messages[r][1].get("position")}

            # Every sibling's, or those posted by GATHER_S.
            positions = self._look(lambda messages: p if len(p := posted(messages)) == len(mine)
                                   else None, generation, GATHER_S) \
                or posted(self._messages(generation))
            positions[env.rank] = position
            check_in_all(store, prefix, positions)
            self.post(generation, env.rank, checked_in=encode_ranks(list(positions)))
            return
        listed = self._look(lambda messages: _field(messages, relay, "checked_in"), generation,
                            GATHER_S + CONFIRM_S, speaker=relay)
        if listed is None or listed[0] is None or env.rank not in decode_ranks(listed[0]):
            check_in_all(store, prefix, {env.rank: position})

    def record(self, env: DistEnv, generation: int, expected: set[int], limit_s: float,
               close: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The membership's record (``close()``: ``agreement.close_membership``, this rank's
        own way): read by its node's relay and posted, taken from the board by its siblings."""
        relay = relay_of(env, expected, self.alone(generation, expected))
        if relay is None:
            return close()
        if env.rank == relay:
            try:
                record = close()
            except Exception:
                self.post(generation, env.rank, record=None)  # its siblings read it themselves
                raise
            self.post(generation, env.rank, record=encoded_record(record))
            return record
        # As long as a rank that waits for the watchers would before the backups close it
        # (close_membership): by then it is closed, with this rank or without it (its relay
        # never came to it, say), and in the store.
        posted = self._look(lambda messages: _field(messages, relay, "record"), generation,
                            limit_s + 1, speaker=relay)
        if posted is not None and posted[0] is not None:
            return decoded_record(posted[0])
        return close()  # the relay could not, or fell silent


def _field(messages: dict[int, tuple[int, dict[str, Any]]], rank: int, name: str
           ) -> tuple[Any] | None:
    """``(value,)`` once ``rank`` posted ``name`` (its value None where it could not)."""
    message = messages.get(rank, (0, {}))[1]
    return (message[name],) if name in message else None
