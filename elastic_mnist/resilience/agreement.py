"""The records the survivors of a fault agree on, and the helpers that agree on them.

Identity, Position, Fault, Change; whose pulse stopped (Pulses), who closes the membership
(close_membership), each survivor's place (successor_env). Pure records and store reads."""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import datetime
import functools
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from elastic_mnist.env import DistEnv
from elastic_mnist.resilience.board import parse, record_key

PULSE_S = 0.1
"""How often each process raises its pulse in the coordination store."""
SILENT_PULSES = 15
"""A process whose pulse stood still while the reader's own moved this many times is gone or
frozen (about 1.5 s). Above the second that a live rank's pulse thread can wait for the CPU
(4 × 8 on 2 cores: over 0.6 s seen; a live rank judged dead costs a restart); below the 2 s
that a node lost inside a recovery may add to it."""
LOOK_S, AWAY_S = 0.005, 2.0
"""How often a watcher of a change looks whether the survivors have checked in; a look that
took longer than AWAY_S (the store away: store_wait.py) counts no longer against the limit."""
WHY = ("died", "left", "hung", "evicted")
"""Why ranks went: their connections closed; they asked to stop; they stopped making progress;
they were let go as too slow (eviction.py)."""


def generation_key(generation: int, name: str) -> str:
    """``name`` in ``generation``'s own prefix of the coordination store."""
    return f"g{generation}/{name}"


@dataclass(frozen=True)
class Identity:
    """A worker as its peers find it: where it runs, and which torchrun agent started it."""

    host: str
    pid: int
    agent: int
    """The agent's pid: workers of one node share it."""
    local_rank: int
    agent_addr: str = ""
    """The agent's name in the rendezvous, as its state names the participant of the agent's
    pid (``--local_addr``, else the agent's own resolver's name for its host); empty without a
    multi-node rendezvous."""
    nonce: str = ""
    """Drawn at random by the process as it starts: processes of one host name and pid
    (containers, each its node's pid 1, on hosts of one name) are told apart by it."""
    serial: int | None = None
    """The agent's serial in our rendezvous (``ELASTIC_MNIST_AGENT``); None under torch's c10d
    one, which numbers no agents."""
    board: str = ""
    """Its node's board (board.py), whose record in the store holds this process's pulse, in
    the slot of its ``local_rank``."""

    @property
    def node(self) -> tuple[str, int]:
        """The agent that started this process: workers of one node share it."""
        return self.host, self.agent

    @property
    def key(self) -> str:
        """This process's own name in the coordination store, unlike any other's."""
        return f"{self.host}/{self.pid}/{self.nonce}"


UNKNOWN = Identity("unknown", 0, 0, 0)
"""The identity of a rank lost before it said who it was."""


NO_STATE = -1
"""A :class:`Position`'s step for a process that holds none of the job's state yet."""


@dataclass(frozen=True)
class Position:
    """Where a rank stood when the fault struck."""

    step: int
    """Its last committed step; NO_STATE for a process of a node that joined and has not yet
    taken the job's state (it holds nothing any step committed)."""
    mid_step: bool
    """It had begun the next one: that work is lost."""
    evaluated_step: int
    """The last step whose evaluation it completed."""


@dataclass(frozen=True)
class Fault:
    """The declaration every rank of a generation recovers from: the first one made."""

    why: str
    suspects: list[int]
    """Ranks known to be gone: the ones that left, or that the watchdog found hung."""
    reported_by: int
    detail: str
    time: float


@dataclass(frozen=True)
class Change:
    """What a recovery returns to the trainer: the new world and how it came to be."""

    env: DistEnv
    generation: int
    old_world_size: int
    lost: list[dict[str, Any]]
    """``{"rank", "host", "why"}`` for each rank of the old generation that is not in the new."""
    why: str
    step: int
    """The agreed step: the newest one a survivor committed."""
    holder: int
    """The new rank whose state every survivor takes: the first one at the agreed step."""
    steps_redone: int
    """1 when a survivor had begun the step after the agreed one, whose work is lost; else 0."""
    evaluated_step: int
    """The last step whose evaluation the new rank 0 completed (and logged)."""
    detected: float
    """``time.monotonic()`` when this rank learned of the fault."""
    detected_at: float
    """``time.time()`` then."""
    kind: str = "shrink"
    """``shrink``: ranks were lost; ``grow``: joining nodes were admitted at a step boundary."""
    joined: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """``{"rank", "host", "agent"}`` for each rank a grow admitted (its rank in the new world,
    its agent's serial)."""


def read_present(store: dist.Store, keys: list[str],
                 call: Callable[..., Any] = lambda method, *args: method(*args)
                 ) -> dict[str, bytes]:
    """The values of those of ``keys`` that ``store`` holds: two operations where it holds them
    all (the usual case: one ``check`` of every key, one ``multi_get``), else a ``check`` per key
    first (a ``multi_get`` of a missing key waits for it). Each operation is made as
    ``call(method, *args)`` (the watchdog's bounds each)."""
    if not keys:
        return {}
    present = keys if call(store.check, keys) else [key for key in keys
                                                    if call(store.check, [key])]
    return dict(zip(present, call(store.multi_get, present), strict=True)) if present else {}


def watchers(ranks: set[int] | list[int]) -> list[int]:
    """The ranks, of ``ranks``, that watch over a change for all: the first, the middle one and
    the last, on three nodes wherever the job has three of one size (ranks are numbered node by
    node), so that a node lost meanwhile never takes them all. They read the check-ins and the
    pulses and close the membership (:func:`close_membership`), and watch the new group's creation
    (recovery.py); every other survivor waits for what they write: a pulse read by every
    survivor was W² values, and each survivor's poll of the check-ins hundreds of operations a
    second times W."""
    ordered = sorted(ranks)
    return sorted({ordered[0], ordered[len(ordered) // 2], ordered[-1]}) if ordered else []


def backup_watchers(ranks: set[int] | list[int]) -> list[int]:
    """The ranks, of ``ranks``, that close a change's membership where none of the
    :func:`watchers` has (all three lost meanwhile): at a quarter, three eighths and three
    quarters of the ranks, on other nodes than the watchers wherever the job has five of one
    size (the watchers' neighbours share their nodes, and fall with them)."""
    ordered, first = sorted(ranks), set(watchers(ranks))
    n = len(ordered)
    return sorted({ordered[n // 4], ordered[3 * n // 8], ordered[3 * n // 4]} - first) if n else []


def encode_ranks(ranks: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` as ``"0-2,5,7-8"``: a membership of thousands of ranks, read by
    each of them, is its few gaps long, not its ranks."""
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def decode_ranks(text: str) -> list[int]:
    ranks: list[int] = []
    for run in filter(None, text.split(",")):
        a, _, b = run.partition("-")
        ranks.extend(range(int(a), int(b or a) + 1))
    return ranks


WOKEN_WAIT = datetime.timedelta(seconds=5)
"""How long a rank that declares a fault after another waits for the first to have woken every
rank, before it wakes them itself: the first was lost in the moment between its two writes, or
it is starved of CPU (half a second was not enough for 8,000 simulated ranks on 2 cores, and
every rank then woke every rank: W² keys)."""


def declare_fault(store: dist.Store, prefix: str, world_size: int, fault: str) -> str:
    """``fault`` (a :class:`Fault`'s JSON), declared in the generation of ``prefix``: the
    generation's one fault, the first declared, is returned. The first to declare wakes every
    rank (``{prefix}wake/<rank>``, which each rank's watcher waits on), then says so. A later
    declarer (one of the generation's :func:`watchers`, or a rank that found the fault itself,
    before it was woken: a woken rank declares nothing, see ``Membership.declare``) waits for
    that, instead of writing every rank's wake key again (W² keys), and wakes them itself only
    where the first was lost between its writes."""
    agreed = store.compare_set(f"{prefix}fault", "", fault).decode()
    woken = f"{prefix}woken"
    if agreed != fault:
        # Looked at, not waited on: the connection is the declarer's, which the pulse's
        # speaker shares, and a wait would hold it (a node's record standing still for seconds
        # makes its ranks look lost).
        if looked_for(store, [woken], WOKEN_WAIT.total_seconds(), pause_s=0.005, most_s=0.5):
            return agreed
        # Not woken: the first was lost between its writes. One rank wakes them in its place.
        if store.compare_set(f"{prefix}rewaker", "", fault).decode() != fault:
            return agreed
    wake = [f"{prefix}wake/{rank}" for rank in range(world_size)]
    store.multi_set(wake, ["fault"] * len(wake))
    store.set(woken, "1")
    return agreed


def looked_for(store: dist.Store, keys: list[str], timeout_s: float, pause_s: float,
               most_s: float, moot: Callable[[], bool] = lambda: False) -> bool:
    """Whether ``store`` holds every one of ``keys`` within ``timeout_s``: looked at (a
    ``check``), the pause between two looks doubling from ``pause_s`` to ``most_s``, not waited
    on (a wait holds its connection, which others of the process may share). False too once
    ``moot()``, asked before each look: a membership closed, its store may be gone."""
    deadline = time.monotonic() + timeout_s
    while not moot():
        if store.check(keys):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause_s)
        pause_s = min(2 * pause_s, most_s)
    return False


def check_in(store: dist.Store, prefix: str, rank: int, position: str) -> None:
    """A survivor checks in: its place in the order of arrivals, and there, its rank and where
    it stood (``{prefix}arrived/<n>``: ``"<rank> <position>"``), which the watchers read as the
    arrivals grow, each once. Two operations."""
    check_in_all(store, prefix, {rank: position})


def check_in_all(store: dist.Store, prefix: str, positions: Mapping[int, str]) -> None:
    """Survivors check in together (a node's, by its relay: relay.py), as one arrival of a line
    each (:func:`check_in`): two operations for all of them."""
    n = store.add(f"{prefix}arrivals", 1)
    store.set(f"{prefix}arrived/{n - 1}",
              "\n".join(f"{rank} {position}" for rank, position in sorted(positions.items())))


def close_membership(store: dist.Store, prefix: str, expected: set[int], excluded: list[int],
                     pulses: Pulses, limit_s: float, rank: int | None = None,
                     decide: Callable[[list[int], dict[int, str]], dict[str, Any]] | None = None
                     ) -> dict[str, Any]:
    """What the survivors agree on, as the first watcher to close the membership decided it:
    ``decide(members, positions)`` (by default ``{}``; ``positions``: where each member stood,
    as it checked in) with ``members``, every rank that checked in
    (:func:`check_in`) once all ``expected`` have, but for those whose pulse stopped, or once
    ``limit_s`` has passed; never one of ``excluded``. The record's ``members`` are the ones
    ``decide`` returns, if any, else those.

    The :func:`watchers` of ``expected`` (every caller where ``rank`` is None) look at the
    check-ins; each reads each arrival once (an entry not written yet, its writer lost between
    its count and its name, say, is looked for again at the next look). Every other survivor
    waits for the record, then reads it: two operations. If no watcher has written it a second
    past ``limit_s`` (all three lost), the :func:`backup_watchers` close it, and the rest wait
    as long again (every survivor closing it itself was W² reads, the store at its busiest)."""
    key = f"{prefix}members"
    start = next_read = time.monotonic()
    first = watchers(expected)
    if rank is not None and rank not in first:
        # A second more than the watchers: one that came to the agreement later than this
        # rank still closes it first.
        limit_s += 1
        closed = False
        with contextlib.suppress(RuntimeError):  # DistStoreError: not closed within the limit
            store.wait([key], datetime.timedelta(seconds=limit_s))
            closed = True
        if not closed and rank not in backup_watchers(expected):
            store.wait([key], datetime.timedelta(seconds=limit_s))  # DistStoreError: nobody
            closed = True
        if closed:  # two operations in all, the record's read the second
            return _members_record(store.get(key))
    seen, unread, silent, last = 0, set(), set(), time.monotonic()
    arrived: dict[int, str] = {}
    while not store.check([key]):
        arrivals = store.add(f"{prefix}arrivals", 0)
        unread.update(range(seen, arrivals))
        seen = max(seen, arrivals)
        entries = {f"{prefix}arrived/{n}": n for n in sorted(unread)}
        found = read_present(store, list(entries))
        for value in found.values():
            for line in value.decode().splitlines():  # a node's survivors, by its relay
                r, _, position = line.partition(" ")
                arrived[int(r)] = position
        unread -= {entries[entry] for entry in found}
        present = arrived.keys() & expected
        now = time.monotonic()
        start, last = start + (now - last if now - last > AWAY_S else 0.0), now  # store away
        if now >= next_read:
            silent, next_read = pulses.silent(), now + PULSE_S
        if present >= expected - silent or now - start >= limit_s:
            members = sorted(present)
            record = {"members": members,
                      **(decide(members, {r: arrived[r] for r in members}) if decide else {})}
            store.compare_set(key, "", json.dumps(encoded_record(record)))
            break
        time.sleep(LOOK_S)
    return _members_record(store.get(key))


def _members_record(value: bytes) -> dict[str, Any]:
    return decoded_record(json.loads(value))


def encoded_record(record: dict[str, Any]) -> dict[str, Any]:
    """A membership's record as it is written (its members as runs: :func:`encode_ranks`)."""
    return {**record, "members": encode_ranks(record["members"])}


def decoded_record(record: dict[str, Any]) -> dict[str, Any]:
    """A membership's record as written (:func:`encoded_record`), its members a list again."""
    return {**record, "members": decode_ranks(record["members"])}


PulseKey = tuple[str, int]
"""Where a process's pulse is read: its node's record in the store, and its slot there."""


class Pulses:
    """Who is still there, by the pulses in the coordination store: a process is silent when its
    pulse stood still while the reader's own moved SILENT_PULSES times. Measured by the reader's
    own pulse, not its clock: a store that stalls, or a reader starved of CPU, holds back both.
    One ``multi_get`` a read. The reader's own jumping (the store back) hears every rank afresh."""

    def __init__(self, store: dist.Store,
                 keys: Mapping[int, PulseKey | None] | Callable[[], Mapping[int, PulseKey | None]],
                 own: PulseKey):
        """``keys``: each rank's (None for a rank that never said who it was), or what reads
        them, called at the first read (a survivor that only waits for the watchers' record
        never reads them)."""
        self.store, self.own = store, own
        self._keys = keys
        self.seen: dict[int, tuple[int, int]] = {}
        """rank → (its pulse, the reader's own when it last moved)."""
        self.mine = -1

    @functools.cached_property
    def keys(self) -> Mapping[int, PulseKey | None]:
        return self._keys() if callable(self._keys) else self._keys

    def silent(self) -> set[int]:
        records = list(dict.fromkeys([self.own[0]] + [key[0] for key in self.keys.values()
                                                       if key is not None]))
        counts = dict(zip(records, map(parse, self.store.multi_get(records)), strict=True))

        def pulse(key: PulseKey | None) -> int:
            slots = counts[key[0]] if key is not None else []
            return slots[key[1]] if key is not None and key[1] < len(slots) else -1

        mine, theirs = pulse(self.own), {rank: pulse(key) for rank, key in self.keys.items()}
        if self.seen and mine - self.mine > 2 * SILENT_PULSES:  # the store away: heard afresh
            self.seen = {rank: (seen, mine) for rank, (seen, _) in self.seen.items()}
        self.mine = mine
        for rank in self.keys:
            # Moved: higher than ever seen (a speaker woken from a freeze may write its old
            # counts once more: a step back is no sign of life).
            pulse = theirs.get(rank, -1)
            if rank not in self.seen or pulse > self.seen[rank][0]:
                self.seen[rank] = (pulse, mine)
        return {rank for rank, (_, since) in self.seen.items() if mine - since >= SILENT_PULSES}


def pulse_key(identity: Identity) -> PulseKey | None:
    """Where the pulse of the process of ``identity`` is read (None: it never said who it
    was)."""
    return (None if identity == UNKNOWN or not identity.board
            else (record_key(identity.board), identity.local_rank))


def successor_env(env: DistEnv, members: list[int], identities: Mapping[int, Identity]
                  ) -> DistEnv:
    """This rank's place among the survivors: ranks in the order of the old ones, local ranks
    among the survivors started by the same agent, node ranks in the order nodes first appear."""
    node = identities[env.rank].node
    siblings = [r for r in members if identities[r].node == node]
    nodes = list(dict.fromkeys(identities[r].node for r in members))
    rdzv = env.rendezvous  # a joiner's admission is behind it
    return dataclasses.replace(env, rank=members.index(env.rank), world_size=len(members),
                               local_rank=siblings.index(env.rank),
                               local_world_size=len(siblings), group_rank=nodes.index(node),
                               group_world_size=len(nodes),
                               rendezvous=rdzv and dataclasses.replace(rdzv, join=None))


def node_sizes(members: list[int], identities: Mapping[int, Identity]) -> list[list[int]] | None:
    """How many of ``members`` each node keeps, in the members' order, as runs of ``[size,
    nodes]`` (``[[8, 999], [7, 1]]``): what each survivor needs to find its place
    (:func:`placed_env`), a few values where every survivor reading every identity was W² of
    them. None where one node's members are not numbered together (torchrun numbers ranks node
    by node, and every change keeps their order: never, unless that changes), or where a
    member's identity is unknown."""
    runs: list[list[int]] = []
    sizes: list[int] = []
    seen: set[tuple[str, int]] = set()
    node = None
    for rank in members:
        if identities[rank] == UNKNOWN:  # where it runs is not known: nor are its siblings
            return None
        if identities[rank].node != node:
            node = identities[rank].node
            if node in seen:
                return None
            seen.add(node)
            sizes.append(0)
        sizes[-1] += 1
    for size in sizes:
        if runs and runs[-1][0] == size:
            runs[-1][1] += 1
        else:
            runs.append([size, 1])
    return runs


def placed_env(env: DistEnv, members: list[int], sizes: list[list[int]]) -> DistEnv:
    """This rank's place among the survivors, as :func:`successor_env` finds it, from the
    nodes' ``sizes`` (:func:`node_sizes`) alone: no survivor reads another's identity."""
    rank, start, group = bisect.bisect_left(members, env.rank), 0, 0
    if rank == len(members) or members[rank] != env.rank:
        raise ValueError(f"rank {env.rank} is not one of the members")
    for size, count in sizes:
        if rank < start + size * count:
            group += (rank - start) // size
            local_rank, local_world_size = (rank - start) % size, size
            break
        start, group = start + size * count, group + count
    else:
        raise ValueError(f"the nodes' sizes {sizes} hold fewer than {len(members)} ranks")
    rdzv = env.rendezvous  # a joiner's admission is behind it
    return dataclasses.replace(env, rank=rank, world_size=len(members), local_rank=local_rank,
                               local_world_size=local_world_size, group_rank=group,
                               group_world_size=sum(count for _, count in sizes),
                               rendezvous=rdzv and dataclasses.replace(rdzv, join=None))


def whole_nodes(members: list[int], identities: Mapping[int, Identity], fault: Fault,
                world_size: int) -> list[int]:
    """``members`` without the siblings of a rank that died: a node whose worker died has its
    agent restart all of its workers (torchrun's way), so the survivors go on without every rank
    of that node instead of waiting for the others to be stopped in a second round. Ranks that
    left or hung (named in a fault of that kind) take nobody with them."""
    named = set(fault.suspects) if fault.why != "died" else set()
    kept = set(members)  # a set: ``in`` a list of thousands of members, W times, was W²
    dead = {identities[r].node for r in range(world_size)
            if r not in kept and r not in named and identities[r] != UNKNOWN}
    return [r for r in members if identities[r].node not in dead]


def decide_membership(present: list[int], checked_in: dict[int, str],
                      identities: Mapping[int, Identity], fault: Fault,
                      world_size: int) -> dict[str, Any]:
    """What the watcher that closes the membership decides for all, from the ``present`` ranks'
    check-ins (``checked_in``: each one's :class:`Position` as JSON, read once, not by every
    survivor): whole nodes (:func:`whole_nodes`), the agreed step and who holds it; and what
    every survivor needs of the identities: the nodes' sizes, the lost ranks' hosts, the nodes
    no rank is left of."""
    members = whole_nodes(present, identities, fault, world_size)
    positions = [Position(**json.loads(checked_in[r])) for r in members]
    step = max((p.step for p in positions), default=NO_STATE)
    kept, left = {identities[r].node for r in members}, set(members)
    return {"members": members, "step": step,
            "holder": next((i for i, p in enumerate(positions) if p.step == step), 0),
            "steps_redone": int(any(p.mid_step and p.step == step for p in positions)),
            "evaluated_step": positions[0].evaluated_step if positions else 0,
            "nodes": node_sizes(members, identities),
            "lost": [[r, identities[r].host] for r in range(world_size) if r not in left],
            "gone": sorted({identities[r].node for r in range(world_size)
                            if identities[r] != UNKNOWN} - kept)}


def grown(env: DistEnv, joiners: list[Identity], old_world_size: int, generation: int,
          step: int, evaluated_step: int, detected: float, detected_at: float) -> Change:
    """The change of a grow, as a process placed at ``env`` in the new world takes it: the first
    ``old_world_size`` ranks the job's (in their order; its rank 0 holds the state the joiners
    take), then the ``joiners``, node by node."""
    joined = [{"rank": old_world_size + i, "host": joiner.host, "agent": joiner.serial}
              for i, joiner in enumerate(joiners)]
    return Change(env=env, generation=generation, old_world_size=old_world_size, lost=[],
                  why="joined", step=step, holder=0, steps_redone=0,
                  evaluated_step=evaluated_step, detected=detected, detected_at=detected_at,
                  kind="grow", joined=joined)
