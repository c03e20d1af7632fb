"""Our rendezvous backend for torchrun's agents: ``--rdzv_backend=elastic-mnist``.

torchrun finds it under the ``torchrun.handlers`` entry points (pyproject.toml, plugin.py):
:func:`create_handler` builds an :class:`AgentsHandler` for each agent, on the public
``RendezvousHandler`` interface only. Its records are roster.py's, which the workers'
membership reads too, so agents and workers share one membership:

- each agent takes a serial and keeps a keep-alive counter moving from a thread of its own for
  as long as its process lives (keep_alive.py);
- rounds form as torch's c10d rendezvous forms them (``--nnodes=MIN:MAX``, ``last_call_timeout``,
  ``join_timeout``), ranks in the order of the agents' names and pids, as c10d's; an agent that restarts its workers moves the
  rendezvous to the next round, and :meth:`~AgentsHandler.num_nodes_waiting` counts the agents
  waiting there, so the others restart as torch's do;
- while the job runs in process (rank 0 publishes ``P job`` and beats), an agent that arrives,
  or whose workers failed, joins it instead: it returns at once with the rank its workers will
  have once admitted, nobody restarts; beyond ``MAX`` nodes it waits, saying why in one line;
- ranks come by arithmetic (``TORCH_ELASTIC_WORKER_IDENTICAL=1``), so nodes must have the same
  ``--nproc_per_node``; the agent's exit barrier waits for the live agents of the job only
  (exit_barrier.py).

The store is the rendezvous store (a TCPStore) of ``--rdzv_endpoint``, served by the agent on the endpoint's
host (agent_store.py: listening where that host's name resolves; another agent there connects
when the port is taken) or by ``elastic-mnist rendezvous`` (every agent ``is_host=false``). An agent that waited for a job which then finished leaves with exit 0
(:class:`GracefulExit`). No private name of torch is used here. ``--rdzv_conf`` keys:
agent_settings.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from elastic_mnist.errors import first_line
from elastic_mnist.resilience import roster as rs
from elastic_mnist.resilience.agent_monitor import Monitor
from elastic_mnist.resilience.agent_settings import NAME, Settings, torchrun_nproc
from elastic_mnist.resilience.agent_store import Connection, client, connect
from elastic_mnist.resilience.exit_barrier import ExitBarrier, ExitStore
from elastic_mnist.resilience.keep_alive import KeepAlive
from elastic_mnist.resilience.roster import (
    AgentRecord,
    Liveness,
    Roster,
    Watch,
    look_interval,
)
from elastic_mnist.stores import listening

log = logging.getLogger(__name__)

POLL_S = 0.05
"""How often an agent reads the store while a round forms."""
WAIT_S = 0.2
"""How often it reads while it waits for room, a job record, or its judgement of others."""


def create_handler(params: RendezvousParameters) -> AgentsHandler:
    return AgentsHandler(Settings.from_params(params), nproc=torchrun_nproc())


class GracefulExit(SystemExit):
    """The job this agent waits to enter finished, or the rendezvous is closed: torchrun exits 0.

    Not torch's ``RendezvousGracefulExitError``: torch 2.14.1's ``launch_agent`` calls
    ``is_failed()`` on the ``None`` that ``SimpleElasticAgent.run`` returns after catching it,
    and torchrun exits 1 with an AttributeError. SystemExit(0) passes every ``except Exception``
    of the agent, runs its ``finally`` clauses (workers stopped, :meth:`AgentsHandler.shutdown`)
    and ends torchrun with 0 (its ``@record`` treats code 0 as success)."""

    def __init__(self, why: str):
        super().__init__(0)
        self.why = why

    def __str__(self) -> str:
        return self.why


@dataclass(frozen=True)
class Answer:
    """Where one rendezvous put this agent."""

    round: int
    rank: int
    world_size: int
    join: int | None = None
    """The join ticket, when the agent joins the live job of ``round``."""


class AgentsHandler(RendezvousHandler):
    """One torchrun agent's rendezvous (see the module's docstring)."""

    def __init__(self, settings: Settings, nproc: int):
        self.settings, self.nproc = settings, nproc
        self.server, first = connect(settings)
        self.port = first.port
        self.store = Connection(first, self._client, settings.join_timeout_s)
        """This agent's connection, opened anew where a question held it (agent_monitor.py)."""
        self.roster = Roster(self.store, settings.run_id)
        try:
            self.serial = self.roster.register(AgentRecord(
                host=socket.gethostname(), addr=settings.local_addr or socket.getfqdn(),
                pid=os.getpid(), nproc=nproc))
        except RuntimeError as e:
            raise RendezvousConnectionError(f"the rendezvous store at {self.endpoint} failed: "
                                            f"{first_line(e)}") from None
        self.keep_alive = KeepAlive(self._client, settings.run_id, self.serial,
                                    settings.keep_alive_interval_s)
        self.liveness = Liveness(self.roster, self.serial, settings.keep_alive_max_attempt)
        self.round: int | None = None
        """The round this agent was last answered in (None before its first rendezvous)."""
        self.seen_round: int | None = None
        """The round whose job this agent waits to enter, before its first answer."""
        self.join: int | None = None
        self.waited = False
        """Whether this agent waited for a job it found running (see :meth:`_finish`)."""
        self.records: dict[int, AgentRecord] = {}
        self.next_look = 0.0
        self.monitor = Monitor(self.serial, self.store, self._monitored, self._renewed)
        self.barrier = ExitBarrier(self.roster, self.serial, self.liveness, lambda: (
            self.round if self.round is not None else self.seen_round), settle=self._settle)
        """This agent's exit barrier (exit_barrier.py)."""
        self.exit_store = ExitStore(self.barrier, self.store, settings.timeout_s)
        self.environment: dict[str, str] = {}
        """What this handler exported to its workers (also in ``os.environ``)."""
        self._export(TORCH_ELASTIC_WORKER_IDENTICAL="1", **{
            rs.ENV_RDZV: self.endpoint, rs.ENV_RDZV_ID: settings.run_id,
            rs.ENV_AGENT: str(self.serial),
            rs.ENV_KEEP_ALIVE: rs.keep_alive_env(settings.keep_alive_interval_s,
                                                 settings.keep_alive_max_attempt)})

    # --- the store ---------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """``host:port`` of the store (``[host]:port`` for an IPv6 address)."""
        host = self.settings.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def _client(self) -> dist.TCPStore:
        """A connection of its own to the store (the keep-alive's; this agent's, anew), where
        the store listens (torch's opening retries for its whole timeout, then logs a trace)."""
        if not listening(self.settings.host, self.port, timeout_s=1.0):
            raise RuntimeError(f"nothing answers at {self.endpoint}")
        return client(self.settings, self.port)

    def _renewed(self) -> None:
        """The connection was opened anew under a held question, which keeps the judgement of
        the keep-alives it was making: the judgement begins again (a dead agent is found
        ``keep_alive_max_attempt`` keep-alives later than it would have been)."""
        self.liveness = Liveness(self.roster, self.serial, self.settings.keep_alive_max_attempt)
        self.barrier.liveness = self.liveness

    def _settle(self) -> None:
        """Before this agent's thread uses the store again: see :meth:`Monitor.settle`."""
        self.monitor.settle(self.settings.timeout_s)

    def _export(self, **variables: str | None) -> None:
        """Puts ``variables`` in this process's environment (None: removes it), which torchrun's
        agent hands its workers."""
        for name, value in variables.items():
            if value is None:
                os.environ.pop(name, None)
                self.environment.pop(name, None)
            else:
                os.environ[name] = self.environment[name] = value

    # --- RendezvousHandler -------------------------------------------------------------------

    def get_backend(self) -> str:
        return NAME

    @property
    def use_agent_store(self) -> bool:
        """Workers reach the rendezvous store as MASTER_ADDR:MASTER_PORT, as under c10d."""
        return True

    def get_run_id(self) -> str:
        return self.settings.run_id

    def is_closed(self) -> bool:
        return self.roster.closed()

    def set_closed(self) -> None:
        self.roster.set_closed()

    def num_nodes_waiting(self) -> int:
        """Agents waiting in the next round: torch's agent restarts its workers for them.

        torch's agent asks every ``--monitor_interval`` while its workers run, from the thread
        that watches them: answered within ``ANSWER_S`` (agent_monitor.py), 0 where the store
        did not answer."""
        if self.round is None:
            return 0
        return self.monitor.waiting()

    def _monitored(self) -> int:
        """The monitor's question: the agents waiting; at most twice per keep-alive interval
        (less often beyond 40 agents: :func:`look_interval`), this agent also looks at the
        keep-alives of the job's agents, so that it knows the dead ones when it reaches the
        exit barrier."""
        liveness = self.liveness  # this question's: a renewal gives the next ones another
        if time.monotonic() >= self.next_look:  # the host judges the waiting ones too (linger)
            waiting = self.roster.waiting_agents() if self.server is not None else []
            judged = self.barrier.expected() + waiting
            liveness.dead(judged)
            self.next_look = time.monotonic() + look_interval(
                self.settings.keep_alive_interval_s, len(judged))
        return self.roster.waiting(self.round)

    def shutdown(self) -> bool:
        """Stops the keep-alive and tells the others this agent is gone (the rendezvous stays
        open: other agents may still come); the agent serving the store first lets those at the
        exit barrier leave it."""
        self.keep_alive.stop()
        self._settle()
        try:
            self.roster.leave(self.serial)
            if self.server is not None:
                self.barrier.linger()
        except Exception as e:  # noqa: BLE001 - the store's host may have exited already
            log.debug("could not record agent %d's end: %s", self.serial, first_line(e))
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        self._settle()
        deadline = time.monotonic() + self.settings.join_timeout_s
        answer = None if self.round is None else self._reenter()
        while answer is None:
            if self.roster.closed():
                self._finish(f"the rendezvous {self.settings.run_id} is closed")
            r = self.roster.round()
            members = self.roster.members(r)
            if members is None:
                members = self._arrive(r, deadline)
                if members is None:
                    continue
                if self.serial in members:
                    answer = Answer(r, members.index(self.serial), len(members))
                    break
            with self._waiting():
                answer = self._late(r, members)
        return self._answer(answer)

    # --- rounds ------------------------------------------------------------------------------

    def _answer(self, answer: Answer) -> RendezvousInfo:
        self.round, self.join = answer.round, answer.join
        self._export(**{rs.ENV_ROUND: str(answer.round),
                        rs.ENV_JOIN: None if answer.join is None else str(answer.join)})
        log.info("agent %d: round %d, group rank %d of %d%s", self.serial, answer.round,
                 answer.rank, answer.world_size,
                 "" if answer.join is None else f" (joining the live job, ticket {answer.join})")
        return RendezvousInfo(self.exit_store, answer.rank, answer.world_size,
                              RendezvousStoreInfo(self.settings.host, self.port))

    def _record(self, serial: int) -> AgentRecord | None:
        if serial not in self.records:
            found = self.roster.agent(serial)
            if found is None:
                return None
            self.records[serial] = found
        return self.records[serial]

    def _check_nproc(self, round_: int) -> None:
        """Refuses this agent when the round's first agent has another ``--nproc_per_node``."""
        first = self.roster.arrivals(round_)[:1]
        record = self._record(first[0]) if first else None
        if record is not None and record.nproc != self.nproc:
            raise RendezvousError(
                f"this node has --nproc_per_node={self.nproc}, the job's nodes have "
                f"{record.nproc} (agent {first[0]} on {record.host}): every node of a job "
                f"needs the same")

    def _arrive(self, round_: int, deadline: float) -> list[int] | None:
        """Arrives in ``round_`` and waits until it closes: its members (None: the rendezvous
        moved on to another round first)."""
        s = self.settings
        self._check_nproc(round_)
        if self.roster.arrive(round_, self.serial) > 0:
            self._check_nproc(round_)
        arrivals: list[int] = []
        dead: set[int] = set()
        since_min = next_judgement = None
        while True:
            members = self.roster.members(round_)
            if members is not None:
                return members
            if self.roster.round() != round_:
                return None
            arrivals = self.roster.arrivals(round_, arrivals)
            if not arrivals:  # the first arrival's record is on its way
                time.sleep(POLL_S)
                continue
            now = time.monotonic()
            if next_judgement is None or now >= next_judgement:
                dead, next_judgement = self.liveness.dead(arrivals), now + WAIT_S
            nproc = self._record(arrivals[0]).nproc
            valid = [n for n in arrivals if n not in dead and self._record(n).nproc == nproc]
            since_min = (since_min or now) if len(valid) >= s.min_nodes else None
            if since_min is not None and (len(valid) >= s.max_nodes
                                          or now - since_min >= s.last_call_timeout_s):
                self.roster.close_round(round_, self._ranked(valid[:s.max_nodes]))
                continue
            if now >= deadline:
                raise RendezvousTimeoutError(
                    f"the rendezvous {s.run_id} did not gather --nnodes' minimum of "
                    f"{s.min_nodes} nodes within join_timeout={s.join_timeout_s:g}s "
                    f"({len(valid)} in round {round_})")
            time.sleep(POLL_S)

    def _ranked(self, serials: list[int]) -> list[int]:
        """``serials`` in group rank order: by the agents' names and pids, as torch's c10d
        rendezvous orders its participants, so that a node's rank follows its name, not the
        moment it arrived (the first arrivals are the members; their order is this)."""
        return sorted(serials, key=lambda n: (self._record(n).addr, self._record(n).pid, n))

    def _reenter(self) -> Answer | None:
        """This agent comes back (its workers failed, or agents wait in the next round): into the
        live job of its round when there is one, else it moves the rendezvous to the next round
        (the restart path; None: arrive there)."""
        r = self.round
        if self.roster.round() == r:
            state = self._job_state(r, Watch(self.store, self.roster.key(f"alive/{self.serial}"),
                                             self.settings.keep_alive_max_attempt))
            if state == "live":
                with self._waiting():
                    return self._join(r)
            self.roster.bump_round(r)
        return None

    @contextlib.contextmanager
    def _waiting(self) -> Iterator[None]:
        """Says in the store, while it lasts, that this agent waits to enter the job: the agent
        serving the store lingers for it (:meth:`ExitBarrier.linger`)."""
        self.roster.set_waiting(self.serial, True)
        try:
            yield
        finally:
            try:
                self.roster.set_waiting(self.serial, False)
            except RuntimeError:  # the store went: what ends the wait says why
                pass

    def _late(self, round_: int, members: list[int]) -> Answer | None:
        """``round_`` closed without this agent: into its live job, or, when that job does not run
        in process (or publishes nothing while its workers start, ``START_UP_S``, or within
        ``last_call_timeout`` once one of the round's agents is gone, or died),
        into the next round, room permitting (None: arrive in the round the rendezvous is in
        now). Once one of the round's agents is at the exit barrier (its workers succeeded) and
        the others too or dead, the job is over."""
        s = self.settings
        start, said = time.monotonic(), False
        start_up = max(s.last_call_timeout_s, min(rs.START_UP_S, s.join_timeout_s))
        self.seen_round = round_
        watch = Watch(self.store, self.roster.key(f"alive/{self.serial}"),
                      s.keep_alive_max_attempt)
        while True:
            if self.roster.closed():
                self._finish(f"the rendezvous {s.run_id} is closed")
            if self.roster.round() != round_:
                return None
            state = self._job_state(round_, watch)
            if state == "live":
                return self._join(round_)
            if self._over(members):
                self._finish(f"the job of round {round_} has finished")
            alive = set(members) - self.liveness.dead(members)
            waited = time.monotonic() - start
            full = len(alive) >= s.max_nodes
            # No job record yet: its workers start, unless a member is gone or the last round's
            # job recovered by restarts (then, as for a job that publishes none, after the last
            # call).
            unpublished = start_up
            if state == "none" and (len(alive) < len(members) or self._restarted_last()):
                unpublished = s.last_call_timeout_s
            if state == "dead" or not alive or (state == "restart" and not full) or (
                    state == "none" and not full and waited >= unpublished):
                self.roster.bump_round(round_)
                return None
            if full and (state == "restart" or waited >= s.last_call_timeout_s):
                said = said or self._say_at_maximum()
            self._wait()

    def _restarted_last(self) -> bool:
        """The newest job record is an earlier round's that recovers by restarts (the job may be
        on its way to running in process now: its fallback may have been passing)."""
        job = self.roster.job()
        return job is not None and not job.in_process

    def _over(self, members: list[int]) -> bool:
        """Whether the agents of ``members`` are at the exit barrier (but the dead), one at least."""
        arrived = {n for n in members if self.roster.at_exit(n)}
        return bool(arrived) and not set(members) - arrived - self.liveness.dead(members)

    def _job_state(self, round_: int, watch: Watch) -> str:
        """The job of ``round_``: "none" (no record of it), "restart" (it does not run in
        process), "live" (its beat moves), "dead" (its beat stood still, or every node of it
        but this one is dead); raises :class:`GracefulExit` when it finished."""
        self.roster.beats()
        while True:
            job = self.roster.job()
            if job is None or job.round != round_:
                return "none"
            if job.finished:
                self._finish(f"the job {self.settings.run_id} has finished")
            if not job.in_process:
                return "restart"
            others = [n for n in job.nodes if n != self.serial]
            watch.still_for(job.quiet_s, self.settings.keep_alive_interval_s)
            moving, still = watch.look([self.roster.beat_key()])
            if not set(others) - self.liveness.dead(others) or still:
                log.warning("the job of round %d is gone (%s): agent %d starts the next round",
                            round_, "its beat stood still" if still else "its nodes are dead",
                            self.serial)
                return "dead"
            if moving:
                return "live"
            time.sleep(WAIT_S)

    def _join(self, round_: int) -> Answer | None:
        """Joins the live job of ``round_``: the rank its workers will have once admitted, after
        its nodes and the tickets before this one. At ``--nnodes``' maximum it waits for room,
        saying so once; when the job's beat stops it moves the rendezvous on (None)."""
        s = self.settings
        self.seen_round = round_
        self._check_nproc(round_)
        j = self.roster.join(round_, self.serial)
        beat = Watch(self.store, self.roster.key(f"alive/{self.serial}"), s.keep_alive_max_attempt)
        said = False
        while True:
            if self.roster.closed():
                self._finish(f"the rendezvous {s.run_id} is closed")
            job = self.roster.job()
            if self.roster.round() != round_ or job is None or job.round != round_:
                return None
            if job.finished:
                self._finish(f"the job {s.run_id} has finished")
            beat.still_for(job.quiet_s, s.keep_alive_interval_s)
            if beat.look([self.roster.beat_key()])[1]:
                log.warning("the job of round %d is gone (its beat stood still): agent %d starts "
                            "the next round", round_, self.serial)
                self.roster.bump_round(round_)
                return None
            tickets = self.roster.pending_joins(round_, job.nodes, set(), job)
            others = [n for n in job.nodes if n != self.serial]
            dead = self.liveness.dead(others + [n for _, n in tickets])
            nodes = [n for n in others if n not in dead]
            before = [t for t, n in tickets if t < j and n not in dead]
            rank = len(nodes) + len(before)
            if rank < s.max_nodes:
                return Answer(round_, rank, rank + 1, join=j)
            said = said or self._say_at_maximum()
            self._wait()

    def _say_at_maximum(self) -> bool:
        log.warning("the job runs at its --nnodes maximum of %d nodes: this node enters when one "
                    "leaves", self.settings.max_nodes)
        return True

    def _wait(self) -> None:
        self.waited = True
        time.sleep(WAIT_S)

    def _finish(self, why: str) -> None:
        """Leaves, with exit 0, an agent that waited for the job; an agent that finds it over at
        its first look fails as torch's c10d does for a closed rendezvous (its --rdzv_id is
        another job's, or it came after the end)."""
        if self.round is None and not self.waited:
            raise RendezvousClosedError(f"{why} (agent {self.serial} came after its end; a new "
                                        f"job needs a --rdzv_id of its own)")
        log.warning("%s: agent %d leaves (exit 0)", why, self.serial)
        raise GracefulExit(why)
