"""The workers of one node side by side: each raises its pulse in a small file they share, and
one of them, the *speaker*, says all of theirs in the coordination store at once.

A pulse per process in the store is ten operations a second per rank (``PULSE_S``): at 1,000
nodes of 8, 80,000 a second, most of what one store's event loop answers (``make scale``). On
the board a pulse is a write to shared memory; the store sees one record per node, a ``set`` of
every slot's count (``"17,16,18,0"``) every ``PULSE_S``, and readers (:class:`Pulses`) take
each rank's count from its node's record: a rank frozen or wedged still stands out, since its
own slot stops moving while its siblings' move on.

The speaker is the lowest slot whose pulse moved within ``SPEAKER_SILENT`` of the process's own
pulses, as each process sees the board: when it freezes, the next one speaks within about half
a second (a rank is judged silent only after 1.5 s); two that speak at once for a moment write
the same counts. The file is the node's for one launch (its agent's pid and the launch's nonce
name it), one slot per worker that agent started (``LOCAL_RANK`` at start: a slot stays its
worker's whatever local rank a change gives it later). A node nonce, drawn by the first worker
to make the file, names the record: two containers of one host name whose agents are both pid 1
keep records of their own.

Each slot also has a *mailbox*, written by its worker alone and read by its siblings: what one
worker learns from the store in a change (the fault, the membership's record), or hands to the
one that speaks for the node there (where it stood), goes through it (relay.py).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import secrets
import struct
import tempfile
from pathlib import Path

from elastic_mnist.resilience.lease_record import running

SPEAKER_SILENT = 5
"""A slot whose pulse stood still while this process's own moved this many times no longer
speaks for the node (about 0.5 s): the next live one does."""
NONCE_BYTES = 16
COUNT = struct.Struct("<Q")
MAILBOX_BYTES = 16384
"""A slot's mailbox: a sequence number, a length, and that many bytes of JSON."""
MAILBOX_HEAD = struct.Struct("<QI")


def record_key(node: str) -> str:
    """Where the speaker of ``node`` (a board's :attr:`NodeBoard.node`) writes its record."""
    return f"node/{node}"


def parse(record: bytes | str) -> list[int]:
    """The slots' counts in a node's record (a record of one count is a slot 0's, as an ``add``
    on the key writes it)."""
    text = record.decode() if isinstance(record, bytes) else record
    return [int(count) for count in text.split(",")] if text else []


class NodeBoard:
    """One process's view of its node's board: its own slot to raise, everyone's to read."""

    def __init__(self, folder: Path, name: str, slots: int, slot: int):
        """``name``: the file's, the same for every worker of the node (its host, its agent's
        pid, the launch's nonce); ``slots``: how many workers the agent started; ``slot``:
        this one's ``LOCAL_RANK`` at start."""
        if not 0 <= slot < slots:
            raise ValueError(f"slot {slot} of {slots}")
        self.slot, self.slots = slot, slots
        self.path = Path(folder) / name
        self._mailboxes = NONCE_BYTES + COUNT.size * slots
        size = self._mailboxes + MAILBOX_BYTES * slots
        for tries in range(2):  # another agent's cleanup may take it between the two
            self._create(size)
            try:
                with open(self.path, "r+b") as f:
                    self._map = mmap.mmap(f.fileno(), size)
                break
            except FileNotFoundError:
                if tries:
                    raise
        self.node = f"{name}/{self._map[:NONCE_BYTES].decode()}"
        """The node's name in the store: the file's, and the nonce of the first to make it."""
        self.key = record_key(self.node)
        self._seen: dict[int, tuple[int, int]] = {}
        """slot → (its count, this process's own when it last moved)."""

    def _create(self, size: int) -> None:
        """Makes the file whole, if no sibling has: written aside, then linked into place
        (a link never replaces a file), so nobody ever opens it half written."""
        if self.path.exists():
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, aside = tempfile.mkstemp(dir=self.path.parent, prefix=".board-")
        try:
            os.write(fd, secrets.token_hex(NONCE_BYTES // 2).encode() + bytes(size - NONCE_BYTES))
            os.close(fd)
            with contextlib.suppress(FileExistsError):
                os.link(aside, self.path)
        finally:
            os.unlink(aside)

    def counts(self) -> list[int]:
        return [COUNT.unpack_from(self._map, NONCE_BYTES + COUNT.size * s)[0]
                for s in range(self.slots)]

    def raise_pulse(self) -> int:
        """This process's pulse, one higher: its count now."""
        at = NONCE_BYTES + COUNT.size * self.slot
        mine = COUNT.unpack_from(self._map, at)[0] + 1
        COUNT.pack_into(self._map, at, mine)
        return mine

    def beat(self) -> str | None:
        """Raises this process's pulse; the node's record if this process speaks for the node
        (the lowest slot whose pulse moves), else None."""
        mine = self.raise_pulse()
        counts = self.counts()
        for s, count in enumerate(counts):
            if self._seen.get(s, (None,))[0] != count:
                self._seen[s] = (count, mine)
        live = [s for s, (_, since) in self._seen.items() if mine - since < SPEAKER_SILENT]
        return self.record(counts) if min(live) == self.slot else None

    @staticmethod
    def record(counts: list[int]) -> str:
        return ",".join(map(str, counts))

    def post(self, message: dict) -> bool:
        """``message`` in this process's mailbox, in place of the last one; False (nothing
        written) where it does not fit. Written between two raises of the mailbox's sequence
        number, odd while it is written: a reader never takes half of it (:meth:`read`)."""
        body = json.dumps(message, separators=(",", ":")).encode()
        if MAILBOX_HEAD.size + len(body) > MAILBOX_BYTES:
            return False
        at = self._mailboxes + MAILBOX_BYTES * self.slot
        try:
            # Odd from the stored number whatever its parity: a writer killed half way (its
            # slot's next worker, restarted into the job, finds its odd number) inverts nothing.
            writing = MAILBOX_HEAD.unpack_from(self._map, at)[0] | 1
            COUNT.pack_into(self._map, at, writing)
            self._map[at + MAILBOX_HEAD.size:at + MAILBOX_HEAD.size + len(body)] = body
            MAILBOX_HEAD.pack_into(self._map, at, writing + 1, len(body))
        except ValueError:  # unmapped: the board was closed (the process ends)
            return False
        return True

    def read(self, slot: int) -> dict | None:
        """The message in ``slot``'s mailbox (None: none yet, one being written, or the board
        closed)."""
        at = self._mailboxes + MAILBOX_BYTES * slot
        try:
            seq, length = MAILBOX_HEAD.unpack_from(self._map, at)
            if seq % 2 or not 0 < length <= MAILBOX_BYTES - MAILBOX_HEAD.size:
                return None
            body = bytes(self._map[at + MAILBOX_HEAD.size:at + MAILBOX_HEAD.size + length])
            if MAILBOX_HEAD.unpack_from(self._map, at) != (seq, length):
                return None  # rewritten as it was read
            message = json.loads(body)
        except ValueError:  # not JSON (torn: a reader the writes reach out of order), or closed
            return None
        return message if isinstance(message, dict) else None

    def close(self) -> None:
        """Unmaps the board, and removes its file (siblings keep their own mapping of it)."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        with contextlib.suppress(BufferError, ValueError):
            self._map.close()


def board_for(host: str, agent: int, launch: str, slots: int, slot: int) -> NodeBoard:
    """The board of the node whose agent is ``agent`` (a pid on ``host``), for ``launch``.
    Boards nobody uses any more are removed: the agent's earlier launches' (its workers
    restarted), and those of agents of this host that have exited (a job's workers leave
    theirs as they end); a process still holding one keeps its own mapping."""
    folder = Path(tempfile.gettempdir()) / f"elastic-mnist-{os.getuid()}"
    name = f"{host}+{agent}+{launch or 'launch'}"  # no host name holds a "+"
    if folder.is_dir():
        for earlier in folder.glob(f"{host}+*+*"):
            owner = earlier.name.split("+")[1]
            if not owner.isdigit() or earlier.name == name:
                continue
            if owner == str(agent) or not running(int(owner)):
                with contextlib.suppress(FileNotFoundError):
                    earlier.unlink()
    return NodeBoard(folder, name, slots, slot)
