"""Going on after a change of membership, in process: rollback, one agreed state, the new world.

A step cut short is undone (:meth:`Regroup.rollback`); the survivors agree on a step through the
membership and take the state of the first one that completed it, checking by digest that every
survivor holds the same model (:meth:`Regroup.adopt`); what the agreed step still owes (its
evaluation, its checkpoint) is done before the next step (:meth:`Regroup.catch_up`), and the first
step after the change reports it (:meth:`Regroup.report_change`). The leave policy says when
ranks that asked to stop leave while the others go on (:class:`LeavePolicy`).
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any

import torch.distributed as dist

from elastic_mnist import distributed
from elastic_mnist.checkpoint import snapshot
from elastic_mnist.errors import CannotRecover, PeerFailure
from elastic_mnist.events import utc_time
from elastic_mnist.model import state_digest
from elastic_mnist.resilience.agreement import Change, Position

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
    """The Trainer's recovery in process, mixed into it."""

    def position(self) -> Position:
        return Position(step=self.progress.step, mid_step=self.mid_step,
                        evaluated_step=self.last_eval_step)

    def recover(self, why: str = "died", suspects: tuple[int, ...] = (), detail: str = "") -> None:
        """Goes on with the ranks that are left: one agreed state, a new group, rank 0's duties
        where they now belong. Raises CannotRecover when this rank cannot go on."""
        self.writers.watchdog.close(wait=False)  # it watched the group that is gone
        self.membership.inject = partial(self.writers.faults.maybe_strike_recovery,
                                         step=self.progress.step + 1)
        while True:
            self.rollback()
            try:
                change = self.membership.recover(self.position(), why, suspects, detail)
                self.adopt(change)
                break
            except PeerFailure as failure:  # the new group lost a member too: the next round
                why, suspects, detail = "died", (), str(failure).strip().splitlines()[0]
            except CannotRecover as e:
                self.membership.fall_back(str(e))
                raise
        log.warning("generation %d: world size %d -> %d at step %d (ranks %s %s); going on in "
                    "process", change.generation, change.old_world_size, change.env.world_size,
                    change.step, ", ".join(str(lost["rank"]) for lost in change.lost) or "none",
                    change.why)
        self.take(self.after_change(change))
        self.owed = change

    def rollback(self) -> None:
        """Undoes what a step cut short left: its BatchNorm passes' statistics, its gradients
        (garbage where a collective was given up on), evaluation mode."""
        if self.mid_step:
            self.bn_stats.restore()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)

    def adopt(self, change: Change) -> None:
        """Joins the new world: the state of the first survivor at the agreed step (the step
        everyone completed, or the one some completed: theirs is whole), then the model in a
        DDP of the new group (the old wrapper retired: :meth:`Engine.retire`)."""
        self.env, self.restart_generation = change.env, change.generation
        self.mid_step = False
        self.leave_policy.reset()
        self.engine.retire()

        group, holds = dist.group.WORLD, self.env.rank == change.holder  # the new generation's
        # In host memory: pickled GPU tensors would land on the holder's GPU index on every
        # receiver; each receiver loads the state onto its own device.
        state = snapshot(self.state()) if holds else None

        def join() -> tuple[dict[str, Any], list[object]]:
            """The new group's collectives, on the group they are given: the agreed state and
            every rank's digest of it. Nothing here changes this trainer: a round given up on
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
        self.engine.wrap(self.env, sync=False)  # the same state everywhere: no collective
        # The digests above are of the one payload broadcast, alike on every rank: what this
        # rank now holds is compared with them here, by itself.
        held = state_digest(self.model.state_dict())
        if held != digests[0]:
            raise CannotRecover(f"rank {self.env.rank} holds another model than the agreed one "
                                f"after adopting step {change.step}: digest {held[:16]}, agreed "
                                f"{str(digests[0])[:16]}")
        self.new_world()
        self.change, self._agreed_digest, self._regrouped_at = change, digests[0], time.time()

    def catch_up(self, change: Change) -> None:
        """What the agreed step still owes when the fault came after it: its evaluation (unless
        rank 0 has it) and its checkpoint."""
        ended = self.progress.cursor == 0 and self.progress.step > 0
        if (ended or self.done()) and change.evaluated_step != self.progress.step:
            self.log_evaluation()
        self.maybe_checkpoint(ended, final=self.done())
        self.owed = None

    def report_change(self) -> None:
        """Once the new group's first step is done: the ``shrink`` record."""
        change, self.change = self.change, None
        self.membership.recovered()
        seconds = time.monotonic() - change.detected
        self.writers.events.emit("shrink", change.step, old_world_size=change.old_world_size,
                                 new_world_size=self.env.world_size,
                                 lost_ranks=[lost["rank"] for lost in change.lost],
                                 lost_hosts=[lost["host"] for lost in change.lost],
                                 why=change.why, lost=change.lost,
                                 restart_generation=change.generation,
                                 detection_to_step_s=round(seconds, 3),
                                 steps_redone=change.steps_redone,
                                 detected_time=utc_time(change.detected_at),
                                 regrouped_time=utc_time(self._regrouped_at),
                                 model_digest=self._agreed_digest)
        log.info("first step after the change: %.2f s after it was detected", seconds)
