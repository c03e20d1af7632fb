"""The records that torchrun's agents (our rendezvous backend, agents.py) and the job's workers
(the membership) share in the rendezvous store: the one place that names their keys.

Every key lives under ``P = "elastic_mnist/<run_id>/rdzv/"`` on the raw store (no PrefixStore):

- ``P agents``: a counter; each agent process (an *incarnation*) takes its serial from it.
  ``P agent/<n>``: what it is (:class:`AgentRecord`). ``P alive/<n>``: its keep-alive counter,
  raised every ``keep_alive_interval`` while the agent process lives. ``P gone/<n>``: it shut down;
  ``P gone`` counts those that did, and ``P gone/at/<k>`` names them in order.
  ``P waiting/<n>``: ``1`` while it waits to enter a running job (else ``0``).
- ``P round``: the round agents meet in now (0 at first). A round's arrivals:
  ``P round/<r>/count`` and ``P round/<r>/arrived/<k>`` (serials, in arrival order); its members,
  once closed: ``P round/<r>/members`` (JSON list, group rank = index).
- ``P job``: the job as rank 0 publishes it (:class:`JobRecord`); ``P job/beat``: a counter rank 0
  raises while the job lives.
- ``P round/<r>/joins`` and ``P round/<r>/join/<j>``: agents that join the live job of round r
  (tickets, in order); ``P round/<r>/join/<j>/ready/<local_rank>``: its workers are ready;
  ``P round/<r>/join/<j>/admitted``: the launch and generation that admit it (rank 0's).
- ``P exit/<n>``: agent n arrived at the exit barrier (``P exit/<n>/passed``: and left it);
  ``P exitstore/<n>/...``: whatever torch's agent n keeps in its exit store;
  ``P closed``: the rendezvous is closed.

Liveness is judged by counters, not clocks (:class:`Watch`): a counter is still when it did not
move while the reader's own keep-alive moved ``max_attempt`` times. Hosts' clocks differ, and a
store that stalls, or a reader starved of CPU, holds back the reader's own count too.
Pure store code: no thread, no torch private name.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from elastic_mnist.resilience.agreement import read_present

KEEP_ALIVE_S = 5.0
"""``keep_alive_interval`` unless ``--rdzv_conf`` says otherwise (torch's c10d default)."""
KEEP_ALIVE_ATTEMPTS = 3
"""``keep_alive_max_attempt`` unless ``--rdzv_conf`` says otherwise (torch's c10d default)."""
LOOKED_AT_S = 16
"""Keep-alives an agent reads a second, at most, to keep its judgement of the others fresh while
its workers run (:func:`look_interval`)."""
START_UP_S = 120.0
"""How long an agent that came after its round closed waits for the round's job to be published
(its workers start: they import torch, read the data, form their group) before it moves every node
to the next round, as torch's c10d rendezvous would at once; not longer than ``join_timeout``."""

# The environment the agent exports to its workers (agents.py writes it, env.py reads it).
ENV_RDZV = "ELASTIC_MNIST_RDZV"
"""``host:port`` of the rendezvous store."""
ENV_RDZV_ID = "ELASTIC_MNIST_RDZV_ID"
"""The run id (``--rdzv_id``): ``P``'s ``<run_id>``."""
ENV_AGENT = "ELASTIC_MNIST_AGENT"
"""The serial of the workers' agent."""
ENV_ROUND = "ELASTIC_MNIST_ROUND"
"""The round the agent is in (a member's, or the one whose job it joins)."""
ENV_KEEP_ALIVE = "ELASTIC_MNIST_KEEP_ALIVE"
"""``<interval>,<max_attempt>``: the agents' keep-alive timing, for judging them."""
ENV_JOIN = "ELASTIC_MNIST_JOIN"
"""The join ticket ``j`` when the workers join the live job; absent otherwise."""


def keep_alive_env(interval_s: float, max_attempt: int) -> str:
    """``ELASTIC_MNIST_KEEP_ALIVE``'s value."""
    return f"{interval_s:g},{max_attempt}"


def parse_keep_alive(value: str) -> tuple[float, int]:
    """``(interval_s, max_attempt)`` from ``ELASTIC_MNIST_KEEP_ALIVE``; ValueError when malformed."""
    interval, _, attempts = value.partition(",")
    try:
        parsed = float(interval), int(attempts)
    except ValueError:
        raise ValueError(f"{ENV_KEEP_ALIVE}={value!r} is not <interval>,<max_attempt>") from None
    if parsed[0] <= 0 or parsed[1] < 1:
        raise ValueError(f"{ENV_KEEP_ALIVE}={value!r}: the interval must be > 0 and "
                         f"max_attempt >= 1")
    return parsed


@dataclass(frozen=True)
class AgentRecord:
    """An agent process as the others find it (``P agent/<n>``)."""

    host: str
    """Its host's name (``socket.gethostname()``)."""
    addr: str
    """``--local_addr``, else its host's fully qualified name."""
    pid: int
    nproc: int
    """Its local world size (``--nproc_per_node``): the same on every node of a job."""


@dataclass(frozen=True)
class JobRecord:
    """The job as rank 0's membership publishes it (``P job``), at start and at each change."""

    round: int
    """The rendezvous round its agents formed (``ELASTIC_MNIST_ROUND``)."""
    launch: str
    """A nonce of the launch: records of another launch on the same run id are told apart."""
    generation: int
    nodes: list[int]
    """The agent serials of the generation's ranks, in the order of their first rank."""
    world_size: int
    in_process: bool
    """Whether the job admits joining nodes in process (False: the restart path, as torch)."""
    run_id: str
    finished: bool
    quiet_s: float = 0.0
    """How long the job's beat may stand still while the job lives (its beat's period, and the
    bound of a recovery, during which a new rank 0 may not beat yet): an agent judges the job
    dead only once the beat stood still this long as well (:meth:`Watch.still_for`)."""


class Roster:
    """The shared records of rendezvous ``run_id`` in ``store`` (the raw store, no prefix)."""

    def __init__(self, store: dist.Store, run_id: str):
        self.store, self.run_id = store, run_id
        self.prefix = f"elastic_mnist/{run_id}/rdzv/"

    def key(self, name: str) -> str:
        return self.prefix + name

    def _get(self, name: str) -> str | None:
        """The value of ``P name``, None when absent (``get`` would wait for it)."""
        key = self.key(name)
        return self.store.get(key).decode() if self.store.check([key]) else None

    def _count(self, name: str) -> int:
        return self.store.add(self.key(name), 0)

    # --- agents ------------------------------------------------------------------------------

    def register(self, agent: AgentRecord) -> int:
        """A serial for a new agent process, with its record and its keep-alive counter."""
        serial = self.store.add(self.key("agents"), 1)
        self.store.set(self.key(f"agent/{serial}"), json.dumps(dataclasses.asdict(agent)))
        self.store.add(self.key(f"alive/{serial}"), 1)
        self.set_waiting(serial, False)
        self.store.compare_set(self.key("round"), "", "0")
        return serial

    def set_waiting(self, serial: int, waiting: bool) -> None:
        """Agent ``serial`` waits to enter a job that runs (it reads the store until it does, or
        until the job ends), or no longer does."""
        self.store.set(self.key(f"waiting/{serial}"), "1" if waiting else "0")

    def waiting_agents(self) -> list[int]:
        """The registered agents that wait to enter a job (:meth:`set_waiting`)."""
        serials = self.registered()
        keys = [self.key(f"waiting/{n}") for n in serials]
        if not keys:
            return []
        if not self.store.check(keys):  # an agent between its serial and its flag
            present = [(n, k) for n, k in zip(serials, keys, strict=True) if self.store.check([k])]
            serials, keys = [n for n, _ in present], [k for _, k in present]
        values = self.store.multi_get(keys) if keys else []
        return [n for n, v in zip(serials, values, strict=True) if v == b"1"]

    def registered(self) -> list[int]:
        """The serials of every agent that ever registered."""
        return list(range(1, self._count("agents") + 1))

    def agent(self, serial: int) -> AgentRecord | None:
        found = self._get(f"agent/{serial}")
        return None if found is None else AgentRecord(**json.loads(found))

    def keep_alive(self, serial: int) -> int:
        """One keep-alive of agent ``serial``; its counter now."""
        return self.store.add(self.key(f"alive/{serial}"), 1)

    def keep_alives(self, serials: list[int]) -> list[int]:
        """The keep-alive counters of registered agents ``serials``, in one read."""
        return [int(v) for v in self.store.multi_get([self.key(f"alive/{n}") for n in serials])]

    def leave(self, serial: int) -> None:
        """Agent ``serial`` shut down: nobody waits for it from now on. Its place in the order
        of departures (``P gone/at/<k>``) is what the others read as the count grows."""
        self.store.set(self.key(f"gone/{serial}"), "1")
        n = self.store.add(self.key("gone"), 1)
        self.store.set(self.key(f"gone/at/{n - 1}"), str(serial))

    def gone_count(self) -> int:
        """How many agents shut down."""
        return self._count("gone")

    def is_gone(self, serial: int) -> bool:
        return self.store.check([self.key(f"gone/{serial}")])

    def departures(self, places: list[int]) -> dict[int, int]:
        """The serials of departures at ``places`` in their order, of those written yet (one
        lost between its count and its name is not): two operations where all are."""
        keys = {self.key(f"gone/at/{k}"): k for k in places}
        return {keys[key]: int(v) for key, v in read_present(self.store, list(keys)).items()}

    # --- rounds ------------------------------------------------------------------------------

    def round(self) -> int:
        found = self._get("round")
        return 0 if found is None else int(found)

    def bump_round(self, round_: int) -> int:
        """Moves the rendezvous from ``round_`` to the next (whoever asks first does it); the
        round it is in now."""
        return int(self.store.compare_set(self.key("round"), str(round_), str(round_ + 1)))

    def arrive(self, round_: int, serial: int) -> int:
        """Agent ``serial`` arrives in ``round_``: its place ``k`` in arrival order."""
        k = self.store.add(self.key(f"round/{round_}/count"), 1) - 1
        self.store.set(self.key(f"round/{round_}/arrived/{k}"), str(serial))
        return k

    def arrival_count(self, round_: int) -> int:
        return self._count(f"round/{round_}/count")

    def arrivals(self, round_: int, known: list[int] | None = None) -> list[int]:
        """The serials arrived in ``round_``, in order (``known``: a list read before, extended);
        an arrival whose record is not yet written ends the list for now."""
        found = list(known or [])
        for k in range(len(found), self.arrival_count(round_)):
            serial = self._get(f"round/{round_}/arrived/{k}")
            if serial is None:
                break
            found.append(int(serial))
        return found

    def close_round(self, round_: int, members: list[int]) -> list[int]:
        """Closes ``round_`` with ``members`` unless another agent closed it first: the members."""
        return json.loads(self.store.compare_set(self.key(f"round/{round_}/members"), "",
                                                 json.dumps(members)))

    def members(self, round_: int) -> list[int] | None:
        """``round_``'s members in group rank order; None while it is open."""
        found = self._get(f"round/{round_}/members")
        return None if found is None else json.loads(found)

    def waiting(self, round_: int) -> int:
        """Agents arrived in the round after ``round_``: they wait for the others to restart."""
        return self.arrival_count(round_ + 1)

    # --- the job -----------------------------------------------------------------------------

    def job(self) -> JobRecord | None:
        found = self._get("job")
        if found is None:
            return None
        # Fields this version does not know (a node of a newer one wrote them) are left out.
        known = {f.name for f in dataclasses.fields(JobRecord)}
        return JobRecord(**{k: v for k, v in json.loads(found).items() if k in known})

    def publish_job(self, job: JobRecord) -> None:
        self.store.set(self.key("job"), json.dumps(dataclasses.asdict(job)))

    def beat(self) -> int:
        """Rank 0: one beat of the live job."""
        return self.store.add(self.beat_key(), 1)

    def beats(self) -> int:
        """The job's beats so far (the counter is made, at 0, when absent)."""
        return self.store.add(self.beat_key(), 0)

    def beat_key(self) -> str:
        """The beat counter's key, for a :class:`Watch` (after :meth:`beats` made it)."""
        return self.key("job/beat")

    # --- joins -------------------------------------------------------------------------------

    def join(self, round_: int, serial: int) -> int:
        """Agent ``serial`` asks to join the live job of ``round_``: its ticket ``j``."""
        j = self.store.add(self.key(f"round/{round_}/joins"), 1) - 1
        self.store.set(self.key(f"round/{round_}/join/{j}"), str(serial))
        return j

    def joins(self, round_: int) -> list[tuple[int, int]]:
        """``(j, serial)`` of every ticket of ``round_`` whose record is written, in order."""
        found = []
        for j in range(self._count(f"round/{round_}/joins")):
            serial = self._get(f"round/{round_}/join/{j}")
            if serial is not None:
                found.append((j, int(serial)))
        return found

    def pending_joins(self, round_: int, nodes: list[int], dead: set[int],
                      job: JobRecord | None = None) -> list[tuple[int, int]]:
        """The tickets of ``round_`` still to admit: each agent's latest (an agent that asks again
        supersedes its earlier tickets), of agents neither in ``nodes`` nor ``dead``. With the
        job's record ``job``, a ticket a generation admitted counts no more once the record is of
        that generation or later (the node was admitted, then dropped: a frozen worker, say);
        until then it counts, though ``nodes`` does not name it yet."""
        latest = {serial: j for j, serial in self.joins(round_)}
        return sorted((j, serial) for serial, j in latest.items()
                      if serial not in nodes and serial not in dead
                      and not (job is not None and self._admitted_by(round_, j, job)))

    def mark_admitted(self, round_: int, j: int, launch: str, generation: int) -> None:
        """Rank 0: ticket ``j`` of ``round_`` enters the job of ``launch`` at ``generation``."""
        self.store.set(self.key(f"round/{round_}/join/{j}/admitted"),
                       json.dumps({"launch": launch, "generation": generation}))

    def admitted(self, round_: int, j: int) -> dict[str, Any] | None:
        """``{"launch", "generation"}`` that admitted ticket ``j`` of ``round_``; None: none yet."""
        found = self._get(f"round/{round_}/join/{j}/admitted")
        mark = None if found is None else json.loads(found)
        return mark if isinstance(mark, dict) else None  # a mark of another shape: none

    def _admitted_by(self, round_: int, j: int, job: JobRecord) -> bool:
        """Whether ``job``'s record is of the generation that admitted ticket ``j``, or later."""
        mark = self.admitted(round_, j)
        return (mark is not None and mark.get("launch") == job.launch
                and job.generation >= mark.get("generation", 0))

    def mark_ready(self, round_: int, j: int, local_rank: int) -> None:
        """A joining worker of ticket ``j`` is ready to be admitted."""
        self.store.set(self.key(f"round/{round_}/join/{j}/ready/{local_rank}"), "1")

    def ready(self, round_: int, j: int, nproc: int) -> bool:
        """Whether all ``nproc`` workers of ticket ``j`` are ready."""
        return self.store.check([self.key(f"round/{round_}/join/{j}/ready/{local_rank}")
                                 for local_rank in range(nproc)])

    # --- the end -----------------------------------------------------------------------------

    def arrive_at_exit(self, serial: int) -> None:
        self.store.set(self.key(f"exit/{serial}"), "1")

    def at_exit(self, serial: int) -> bool:
        return self.store.check([self.key(f"exit/{serial}")])

    def pass_exit(self, serial: int) -> None:
        """Agent ``serial`` saw everyone at the exit barrier and leaves it."""
        self.store.set(self.key(f"exit/{serial}/passed"), "1")

    def passed_exit(self, serial: int) -> bool:
        return self.store.check([self.key(f"exit/{serial}/passed")])

    def closed(self) -> bool:
        return self.store.check([self.key("closed")])

    def set_closed(self) -> None:
        self.store.set(self.key("closed"), "1")


class Watch:
    """Counters judged against the reader's own keep-alive: a counter is *still* once it stood
    still while the reader's own moved ``max_attempt`` times, *moving* once it moved at all
    since the first look. Every judgement needs looks over time: call :meth:`look` regularly."""

    def __init__(self, store: dist.Store, own_key: str, max_attempt: int):
        self.store, self.own_key, self.max_attempt = store, own_key, max_attempt
        self.first: dict[str, int] = {}
        self.seen: dict[str, tuple[int, int]] = {}
        """key → (its value, the reader's own when it last moved)."""

    def look(self, keys: list[str]) -> tuple[set[str], set[str]]:
        """``(moving, still)`` among ``keys``: counters that exist (``multi_get`` would wait)."""
        values = [int(v) for v in self.store.multi_get([self.own_key, *keys])]
        own = values[0]
        for key, value in zip(keys, values[1:]):
            self.first.setdefault(key, value)
            if self.seen.get(key, (None,))[0] != value:
                self.seen[key] = (value, own)
        moving = {key for key in keys if self.seen[key][0] != self.first[key]}
        return moving, {key for key in keys if own - self.seen[key][1] >= self.max_attempt}

    def still_for(self, seconds: float, interval_s: float) -> None:
        """From now on a counter is still only once it stood still for ``seconds`` at least,
        counted in the reader's own keep-alives of ``interval_s`` (never fewer than
        ``max_attempt`` of them)."""
        self.max_attempt = max(self.max_attempt, math.ceil(seconds / interval_s))


def look_interval(keep_alive_s: float, agents: int) -> float:
    """How long an agent waits between two looks at the keep-alives of the job's ``agents``
    while its workers run: half a keep-alive interval, and no more than LOOKED_AT_S keep-alives
    a second. Each of N agents reading all N every 2.5 s was N² reads (400,000 a second at
    1,000 nodes: the store's heaviest work, which doubled its answers' wait, ``make scale``);
    this is at most LOOKED_AT_S N. The cost: where an agent dies just before the others reach
    the exit barrier, they may find it dead up to a look later than they would (the barrier's
    own looks then judge it, within ``max_attempt`` keep-alives)."""
    return max(keep_alive_s / 2, agents / LOOKED_AT_S)


class Liveness:
    """Which agents are dead for a reader that is agent ``own``: those whose keep-alive stood
    still while its own moved ``max_attempt`` times, and those that shut down."""

    def __init__(self, roster: Roster, own: int, max_attempt: int):
        self.roster = roster
        self.watch = Watch(roster.store, roster.key(f"alive/{own}"), max_attempt)
        self.gone: set[int] = set()
        self.unread: set[int] = set()
        """Places in the order of departures counted but not read yet."""
        self.counted = 0
        self.asked_for: set[int] = set()
        """The unread places when the agents were last asked one by one."""

    def dead(self, serials: list[int]) -> set[int]:
        # The departures since the last look, each read once: asking every agent of the job
        # whether it left, whenever one did, was N operations for each of N agents.
        count = self.roster.gone_count()
        self.unread |= set(range(self.counted, count))
        self.counted = max(self.counted, count)
        found = self.roster.departures(sorted(self.unread))
        self.gone |= set(found.values())
        self.unread -= set(found)
        serials = sorted(set(serials))
        if self.unread and self.unread != self.asked_for:
            # A departure counted and not named (its agent lost between the two writes): the
            # agents asked about are asked once, each, whether they left.
            self.asked_for = set(self.unread)
            self.gone |= {n for n in serials if n not in self.gone and self.roster.is_gone(n)}
        keys = {n: self.roster.key(f"alive/{n}") for n in serials}
        _, still = self.watch.look(list(keys.values()))
        return {n for n, key in keys.items() if key in still or n in self.gone}
