"""Going on after a change of membership, in process: rollback, one agreed state, the leave policy.

A step cut short is undone (:meth:`Regroup.rollback`); the survivors agree on a step through the
membership and take the state of the first one that completed it, checking by digest that every
survivor holds the same model (:meth:`Regroup.adopt`); the first step after the change reports it
(:meth:`Regroup.maybe_report_change`). Nodes that join are admitted at a step boundary and take
rank 0's state the same way (:meth:`Regroup.grow`, :meth:`Regroup.enter`). The leave policy says
when ranks that asked to stop leave while the others go on (:class:`LeavePolicy`). The loop sees :meth:`Regroup.recover`, the step's
marks and the leave vote; what the agreed step still owes is the loop's (trainer.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from elastic_mnist import distributed
from elastic_mnist.batchnorm import GlobalBatchNormStats
from elastic_mnist.checkpointer import snapshot
from elastic_mnist.engine import Engine
from elastic_mnist.errors import CannotRecover, PeerFailure, first_line
from elastic_mnist.events import NullEventLog, utc_time
from elastic_mnist.model import state_digest
from elastic_mnist.resilience.agreement import NO_STATE, Change, Position
from elastic_mnist.resilience.faces import NullMembership
from elastic_mnist.state import Progress

if TYPE_CHECKING:
    from elastic_mnist.writers import Writers

log = logging.getLogger("elastic_mnist.trainer")  # the loop's lines, under the loop's name

LEAVE_GRACE_S = 1.0
"""How long some ranks' stop request must stand alone before they leave and the others go on
without them: the nodes of one job told to stop together (a scheduler's preemption, the agents'
restart when a node joins) all ask within it, and then everyone stops at one step."""


class LeavePolicy:
    """When ranks that asked to stop go while the others go on without them: some asked, the
    others can go on in process, and the request stood alone for LEAVE_GRACE_S (a vote of the
    step, so that every rank decides alike)."""

    def __init__(self) -> None:
        self._partial_stop_since: float | None = None

    def reset(self) -> None:
        self._partial_stop_since = None

    def leavers(self, stopping: list[int], voted: bool, in_process: bool,
                world_size: int) -> list[int]:
        if not (in_process and 0 < len(stopping) < world_size):
            self._partial_stop_since = None
            return []
        if self._partial_stop_since is None:
            self._partial_stop_since = time.monotonic()
        return stopping if voted else []

    def vote(self) -> bool:
        return (self._partial_stop_since is not None
                and time.monotonic() - self._partial_stop_since >= LEAVE_GRACE_S)


class Regroup:
    """Recovery in process for one worker: it owns the rollback of a step cut short, the
    agreement (recover, adopt), the digest check and the leave policy. It is handed the engine,
    the BatchNorm statistics, the optimizer, the progress and the payload's two faces (``state``
    builds one, ``load_state`` takes one); the new world's writers are the loop's to take."""

    def __init__(self, membership: NullMembership, engine: Engine, bn_stats: GlobalBatchNormStats,
                 optimizer: torch.optim.Optimizer, device: torch.device, progress: Progress,
                 state: Callable[[], dict[str, Any]],
                 load_state: Callable[[dict[str, Any]], None]):
        self.membership, self.engine, self.bn_stats = membership, engine, bn_stats
        self.optimizer, self.device, self.progress = optimizer, device, progress
        self.state, self.load_state = state, load_state
        self.leave_policy = LeavePolicy()
        self.mid_step = False
        """A step has begun and not completed: what it changed is undone if it fails."""
        self.change: Change | None = None
        """The last change of membership, until the first step after it completes."""
        self.holds_state = not membership.joining
        """Whether this process holds the job's state: a joining worker holds none until it
        adopted the state of the generation that admitted it."""

    # --- the step's marks and the leave vote ---------------------------------------------------

    def step_begins(self) -> None:
        self.mid_step = True

    def step_done(self) -> None:
        self.mid_step = False

    def leave_vote(self) -> bool:
        """This rank's vote that the ranks asking to stop leave while the others go on."""
        return self.leave_policy.vote()

    def leavers(self, stopping: list[int], voted: bool, world_size: int) -> list[int]:
        """The ranks that leave after this step (none unless the others can go on in process)."""
        return self.leave_policy.leavers(stopping, voted, self.membership.in_process, world_size)

    # --- a change of membership ----------------------------------------------------------------

    def position(self, evaluated_step: int) -> Position:
        return Position(step=self.progress.step if self.holds_state else NO_STATE,
                        mid_step=self.mid_step, evaluated_step=evaluated_step)

    def recover(self, writers: Writers, evaluated_step: int, why: str = "died",
                suspects: tuple[int, ...] = (), detail: str = "") -> Change:
        """Goes on with the ranks that are left: one agreed state, the model in the new group.
        Returns the change (its world is the loop's to take); raises CannotRecover when this
        rank cannot go on. ``writers``: the generation that is gone's."""
        writers.watchdog.close(wait=False)  # it watched the group that is gone
        self.membership.inject = partial(writers.faults.maybe_strike_recovery,
                                         step=self.progress.step + 1)
        while True:
            self.rollback()
            try:
                change = self.membership.recover(self.position(evaluated_step), why, suspects,
                                                 detail)
                self.adopt(change)
                break
            except PeerFailure as failure:  # the new group lost a member too: the next round
                why, suspects, detail = "died", (), first_line(failure)
            except CannotRecover as e:
                self.membership.fall_back(str(e))
                raise
        log.warning("generation %d: world size %d -> %d at step %d (ranks %s %s); going on in "
                    "process", change.generation, change.old_world_size, change.env.world_size,
                    change.step, ", ".join(str(lost["rank"]) for lost in change.lost) or "none",
                    change.why)
        return change

    def grow(self, writers: Writers, evaluated_step: int) -> Change:
        """At the end of the step that raised rank 0's admission flag: the job admits the
        joining nodes, and every rank goes on in their new generation, the joiners holding rank
        0's state. A member lost meanwhile is recovered from as after any fault (the change is
        then that shrink). Returns the change; raises CannotRecover when this rank cannot go on.
        ``writers``: the generation that is over's."""
        writers.watchdog.close(wait=False)  # it watched the group that is over
        return self._begin(writers, evaluated_step,
                           lambda: self.membership.grow(self.position(evaluated_step)))

    def enter(self, writers: Writers, admission: dict[str, Any]) -> Change:
        """A joining worker, admitted: it takes its place in the job's new generation and the
        state of the job's rank 0 (as :meth:`grow`)."""
        return self._begin(writers, admission["evaluated_step"],
                           lambda: self.membership.enter(admission))

    def _begin(self, writers: Writers, evaluated_step: int,
               begin: Callable[[], Change]) -> Change:
        """A grow's generation begun (``begin``), and its state adopted; a fault meanwhile
        recovered from."""
        self.membership.inject = partial(writers.faults.maybe_strike_recovery,
                                         step=self.progress.step + 1)
        try:
            change = begin()
            self.adopt(change)
        except PeerFailure as failure:  # a member lost as the group was built: recovered
            return self.recover(writers, evaluated_step, detail=first_line(failure))
        except CannotRecover as e:
            self.membership.fall_back(str(e))
            raise
        log.warning("generation %d: world size %d -> %d at step %d (ranks %s joined); going "
                    "on in process", change.generation, change.old_world_size,
                    change.env.world_size, change.step,
                    ", ".join(str(joined["rank"]) for joined in change.joined))
        return change

    def rollback(self) -> None:
        """Undoes what a step cut short left: its BatchNorm passes' statistics, its gradients
        (garbage where a collective was given up on), evaluation mode."""
        if self.mid_step:
            self.bn_stats.restore()
        self.engine.model.train()
        self.optimizer.zero_grad(set_to_none=True)

    def adopt(self, change: Change) -> None:
        """Joins the new world: the state of the first survivor at the agreed step (the step
        everyone completed, or the one some completed: theirs is whole), then the model in a
        DDP of the new group (the old wrapper retired: :meth:`Engine.retire`)."""
        env = change.env
        self.mid_step = False
        self.leave_policy.reset()
        self.engine.retire()

        group, holds = dist.group.WORLD, env.rank == change.holder  # the new generation's
        # In host memory: pickled GPU tensors would land on the holder's GPU index on every
        # receiver; each receiver loads the state onto its own device.
        state = snapshot(self.state()) if holds else None

        def join() -> tuple[dict[str, Any], list[object]]:
            """The new group's collectives, on the group they are given: the agreed state and
            every rank's digest of it. Nothing here changes this worker: a round given up on
            (the membership then begins the next one, from the state agreed on) may complete
            later, and its state is never loaded."""
            payload = distributed.broadcast_object(state, change.holder, self.device, group)
            return payload, distributed.all_gather_object(state_digest(payload["model"]),
                                                          self.device, group)

        self.membership.inject("adopting the agreed state")
        payload, digests = self.membership.run("adopting the agreed state", join)
        if len(set(digests)) != 1:
            raise CannotRecover(f"the survivors hold different models after agreeing on step "
                                f"{change.step}: {sorted(set(digests))}")
        if not holds:
            self.load_state(payload)
        self.engine.wrap(env, sync=False)  # the same state everywhere: no collective
        # The digests above are of the one payload broadcast, alike on every rank: what this
        # rank now holds is compared with them here, by itself.
        held = state_digest(self.engine.model.state_dict())
        if held != digests[0]:
            raise CannotRecover(f"rank {env.rank} holds another model than the agreed one "
                                f"after adopting step {change.step}: digest {held[:16]}, agreed "
                                f"{str(digests[0])[:16]}")
        self.change, self._agreed_digest, self._regrouped_at = change, digests[0], time.time()
        self.holds_state = True

    def maybe_report_change(self, events: NullEventLog) -> bool:
        """Once the new group's first step is done: the ``shrink`` or ``grow`` record (True),
        else nothing."""
        change, self.change = self.change, None
        if change is None:
            return False
        self.membership.recovered()
        seconds = time.monotonic() - change.detected
        if change.kind == "grow":
            events.emit("grow", change.step, old_world_size=change.old_world_size,
                        new_world_size=change.env.world_size,
                        joined_ranks=[joined["rank"] for joined in change.joined],
                        joined_hosts=[joined["host"] for joined in change.joined],
                        joined=change.joined, restart_generation=change.generation,
                        admission_to_step_s=round(seconds, 3),
                        admitted_time=utc_time(change.detected_at),
                        regrouped_time=utc_time(self._regrouped_at),
                        model_digest=self._agreed_digest)
            log.info("first step after the grow: %.2f s after it began", seconds)
            return True
        events.emit("shrink", change.step, old_world_size=change.old_world_size,
                    new_world_size=change.env.world_size,
                    lost_ranks=[lost["rank"] for lost in change.lost],
                    lost_hosts=[lost["host"] for lost in change.lost],
                    why=change.why, lost=change.lost, restart_generation=change.generation,
                    detection_to_step_s=round(seconds, 3), steps_redone=change.steps_redone,
                    detected_time=utc_time(change.detected_at),
                    regrouped_time=utc_time(self._regrouped_at), model_digest=self._agreed_digest)
        log.info("first step after the change: %.2f s after it was detected", seconds)
        return True
