"""BatchNorm running statistics that depend on the global batch, not on how ranks share it.

In training mode BatchNorm normalises each micro-batch by that micro-batch's own statistics, which
are the same at every world size because micro-batches are. Its *running* statistics, though, are
updated by every forward pass of every rank in turn, so they would depend on which rank saw which
micro-batch. Here the layers' own updates are switched off (momentum 0), each micro-batch's mean
and variance are recorded, summed over all ranks with the step's other scalars, and applied once
per optimizer step, identically on every rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


class GlobalBatchNormStats:
    """Per-step, world-size-independent running statistics for every BatchNorm in a model."""

    def __init__(self, model: nn.Module):
        self.layers = [m for m in model.modules()
                       if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
        self.momenta = [m.momentum for m in self.layers]
        for layer in self.layers:
            layer.momentum = 0.0  # the layer leaves its running stats alone; apply() updates them
            layer.register_forward_pre_hook(self._record)
        self.recording = False
        self._sums: dict[nn.Module, torch.Tensor] = {}
        self._tracked: list[torch.Tensor] = []

    @property
    def width(self) -> int:
        """Length of this step's vector of sums: per layer, weighted means, variances, count."""
        return sum(2 * layer.num_features + 1 for layer in self.layers)

    def begin_step(self) -> None:
        self._sums = {}
        self._tracked = [layer.num_batches_tracked.clone() for layer in self.layers]

    @contextlib.contextmanager
    def record(self, enabled: bool = True) -> Iterator[None]:
        """Forward passes inside the block count towards this step's statistics if ``enabled``."""
        self.recording = enabled
        try:
            yield
        finally:
            self.recording = False

    def _record(self, layer: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        if not (self.recording and layer.training):
            return
        with torch.no_grad():
            x = args[0].detach().float()
            dims = [0, *range(2, x.dim())]
            count = x.numel() // x.shape[1]
            mean = x.mean(dims)
            var = x.var(dims, correction=1) if count > 1 else torch.zeros_like(mean)
            sums = torch.cat([mean * count, var * count, mean.new_tensor([count])]).double()
        self._sums[layer] = self._sums[layer] + sums if layer in self._sums else sums

    def local_sums(self, device: torch.device) -> torch.Tensor:
        """This rank's sums, to be all-reduced (zeros for layers it did not run)."""
        parts = [self._sums.get(layer, torch.zeros(2 * layer.num_features + 1, dtype=torch.float64,
                                                   device=device))
                 for layer in self.layers]
        return torch.cat(parts).to(device) if parts else torch.zeros(0, device=device)

    @torch.no_grad()
    def apply(self, global_sums: torch.Tensor) -> None:
        """Updates running stats from the sums over all ranks: one momentum step per optimizer step."""
        offset = 0
        for layer, momentum, tracked in zip(self.layers, self.momenta, self._tracked):
            c = layer.num_features
            chunk = global_sums[offset:offset + 2 * c + 1]
            offset += 2 * c + 1
            count = chunk[-1]
            # One per optimizer step, however many forward passes this rank made.
            layer.num_batches_tracked.copy_(tracked + 1)
            if count <= 0:
                continue
            mean, var = chunk[:c] / count, chunk[c:2 * c] / count
            layer.running_mean.mul_(1 - momentum).add_(mean.to(layer.running_mean), alpha=momentum)
            layer.running_var.mul_(1 - momentum).add_(var.to(layer.running_var), alpha=momentum)
