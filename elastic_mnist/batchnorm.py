"""BatchNorm running statistics that depend on the global batch, not on how ranks share it.

In training mode BatchNorm normalises each micro-batch by that micro-batch's own statistics, which
are the same at every world size because micro-batches are. Its *running* statistics, though, are
updated by every forward pass of every rank in turn, so they would depend on which rank saw which
micro-batch. Here each micro-batch's mean and variance are recorded, summed over all ranks with the
step's other scalars, and applied once per optimizer step, identically on every rank.

The statistics cost nothing to record: with momentum 1 a training pass leaves exactly its batch's
mean and (unbiased) variance in the layer's running buffers, computed by the BatchNorm kernel
itself, and a hook after the layer reads them there. The true running statistics are set aside at
the start of a step and restored, updated, at its end; training passes therefore belong between
:meth:`begin_step` and :meth:`apply`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


class GlobalBatchNormStats:
    """Per-step, world-size-independent running statistics for every BatchNorm in a model."""

    def __init__(self, model: nn.Module, compiled: bool = False):
        """``compiled``: the model runs under torch.compile, whose graphs must not swallow the
        hook (its results outlive the pass, which CUDA graphs would overwrite)."""
        self.layers = [m for m in model.modules()
                       if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
        self.momenta = [m.momentum for m in self.layers]
        hook = torch.compiler.disable(self._record) if compiled else self._record
        for layer in self.layers:
            layer.momentum = 1.0  # a pass leaves its batch statistics in the running buffers
            layer.register_forward_hook(hook)
        self.recording = False
        self._sums: dict[nn.Module, torch.Tensor] = {}
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        """Per layer: its running means and variances, and batches tracked, at the step's start."""

    def begin_step(self) -> None:
        """Sets the running statistics aside; the step's passes overwrite the buffers."""
        self._sums = {}
        self._saved = [(torch.cat([layer.running_mean, layer.running_var]),
                        layer.num_batches_tracked.clone()) for layer in self.layers]

    @contextlib.contextmanager
    def record(self, enabled: bool = True) -> Iterator[None]:
        """Forward passes inside the block count towards this step's statistics if ``enabled``."""
        self.recording = enabled
        try:
            yield
        finally:
            self.recording = False

    def _record(self, layer: nn.Module, inputs: tuple[torch.Tensor, ...], _: object) -> None:
        if not (self.recording and layer.training):
            return
        count = inputs[0].numel() // inputs[0].shape[1]
        with torch.no_grad():
            stats = torch.cat([layer.running_mean, layer.running_var,
                               layer.running_mean.new_ones(1)])
            sums = stats.double().mul_(count)
        self._sums[layer] = self._sums[layer] + sums if layer in self._sums else sums

    def local_sums(self, device: torch.device) -> torch.Tensor:
        """This rank's sums, to be all-reduced (zeros for layers it did not run)."""
        parts = [self._sums.get(layer, torch.zeros(2 * layer.num_features + 1, dtype=torch.float64,
                                                   device=device))
                 for layer in self.layers]
        return torch.cat(parts).to(device) if parts else torch.zeros(0, device=device)

    @torch.no_grad()
    def apply(self, global_sums: torch.Tensor) -> None:
        """Updates running stats from the sums over all ranks: one momentum step per optimizer step.

        Without a branch on the sums' values, which would wait for a GPU to finish the step.
        """
        offset = 0
        for layer, momentum, (saved, tracked) in zip(self.layers, self.momenta, self._saved):
            c = layer.num_features
            chunk = global_sums[offset:offset + 2 * c + 1]
            offset += 2 * c + 1
            count = chunk[-1:]
            # Weight 0 where no rank ran the layer (count 0): the saved statistics come back.
            weight = (count > 0).to(saved.dtype) * momentum
            updated = saved.lerp(chunk[:-1].div(count.clamp(min=1)).to(saved.dtype), weight)
            layer.running_mean.copy_(updated[:c])
            layer.running_var.copy_(updated[c:])
            # One per optimizer step, however many forward passes this rank made.
            layer.num_batches_tracked.copy_(tracked + 1)

    @torch.no_grad()
    def restore(self) -> None:
        """Puts back the statistics set aside at the step's start: for a step that is skipped."""
        for layer, (saved, tracked) in zip(self.layers, self._saved):
            c = layer.num_features
            layer.running_mean.copy_(saved[:c])
            layer.running_var.copy_(saved[c:])
            layer.num_batches_tracked.copy_(tracked)
