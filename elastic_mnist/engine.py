"""The model as the loop runs it: built, in DDP on the current group, compiled, autocast.

The engine owns everything between "the model" and "the step's gradients, summed": DDP wrapping
and its communication hook (which sums and notes this rank's own non-finite gradients), DDP's one
regrouping of its buckets (in a thread of its own, waited on through the comm), torch.compile
and the micro-batch sizes it has compiled for, bf16 autocast, ``no_sync`` while accumulating,
the wait for this rank's own kernels, and the wrappers of groups left behind. This room names
torch's private DDP internals, each with why.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from elastic_mnist.comm import Comm, require_group
from elastic_mnist.config import TrainConfig
from elastic_mnist.env import DistEnv
from elastic_mnist.fast_path import choose_compilation, micro_batches_per_rank, set_float32_math
from elastic_mnist.model import build_model
from elastic_mnist.resilience.faces import NullMembership

log = logging.getLogger(__name__)


class GradCheck:
    """The DDP hook's state: whether this rank's own gradients (before the sum) are finite, the
    membership whose guard the sum is waited on through, and where this rank's own work of the
    step ends and the sum begins: on a GPU an event recorded there (timed from ``started``, one
    recorded as the step's own work begins), on the CPU the time (``time.perf_counter()``)."""

    def __init__(self, device: torch.device, membership: NullMembership):
        self.group = None  # the default process group
        self.nonfinite = torch.zeros((), dtype=torch.bool, device=device)
        self.membership = membership
        cuda = device.type == "cuda"
        self.started = torch.cuda.Event(enable_timing=True) if cuda else None
        self.computed = torch.cuda.Event(enable_timing=True) if cuda else None
        self.computed_at: float | None = None


def sum_allreduce_hook(state, bucket):
    """DDP communication hook that sums gradients (the loss is already divided by the batch),
    noting first whether this rank's own gradients hold NaN or infinity (without a sync).

    A group of one has nothing to sum: its bucket comes back as it is, without a round trip
    through the backend's threads (which costs whole milliseconds on a busy machine).

    Unannotated on purpose: DDP checks the annotations' runtime values, which postponed
    annotations turn into strings.
    """
    state.nonfinite |= ~torch.isfinite(bucket.buffer()).all()
    if state.computed is not None:
        state.computed.record()  # the step's own kernels are queued before it: see own_work_done
    state.computed_at = time.perf_counter()  # on the CPU, the step's own work ends here
    require_group()
    if dist.get_world_size(state.group) == 1:
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done
    work = dist.all_reduce(bucket.buffer(), group=state.group, async_op=True)
    return state.membership.guard(work.get_future()).then(lambda fut: fut.value()[0])


class Engine:
    """The model of one worker and the wrapper the loop runs it in, for the current group."""

    def __init__(self, cfg: TrainConfig, device: torch.device, membership: NullMembership):
        """Builds the model (not yet wrapped: :meth:`wrap`, once what hooks into it is set)."""
        self.cfg, self.device = cfg, device
        if device.type == "cuda":
            torch.backends.cudnn.benchmark = True  # shapes never change: autotune once
        self.float32_math = set_float32_math(cfg.run.precision)
        self.model = build_model(cfg.optim.seed).to(device)
        if cfg.run.channels_last:
            self.model.to(memory_format=torch.channels_last)
        self.grad_check = GradCheck(device, membership)
        self.ddp: DistributedDataParallel | None = None
        self.net: nn.Module = self.model
        self._retired: list[nn.Module] = []
        """Wrappers of groups left behind: gloo's threads may still wait in them."""
        self.compiled_sizes: set[int] = set()
        """Micro-batch sizes this process has run compiled; a new one recompiles."""

    def wrap(self, env: DistEnv, sync: bool = True) -> None:
        """The model as the loop runs it: in DDP on the current group (under torchrun, even
        alone, unless the gradients are synced by hand), compiled if asked. ``sync``: rank 0's
        parameters everywhere first (DDP's collectives at construction, or a broadcast by hand),
        which a recovery does without: its ranks took one agreed state."""
        self.env = env
        grad_sync_ddp = env.is_distributed and self.cfg.optim.grad_sync == "ddp"
        if sync and env.world_size > 1 and not grad_sync_ddp:
            for tensor in self.model.state_dict().values():
                dist.broadcast(tensor, src=0)
        ddp = None
        if grad_sync_ddp:
            with warnings.catch_warnings():  # its successor would sync buffers at start-up
                warnings.filterwarnings("ignore", message=".*broadcast_buffers.*deprecated")
                ddp = DistributedDataParallel(
                    self.model,
                    device_ids=[self.device.index] if self.device.type == "cuda" else None,
                    broadcast_buffers=False,  # GlobalBatchNormStats keeps buffers equal
                    bucket_cap_mb=1,  # one bucket: all gradients are 116 kB
                    gradient_as_bucket_view=True,  # no copy between gradients and bucket
                    init_sync=sync)
            ddp.register_comm_hook(self.grad_check, sum_allreduce_hook)
        self.buckets_rebuilt = ddp is None
        """DDP's one regrouping of its buckets, after its first backward, is done."""
        net: nn.Module = ddp if ddp is not None else self.model
        o = self.cfg.optim  # the micro-batches per rank change with the world size: chosen anew
        self.compilation = choose_compilation(
            self.device.type, micro_batches_per_rank(o.global_batch_size, o.micro_batch_size,
                                                     env.world_size), self.cfg.run.compile)
        if self.compilation.mode is not None:  # with or without CUDA graphs: fast_path.py
            net = torch.compile(net, mode=self.compilation.mode)
        self.ddp, self.net = ddp, net
        self.compiled_sizes = set()

    def retire(self) -> None:
        """Leaves the current wrapper behind (a group is gone). It is kept, never freed: the old
        group's threads may still hold its buffers. Its hooks on the parameters go: each takes
        its reducer's lock, which a thread left waiting in that group (:meth:`rebuild_buckets`)
        may hold."""
        self._retired.append(self.net)
        if self.ddp is not None:
            self.ddp.reducer._remove_autograd_hooks()  # torch private: no public way to unhook
            self.ddp = None

    def compiling(self, micro_batches: Callable[[], list[torch.Tensor]],
                  mine: Callable[[list[torch.Tensor]], list[torch.Tensor]],
                  comm: Comm) -> contextlib.AbstractContextManager:
        """Under --compile, a step that gives this rank a micro-batch size it has not run yet (an
        epoch's short last micro-batch) recompiles the model: seconds of work of its own, which
        the watchdog must not take for a hang. ``micro_batches`` splits the step's batch, asked
        only under --compile; ``mine`` gives this rank's share of them (balance.py), as the step
        will."""
        if self.compilation.mode is None:
            return contextlib.nullcontext()
        split = micro_batches()
        sizes = {len(m) for m in mine(split) or split[:1]}
        if sizes <= self.compiled_sizes:
            return contextlib.nullcontext()
        self.compiled_sizes |= sizes
        return comm.busy("compiling")

    def autocast(self) -> torch.autocast:
        """The forward pass in bf16 under ``--precision bf16``, else as it is."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16,
                              enabled=self.cfg.run.precision == "bf16")

    def sync_gradients(self, last_micro_batch: bool) -> contextlib.AbstractContextManager:
        """DDP syncs gradients on a rank's last micro-batch only (accumulating before it)."""
        if self.ddp is None or last_micro_batch:
            return contextlib.nullcontext()
        return self.ddp.no_sync()

    def backward_waits(self, last_micro_batch: bool) -> bool:
        """Whether this backward waits for the peers: DDP's sum runs in the last one."""
        return last_micro_batch and self.ddp is not None

    def begin_step(self, comm: Comm) -> None:
        """Before a step's first pass: DDP's buckets regrouped if due, no non-finite noted, and
        this rank's own work of the step begins (:meth:`own_work_done` times it)."""
        if not self.buckets_rebuilt:
            self.rebuild_buckets(comm)
        self.grad_check.nonfinite.zero_()
        self.work_began, self.grad_check.computed_at = time.perf_counter(), None
        if self.grad_check.started is not None:
            self.grad_check.started.record()

    def rebuild_buckets(self, comm: Comm) -> None:
        """DDP regroups its buckets once, in the order its first backward made the gradients
        ready, at the next forward, by a broadcast from rank 0 that blocks and that nothing can
        give up on: a peer lost meanwhile ends this rank (gloo: "Connection reset by peer"), a
        frozen one holds it until the group's timeout. Done here instead, as DDP's own join hook
        does it, in a thread of its own, waited on through the membership like the step's other
        collectives (the thread of a group given up on is left to gloo's timeout)."""
        ddp, done = self.ddp, torch.futures.Future()

        def rebuild() -> None:
            try:  # torch private: the reducer's own regrouping, as DDP's join hook calls it
                done.set_result(ddp.reducer._rebuild_buckets())
            except Exception as e:  # noqa: BLE001 - the backend's error, handed to the waiter
                done.set_exception(e)

        threading.Thread(target=rebuild, daemon=True, name="ddp-rebuild-buckets").start()
        rebuilt = comm.wait(done)
        if rebuilt:  # False before the first backward: nothing to regroup yet
            # torch private: tells DDP's forward the regrouping is done (not to do it again)
            self.buckets_rebuilt = ddp._has_rebuilt_buckets = True

    def own_work_done(self) -> float:
        """On a GPU, waits for this rank's own kernels of the step before the waits for its peers
        (marked by the watchdog): a device that never finishes its own share blocks here,
        unmarked, and is named, not taken for one waiting. Under DDP the sum was launched in the
        backward already, after an event the hook recorded: only the work before it is waited
        for. Else nothing of the peers is queued yet.

        Returns the seconds of this rank's own work of the step, without its wait for the
        peers (pace.py): from :meth:`begin_step` to the hook (under DDP, whose sum waits inside
        the backward), else to now; on a GPU between its events (no further sync)."""
        check = self.grad_check
        if self.device.type != "cuda" or self.env.world_size == 1:
            return (check.computed_at or time.perf_counter()) - self.work_began
        if self.ddp is None:
            check.computed.record()
            torch.cuda.synchronize(self.device)
        else:
            check.computed.synchronize()  # the step's own kernels, up to the sum
        return check.started.elapsed_time(check.computed) / 1e3

    def nonfinite_gradients(self, comm: Comm) -> torch.Tensor:
        """Whether this rank's own gradients hold NaN or infinity, then the gradients summed:
        DDP's hook looked before its sum; the seeds' hand-written sync (``--grad-sync
        allreduce``) looks here, then sums."""
        if self.ddp is not None:
            return self.grad_check.nonfinite
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        nonfinite = ~torch.isfinite(torch.nn.utils.get_total_norm(grads))
        if self.env.world_size > 1:
            for param in self.model.parameters():
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                comm.all_reduce_(param.grad)
        return nonfinite
