"""The loop's collectives: each waited on through the membership's guard, inside the watchdog's
waiting mark.

A rank waiting here waits for its peers, not hanging them: the watchdog's verdicts depend on these
marks being exactly around the waits (and on work of this rank alone being marked busy, not
waiting). When the group loses a rank, the guard ends the wait even if the collective never
returns (membership.py), and a group that is gone fails the collective instead of handing back
this rank's own values as the sum.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from elastic_mnist import distributed
from elastic_mnist.env import DistEnv
from elastic_mnist.errors import PeerFailure
from elastic_mnist.resilience.faces import NullMembership
from elastic_mnist.resilience.watchdog import NullWatchdog


def require_group() -> None:
    """Raises PeerFailure when this process has no process group any more: torch clears the
    default group when a generation's NCCL communicator is aborted (``Membership.abort``), and
    a collective skipped for want of a group would hand back this rank's own values."""
    if not dist.is_initialized():
        raise PeerFailure("the process group is gone (its generation was aborted)")


class PlainComm:
    """Collectives as torch.distributed runs them, unguarded and unmarked: the evaluation
    outside the training loop (``elastic-mnist evaluate``, probes)."""

    def busy(self, what: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def waiting(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        return distributed.all_reduce_(tensor)


class Comm(PlainComm):
    """One generation's collectives: its world, the membership's guard, its watchdog's marks."""

    def __init__(self, env: DistEnv, membership: NullMembership, watchdog: NullWatchdog):
        self.env, self.membership, self.watchdog = env, membership, watchdog

    def busy(self, what: str) -> contextlib.AbstractContextManager:
        """Work of this rank alone that may take long (saving, evaluating): not a hang."""
        return self.watchdog.busy(what)

    def waiting(self) -> contextlib.AbstractContextManager:
        """Waiting for the peers: in a collective, or in the read of its result (NCCL)."""
        return self.watchdog.waiting()

    def waiting_if(self, waits: bool) -> contextlib.AbstractContextManager:
        return self.watchdog.waiting() if waits else contextlib.nullcontext()

    def wait(self, future: torch.futures.Future):
        """The value of ``future``, waited on through the membership, marked as a wait."""
        with self.watchdog.waiting():
            return self.membership.guard(future).wait()

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums ``tensor`` over the ranks in place, waited on through the membership: the wait
        ends when the group loses a rank, even if the collective never returns. In a world of
        more than one, a group that is gone fails it too: never this rank's values as the sum."""
        if self.env.world_size > 1:
            require_group()
            self.wait(dist.all_reduce(tensor, async_op=True).get_future())
        return tensor
