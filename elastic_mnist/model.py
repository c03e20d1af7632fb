"""The classic MNIST ConvNet: two conv-BN-ReLU-maxpool blocks of 16 and 32 channels, one Linear."""

from __future__ import annotations

import hashlib

import torch
from torch import nn


class ConvNet(nn.Module):
    """28x28x1 → conv5x5(16)-BN-pool2-ReLU → conv5x5(32)-BN-pool2-ReLU → Linear(1568, 10).

    The convolutions carry no bias: the BatchNorm after each one cancels it anyway, and a
    parameter whose true gradient is zero only turns rounding noise into Adam updates.

    Each block pools before its ReLU, which is the classic conv-BN-ReLU-pool to the last bit:
    max-pooling and ReLU commute, values and gradients alike (both only select or zero elements),
    and the ReLU then touches a quarter of the elements, forward and backward.
    """

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.layer1 = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=5, stride=1, padding=2, bias=False),
            nn.BatchNorm2d(16),
            nn.MaxPool2d(kernel_size=2, stride=2),
            nn.ReLU(),
        )
        self.layer2 = nn.Sequential(
            nn.Conv2d(16, 32, kernel_size=5, stride=1, padding=2, bias=False),
            nn.BatchNorm2d(32),
            nn.MaxPool2d(kernel_size=2, stride=2),
            nn.ReLU(),
        )
        self.fc = nn.Linear(7 * 7 * 32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(x))
        return self.fc(x.flatten(1))


def build_model(seed: int) -> ConvNet:
    """The ConvNet initialised from ``seed`` alone, on the CPU; every generator is left as it was
    (``torch.manual_seed`` would reseed each GPU's too, which nothing here restores)."""
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)
        return ConvNet()


def state_digest(state_dict: dict[str, torch.Tensor]) -> str:
    """sha256 over the tensors in sorted key order (raw bytes of each contiguous CPU tensor)."""
    h = hashlib.sha256()
    for key in sorted(state_dict):
        tensor = state_dict[key].detach().cpu().contiguous()
        h.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
