"""What a checkpoint holds and what a resume may continue from: the payload and its rules.

The payload is everything needed to continue exactly (model, optimizer, progress, RNG, config,
data); :func:`check_compatible` says, in one line, the first way a checkpoint does not fit this
run; :func:`load_state` takes a payload's state onto this process's device and kernels.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import nn

from elastic_mnist.config import OptimConfig, TrainConfig, flag_name
from elastic_mnist.data.datasets import Dataset
from elastic_mnist.data.fingerprint import SHORT
from elastic_mnist.data.order import epoch_number
from elastic_mnist.errors import CheckpointError, ConfigError
from elastic_mnist.rng import restore_rng_state, rng_state

# Config fields that fix which samples each step sees: a checkpoint written under other values
# cannot be continued exactly.
RESUME_INVARIANTS = (("optim", "seed"), ("optim", "global_batch_size"),
                     ("optim", "micro_batch_size"))
# Config fields that a resume takes as they are given, but which continue the run as it was only
# where they are the ones it was written with: a refused resume names them with the invariants.
RESUMED_AS_WRITTEN = (("optim", "lr"), ("optim", "warmup_steps"), ("optim", "weight_decay"))
# Config fields that a node joining a running job must share with its ranks: every one that
# decides the steps, their collectives or the model's state (a joiner with other --epochs would
# stop at another step than the others, one with another --grad-sync join other collectives).
LOCKSTEP = (*(("optim", f.name) for f in fields(OptimConfig)), ("data", "dataset"),
            ("run", "precision"), ("run", "compile"), ("run", "channels_last"),
            ("run", "balance"), ("run", "evict_slower_than"), ("run", "evict_after"))


@dataclass
class Progress:
    """Where training stands; the data cursor is ``cursor`` samples into ``epoch``'s order."""

    step: int = 0
    epoch: int = 0
    cursor: int = 0
    samples_seen: int = 0
    nonfinite_steps: int = 0
    """Steps skipped because their loss or gradients were not finite, in the whole run."""
    nonfinite_in_a_row: int = 0

    def epoch_number(self) -> int:
        """The epoch of the last completed step, counted from 1 (data/order.py)."""
        return epoch_number(self.step, self.epoch, self.cursor)

    def become(self, other: Progress) -> None:
        """Takes ``other``'s values in place: whoever holds this progress sees them."""
        for name, value in asdict(other).items():
            setattr(self, name, value)


def payload(model: nn.Module, optimizer: torch.optim.Optimizer, progress: Progress,
            device: torch.device, cfg: TrainConfig, dataset: Dataset, world_size: int,
            run_id: str) -> dict[str, Any]:
    """Everything needed to continue exactly: the payload of a checkpoint."""
    return {
        "format": 1,
        "model": model.state_dict(),  # the unwrapped module, never the DDP wrapper
        "optimizer": optimizer.state_dict(),
        "progress": asdict(progress),
        "rng": rng_state(device),  # this device's CUDA generator, not every GPU's
        "config": cfg.to_dict(),
        "data": {"kind": dataset.kind, "num_train": len(dataset.train),
                 "fingerprint": dataset.fingerprint},
        "world_size": world_size,
        "run_id": run_id,
    }


def load_state(payload: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer,
               cfg: TrainConfig, device: torch.device) -> Progress:
    """Takes the state of a payload (a checkpoint's, or a peer's after a change) into ``model``
    and ``optimizer`` and this device's RNG; returns its progress."""
    model.load_state_dict(payload["model"])
    saved = payload["optimizer"]
    kernels = {key: optimizer.defaults[key] for key in ("fused", "foreach")}
    # This device's kernels, whatever device saved the state (set before the load, which
    # places each parameter's step count where the fused kernel wants it).
    optimizer.load_state_dict({**saved, "param_groups": [
        {**group, **kernels} for group in saved["param_groups"]]})
    for group in optimizer.param_groups:  # flags may change between launches
        group["weight_decay"] = cfg.optim.weight_decay
    progress = Progress(**payload["progress"])
    restore_rng_state(payload["rng"], device)
    return progress


def check_compatible(payload: dict[str, Any], model: nn.Module, cfg: TrainConfig,
                     dataset: Dataset, source: str) -> None:
    """Raises CheckpointError naming the first mismatch between a checkpoint and this run."""
    theirs, ours = payload["model"], model.state_dict()
    if set(theirs) != set(ours):
        missing, extra = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
        raise CheckpointError(f"{source} is from a different model: missing {missing[:3]}, "
                              f"unexpected {extra[:3]}")
    for key, tensor in ours.items():
        if tuple(theirs[key].shape) != tuple(tensor.shape):
            raise CheckpointError(f"{source} is from a different model: {key} has shape "
                                  f"{tuple(theirs[key].shape)}, this model {tuple(tensor.shape)}")
    differs = [(section, name) for section, name in RESUME_INVARIANTS
               if payload["config"][section][name] != getattr(getattr(cfg, section), name)]
    if differs:
        raise CheckpointError(invariants_differ(payload["config"], cfg, source, differs))
    data = payload["data"]
    if (data["kind"], data["num_train"]) != (dataset.kind, len(dataset.train)):
        raise CheckpointError(f"{source} was trained on {data['num_train']} {data['kind']} "
                              f"samples, this run has {len(dataset.train)} {dataset.kind}")
    # Checkpoints written before fingerprints existed lack one: nothing to compare.
    if data.get("fingerprint", dataset.fingerprint) != dataset.fingerprint:
        raise CheckpointError(f"{source} was trained on other digits (fingerprint "
                              f"{data['fingerprint'][:SHORT]}, this run's data "
                              f"{dataset.fingerprint[:SHORT]} in {dataset.root}); use the same "
                              f"data or another --checkpoint-dir")


def invariants_differ(written: dict[str, Any], cfg: TrainConfig, source: str,
                      differs: list[tuple[str, str]]) -> str:
    """One line: the flags ``source`` was written with that this run contradicts, and the flags
    that continue that run as it was (its optimisation too, where this run's differs: a change
    of defaults would otherwise change it unseen)."""
    now = cfg.to_dict()

    def flags(names: list[tuple[str, str]], config: dict[str, Any]) -> str:
        return " ".join(f"{flag_name(name)} {config[section][name]}" for section, name in names)

    tuning = [(section, name) for section, name in RESUMED_AS_WRITTEN
              if written[section][name] != now[section][name]]
    return (f"{source} was written with {flags(differs, written)}, this run has "
            f"{flags(differs, now)}: pass {flags(differs + tuning, written)} to continue that "
            f"run, or use another --checkpoint-dir")


def check_lockstep(theirs: dict[str, Any], cfg: TrainConfig) -> None:
    """Raises ConfigError naming the first flag (of LOCKSTEP) where ``cfg`` differs from the
    config ``theirs`` of the job that this node joins. A flag the job does not name is one its
    version did not have: it runs as that flag's default."""
    default = TrainConfig()
    for section, name in LOCKSTEP:
        was = theirs.get(section, {}).get(name, getattr(getattr(default, section), name))
        now = getattr(getattr(cfg, section), name)
        if was != now:
            raise ConfigError(f"the job this node joins runs with {flag_name(name)}={was}, this "
                              f"node with {now}: start it with the job's flags")
