"""``--evict-slower-than F``: a node that stays F times slower than its peers is let go, in
process, and comes back by the join path once it is fast again.

A straggler that costs more than it gives (balance.py shares the step around it, but a node 4x
slow still holds a share) leaves the job as a lost node would: nobody restarts. The rule, decided
alike on every rank:

- a rank is a *candidate* while pace.py's detector names it a straggler and its factor (its pace
  over its peers' median) is ``F`` or more; each rank notes since when: the step (the same on
  every rank) and the time by its own clock;
- a rank votes, in the next step's one collective (the trainer's flags), once the oldest
  candidates have been ones for ``--evict-after`` seconds; the vote is summed, so every rank
  learns it at the same step, and the candidates are what the detector says, which every rank
  builds from the same summed times;
- the ranks evicted are every rank of the nodes of the candidates voted for (the oldest at the
  vote, still candidates after its step; one named meanwhile waits its turn), never all of the
  job's (a node's agent restarts all of its workers when one leaves: torchrun's way); they leave
  after that step (``evicted``), the others go on without them (a change of membership, why
  ``evicted``). Not at a step where the job ends, or where some rank leaves or stops: those come
  first, and the candidates are judged again in the world that follows.

The eviction is said in a log line and an ``evicted`` record of events.jsonl (rank 0), and kept
in the launch's store under ``evicted/<host>/<agent pid>`` (:func:`record_key`) for the node's
next workers: its agent restarts them (the worker's exit status is EXIT_DROPPED), they join by the
join path, and before they say they are ready each one is on probation (:class:`Probation`): it
times the forward and backward passes of a few micro-batches on a copy of its model, every
:data:`PROBE_EVERY_S`, against the peers' pace at the eviction, and asks to join only once it is
under pace.SLOW of it (where the detector would not name it) :data:`PROBES` times in a row.

Only under our rendezvous (``--rdzv_backend=elastic-mnist``): under torch's c10d no node can leave
and come back without every node restarting (:meth:`Eviction.enter` says why).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from elastic_mnist.data.order import Shares
from elastic_mnist.env import OUR_BACKEND
from elastic_mnist.errors import EXIT_DROPPED, CannotRecover, first_line
from elastic_mnist.model import build_model
from elastic_mnist.pace import SLOW
from elastic_mnist.resilience.agreement import UNKNOWN, Identity, read_present

if TYPE_CHECKING:
    from elastic_mnist.config import TrainConfig
    from elastic_mnist.data.datasets import Digits
    from elastic_mnist.env import DistEnv
    from elastic_mnist.pace import StragglerDetector
    from elastic_mnist.resilience.faces import NullMembership
    from elastic_mnist.step_result import StepResult
    from elastic_mnist.writers import Writers

log = logging.getLogger(__name__)

PROBE_EVERY_S = 1.0
"""How often a worker on probation times itself."""
PROBE_MICRO_BATCHES = 4
"""Micro-batches of one probe: the mean of their forward and backward passes is its pace."""
PROBES = 3
"""Probes in a row under pace.SLOW of the peers' pace before the worker asks to join: a node
back under SLOW is not named a straggler, nor evicted again, unless it slows again."""


def record_key(host: str, agent: int) -> str:
    """Where, in the launch's store, the eviction of the node of ``host``'s agent ``agent`` is
    kept for its next workers."""
    return f"evicted/{host}/{agent}"


class Eviction:
    """The loop's face to ``--evict-slower-than``: the candidates, this rank's vote, and the
    ranks that leave."""

    def __init__(self, cfg: TrainConfig):
        self.factor = cfg.run.evict_slower_than
        self.after_s = cfg.run.evict_after
        self.per_step = Shares(cfg.optim.global_batch_size, cfg.optim.micro_batch_size, 1).per_step
        self.since: dict[int, tuple[int, float]] = {}
        """Each candidate: the step at which it became one (the same on every rank), and when
        by this rank's clock."""
        self.oldest: int | None = None
        """The step at which the oldest candidates of this rank's last vote became candidates."""
        self.said_off = False

    def enter(self, env: DistEnv, writers: Writers, membership: NullMembership) -> None:
        """A new world: no candidates (the detector starts afresh too). Only under our
        rendezvous: under torch's c10d, an evicted node's return restarts every node (a new
        round), and its end (exit 0) closes the rendezvous once its agent leaves the exit
        barrier (torch's launcher shuts its handler down), after which no node can come back
        nor the job restart; and the arrival of its agent there counted twice at the job's end
        (it arrives, and rank 0 releases the agents a change removed)."""
        self.env, self.writers, self.membership = env, writers, membership
        wanted = self.factor > 0 and membership.in_process and env.world_size > 1
        ours = env.rendezvous is not None and env.rendezvous.backend == OUR_BACKEND
        if wanted and not ours and env.is_main and not self.said_off:
            log.warning("--evict-slower-than is off: a node is let go and comes back in process "
                        "only under --rdzv_backend=elastic-mnist (under c10d its return would "
                        "restart every node)")
            self.said_off = True
        self.active = wanted and ours
        self.since, self.oldest = {}, None

    def after(self, step: int, result: StepResult, detector: StragglerDetector,
              done: bool) -> list[int]:
        """After the detector judged ``step``: the candidates followed, and the ranks that leave
        (:meth:`follow`, then :meth:`decide`)."""
        self.follow(step, detector)
        return self.decide(step, result, detector, done)

    def follow(self, step: int, detector: StragglerDetector) -> None:
        """After the detector judged ``step``: who is a candidate, and since when."""
        if not self.active or detector.last is None:
            return
        factors = detector.last[0]
        now = step, time.monotonic()
        self.since = {r: self.since.get(r, now) for r in sorted(detector.named)
                      if factors[r] >= self.factor}

    def vote(self) -> bool:
        """This rank's vote, in the next step's collective: the oldest candidates have been
        ones long enough by this rank's clock. Which they are is noted: the same on every rank."""
        self.oldest = min((began for began, _ in self.since.values()), default=None)
        now = time.monotonic()
        return any(now - noted >= self.after_s for _, noted in self.since.values())

    def decide(self, step: int, result: StepResult, detector: StragglerDetector,
               done: bool) -> list[int]:
        """The ranks that leave after ``step``: every rank of the nodes of the candidates that
        the vote was for (the oldest then, and still candidates: one named since is not yet old
        enough), where some rank voted; none where that would be every rank, nor at a step
        where the job ends or some rank leaves or stops (the eviction waits for a step of its
        own). Said, and kept for the nodes."""
        if not (self.active and result.evict_voted and not done and not result.leavers
                and not result.stop_requested and self.oldest is not None):
            return []
        named = sorted(r for r, (began, _) in self.since.items() if began <= self.oldest)
        if not named:
            return []
        try:
            identities = self.around(named)
        except RuntimeError as e:  # DistStoreError: this rank cannot tell whom the job lets go
            raise CannotRecover(f"the coordination store does not answer as the job lets a "
                                f"straggler go: {first_line(e)}") from None
        nodes = {identities[r].node for r in named}
        ranks = [r for r in sorted(identities) if identities[r].node in nodes]
        if len(ranks) >= self.env.world_size:
            return []
        factors, _, peers = detector.last
        slowest = max(named, key=lambda r: factors[r])
        record = {"step": step, "ranks": ranks, "named": named,
                  "hosts": sorted({host for host, _ in nodes}),
                  "factor": round(factors[slowest], 3),
                  "factors": [round(factors[r], 3) for r in named],
                  "slower_than": self.factor, "after_s": self.after_s,
                  "for_s": round(time.monotonic() - min(self.since[r][1] for r in named), 1),
                  "median_s": round(peers[slowest], 6),
                  "micro_batch_s": peers[slowest] * self.env.world_size / self.per_step}
        if self.env.is_main:
            log.warning("step %d: evicting %s (rank(s) %s): %.2fx slower than its peers' median "
                        "for %.0f s (--evict-slower-than %g --evict-after %g); the others go on "
                        "without it, and it comes back once it is fast again", step,
                        ", ".join(record["hosts"]), ", ".join(map(str, ranks)), record["factor"],
                        record["for_s"], self.factor, self.after_s)
        self.writers.events.emit("evicted", step, **{k: v for k, v in record.items()
                                                     if k != "step"})
        if self.env.rank in ranks:  # every one of them: its siblings may be gone before it writes
            me = self.membership.identity  # type: ignore[attr-defined]
            try:  # for the node's next workers (Probation); without it they join untried
                self.membership.store.set(record_key(*me.node), json.dumps(record))  # type: ignore[attr-defined]
            except RuntimeError as e:
                log.warning("could not keep this node's eviction for its next workers: %s", e)
        return ranks


    def around(self, named: list[int]) -> dict[int, Identity]:
        """The identities of the ranks that may share a node with ``named``: the generation's,
        where this rank read them already (a watcher), else each named rank's node whole, read
        outwards from it a node's size at a time until a rank of another node (or the world's
        end) bounds it on both sides (torchrun numbers ranks node by node and every change keeps
        their order; nodes may differ in size after a change): a few reads, where every rank
        reading every identity was W² of them."""
        known = self.membership.known  # type: ignore[attr-defined]
        if known.ready and UNKNOWN not in known.read().values():
            return known.read()
        span, size = max(1, self.env.local_world_size), self.env.world_size
        found: dict[int, Identity] = {}

        def read(ranks: range) -> None:
            wanted = [q for q in ranks if 0 <= q < size and q not in found]
            keys = [self.membership.key(f"id/{q}") for q in wanted]  # type: ignore[attr-defined]
            got = read_present(self.membership.store, keys)  # type: ignore[attr-defined]
            found.update({q: Identity(**json.loads(got[key])) for q, key in zip(wanted, keys)
                          if key in got})

        for r in named:
            read(range(r - span + 1, r + span))
            node = found[r].node
            for way in (-1, 1):
                edge = r
                while 0 <= edge + way < size:
                    if edge + way not in found:
                        read(range(edge + way, edge + way + way * span, way))
                    if edge + way not in found or found[edge + way].node != node:
                        break
                    edge += way
        return found


def evicted(step: int) -> int:
    """The line and status of a worker the job let go as a straggler: its agent restarts the
    node into the job (EXIT_DROPPED), which rejoins in process once fast again (probation)."""
    log.warning("evicted at step %d as a straggler: the other nodes go on without this one; "
                "exiting with %d, so that torchrun restarts this node, which rejoins once it is "
                "fast again", step, EXIT_DROPPED)
    return EXIT_DROPPED


class Probation:
    """A joining worker of a node the job evicted: it asks to join only once it is fast again."""

    def __init__(self, cfg: TrainConfig, data: Digits, device: torch.device):
        self.cfg, self.data, self.device = cfg, data, device

    def wait(self, membership: NullMembership, stopping: Callable[[], bool],
             over: Callable[[], str | None]) -> str | None:
        """None once this worker may ask to join (at once where its node was not evicted);
        else why it will not: ``left`` (asked to stop), or ``over()``'s answer (a look at the
        job, once a probe: it finished, was restarted as a whole, or its beat stood still)."""
        if self.cfg.run.evict_slower_than <= 0:  # nobody is evicted: no store call at a join
            return None
        m: Any = membership
        key = record_key(*m.identity.node)
        try:
            if not m.store.check([key]):
                return None
            record = json.loads(m.store.get(key))
        except RuntimeError:
            return None  # the store will say so at the join
        target = record["micro_batch_s"]
        if m.env.local_rank == 0:
            log.warning("this node was evicted at step %d (%.2fx slower than its peers): on "
                        "probation until its pace is under %.1fx theirs (%.1f ms a micro-batch) "
                        "%d times in a row", record["step"], record["factor"], SLOW,
                        1e3 * target, PROBES)
        in_a_row, probes, probe = 0, 0, self.prober()
        while in_a_row < PROBES:
            if stopping():
                return "left"
            why = over()
            if why is not None:
                return why
            began = time.monotonic()
            factor = probe() / target
            probes += 1
            in_a_row = in_a_row + 1 if factor < SLOW else 0
            log.info("probation: %.2fx the peers' pace", factor)
            time.sleep(max(0.0, PROBE_EVERY_S - (time.monotonic() - began)))
        with contextlib.suppress(RuntimeError):  # a later restart of the node is no eviction's
            m.store.delete_key(key)
        if m.env.local_rank == 0:
            log.warning("fast again after %d probes (under %.1fx its peers' pace %d times in a "
                        "row): asking to join", probes, SLOW, PROBES)
        return None

    def prober(self) -> Callable[[], float]:
        """One probe: the seconds of a micro-batch's forward and backward passes, the mean of
        PROBE_MICRO_BATCHES, on a model of its own (the job's, hooked for its statistics, is not
        touched), as the step times them (pace.py): data fetch included."""
        net = build_model(self.cfg.optim.seed).to(self.device).train()
        if self.cfg.run.channels_last:
            net.to(memory_format=torch.channels_last)
        count = min(self.cfg.optim.micro_batch_size, len(self.data))
        autocast = partial(torch.autocast, self.device.type, dtype=torch.bfloat16,  # the step's
                           enabled=self.cfg.run.precision == "bf16")

        def probe() -> float:
            began = time.perf_counter()
            for i in range(PROBE_MICRO_BATCHES):
                indices = torch.arange(i * count, (i + 1) * count, device=self.device) \
                    % len(self.data)
                images, labels = self.data.batch(indices)
                with autocast():
                    loss = F.cross_entropy(net(images), labels, reduction="sum")
                loss.backward()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            net.zero_grad(set_to_none=True)
            return (time.perf_counter() - began) / PROBE_MICRO_BATCHES
        return probe
