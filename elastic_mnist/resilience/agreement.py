"""The records the survivors of a fault agree on, and the helpers that agree on them.

Who a worker is (:class:`Identity`), where it stood when the fault struck (:class:`Position`),
the generation's one fault (:class:`Fault`) and what a recovery hands the trainer
(:class:`Change`); whose pulse stopped (:class:`Pulses`), who closes the membership
(:func:`close_membership`) and each survivor's place in the new world (:func:`successor_env`).
Pure records and store reads: no thread, no process group (membership.py and recovery.py use them).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from elastic_mnist.env import DistEnv

PULSE_S = 0.1
"""How often each process raises its pulse in the coordination store."""
SILENT_PULSES = 15
"""A process whose pulse stood still while the reader's own moved this many times is gone or
frozen (about 1.5 s). Above the second that a live rank's pulse thread can wait for the CPU
where many ranks share few cores (4 nodes × 8 workers on 2 cores: more than 0.6 s was seen,
and a live rank judged dead costs the job a restart); below the 2 s that a node lost inside a
recovery may add to it (it is named by this silence when nothing else fails first)."""
LOOK_S = 0.005
"""How often a survivor looks whether its peers have checked in, in a small job."""
LOOKS_PER_S = 20_000
"""In a large one, how often the survivors look, all together (two store operations each, and a
read of each arrival new to the looker): the coordination store answers about 120,000
operations a second (``make scale``), and every survivor of a 512-rank job looking every 5 ms
asked it for 200,000."""
PULSE_VALUES_PER_S = 1_000_000
"""How many pulses the survivors read a second, all together (each reads every rank's), in a
large job; in a small one each reads them every PULSE_S."""
READ_PULSES_MAX_S = 1.0
"""The longest a survivor goes between two reads of the pulses: a silence is seen within this
of SILENT_PULSES (a job of thousands of ranks reads more than the store serves even so: one
pulse per node is what scales)."""
WHY = ("died", "left", "hung")
"""Why ranks went: their connections closed; they asked to stop; they stopped making progress."""


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


def look_s(world_size: int) -> float:
    """How often each survivor of a ``world_size``-rank generation looks at the check-ins."""
    return max(LOOK_S, world_size / LOOKS_PER_S)


def read_pulses_s(world_size: int) -> float:
    """How often each survivor of a ``world_size``-rank generation reads every rank's pulse."""
    return min(READ_PULSES_MAX_S, max(PULSE_S, world_size ** 2 / PULSE_VALUES_PER_S))


def check_in(store: dist.Store, prefix: str, rank: int, position: str) -> None:
    """A survivor checks in: where it stood (``{prefix}in/<rank>``), then its place in the order
    of arrivals (``{prefix}arrived/<n>``), which the others read as it grows."""
    store.set(f"{prefix}in/{rank}", position)
    n = store.add(f"{prefix}arrivals", 1)
    store.set(f"{prefix}arrived/{n - 1}", str(rank))


def close_membership(store: dist.Store, prefix: str, expected: set[int], excluded: list[int],
                     pulses: Pulses, limit_s: float) -> list[int]:
    """The survivors, as the first rank to close the membership saw them: every rank that checked
    in (:func:`check_in`) once all ``expected`` have, but for those whose pulse stopped, or once
    ``limit_s`` has passed; never one of ``excluded``.

    Each look reads only the arrivals since the last (an entry not written yet, its writer lost
    between its count and its name, say, is looked for again at the next): a survivor reads each
    arrival once, not every rank's check-in at every arrival."""
    key = f"{prefix}members"
    world_size = len(expected | set(excluded))
    seen, unread, arrived, silent = 0, set(), set(), set()
    start = next_read = time.monotonic()
    while not store.check([key]):
        arrivals = store.add(f"{prefix}arrivals", 0)
        unread.update(range(seen, arrivals))
        seen = max(seen, arrivals)
        for n in sorted(unread):
            entry = f"{prefix}arrived/{n}"
            if store.check([entry]):
                arrived.add(int(store.get(entry)))
                unread.discard(n)
        present = arrived & expected
        now = time.monotonic()
        if now >= next_read:
            silent, next_read = pulses.silent(), now + read_pulses_s(world_size)
        if present >= expected - silent or now - start >= limit_s:
            store.compare_set(key, "", json.dumps(sorted(present)))
            break
        time.sleep(look_s(world_size))
    return json.loads(store.get(key))


class Pulses:
    """Who is still there, by the pulses in the coordination store: a process is silent when its
    pulse stood still while the reader's own moved SILENT_PULSES times. Measured by the reader's
    own pulse, not its clock: a store that stalls, or a reader starved of CPU, holds back both."""

    def __init__(self, store: dist.Store, keys: dict[int, str | None], own: str):
        """``keys``: each rank's pulse key (None for a rank that never said who it was)."""
        self.store, self.keys, self.own = store, keys, own
        self.seen: dict[int, tuple[int, int]] = {}
        """rank → (its pulse, the reader's own when it last moved)."""

    def silent(self) -> set[int]:
        known = [rank for rank, key in self.keys.items() if key is not None]
        values = [int(v) for v in self.store.multi_get([self.own]
                                                        + [self.keys[r] for r in known])]
        mine, theirs = values[0], dict(zip(known, values[1:]))
        for rank in self.keys:
            pulse = theirs.get(rank, -1)
            if self.seen.get(rank, (None,))[0] != pulse:
                self.seen[rank] = (pulse, mine)
        return {rank for rank, (_, since) in self.seen.items() if mine - since >= SILENT_PULSES}


def pulse_key(identity: Identity) -> str | None:
    """Where the process of ``identity`` raises its pulse (None: it never said who it was)."""
    return None if identity == UNKNOWN else f"pulse/{identity.key}"


def successor_env(env: DistEnv, members: list[int], identities: dict[int, Identity]) -> DistEnv:
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


def whole_nodes(members: list[int], identities: dict[int, Identity], fault: Fault,
                world_size: int) -> list[int]:
    """``members`` without the siblings of a rank that died: a node whose worker died has its
    agent restart all of its workers (torchrun's way), so the survivors go on without every rank
    of that node instead of waiting for the others to be stopped in a second round. Ranks that
    left or hung (named in a fault of that kind) take nobody with them."""
    named = set(fault.suspects) if fault.why != "died" else set()
    dead = {identities[r].node for r in range(world_size)
            if r not in members and r not in named and identities[r] != UNKNOWN}
    return [r for r in members if identities[r].node not in dead]


def grown(env: DistEnv, me: Identity, members: list[Identity], old_world_size: int,
          generation: int, step: int, evaluated_step: int, detected: float,
          detected_at: float) -> Change:
    """The change of a grow, as the process ``me`` (of ``env``) takes it: ``members`` in their
    new order (the old ranks first, in theirs; then the joiners, node by node), the first
    ``old_world_size`` of them the job's ranks, whose rank 0 holds the state the joiners take."""
    rank = [identity.key for identity in members].index(me.key)
    new_env = successor_env(dataclasses.replace(env, rank=rank), list(range(len(members))),
                            dict(enumerate(members)))
    joined = [{"rank": r, "host": members[r].host, "agent": members[r].serial}
              for r in range(old_world_size, len(members))]
    return Change(env=new_env, generation=generation, old_world_size=old_world_size, lost=[],
                  why="joined", step=step, holder=0, steps_redone=0,
                  evaluated_step=evaluated_step, detected=detected, detected_at=detected_at,
                  kind="grow", joined=joined)
