#!/usr/bin/env python3
"""Checks what scripts/gpu_check.sh's smoke test left: two launches of ``elastic-mnist train``
under torchrun, the second resumed from the first's last checkpoint.

    scripts/check_smoke.py DIR --steps N --world-size W --device D [--out smoke.json]

DIR holds ckpt/, runs/smoke/ and launch{1,2}.log. It fails (exit 1, each failed check printed)
unless: the newest checkpoint is valid, of step 2N, written at world size W; the run's events say
two starts at world size W, the second resumed from step N, finishes at steps N and 2N with a
test accuracy, and no hang or non-finite step; the workers ran on D; the second launch's log says it
resumed. Writes every check and its outcome to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from elastic_mnist.checkpoint import deserialize, list_manifests, read_verified
from elastic_mnist.errors import CheckpointError, InvalidCheckpoint
from elastic_mnist.events import read_events


def checks(folder: Path, steps: int, world_size: int, device: str) -> dict[str, bool]:
    """Each check's description and whether it held."""
    found: dict[str, bool] = {}
    manifests = [m for m in list_manifests(folder / "ckpt") if not isinstance(m, tuple)]
    newest = manifests[0] if manifests else None
    try:
        valid = newest is not None and "model" in deserialize(
            read_verified(folder / "ckpt", newest), newest.file)
    except (InvalidCheckpoint, CheckpointError):
        valid = False
    found[f"the newest checkpoint is valid, of step {2 * steps}, at world size {world_size}"] = (
        valid and (newest.step, newest.world_size) == (2 * steps, world_size))
    run_dir = folder / "runs" / "smoke"
    events = read_events(run_dir / "events.jsonl") if (run_dir / "events.jsonl").exists() else []
    starts = [e for e in events if e["event"] == "start"]
    found[f"two starts at world size {world_size}, the second resumed from step {steps}"] = (
        [(s["world_size"], s["resumed_from_step"]) for s in starts]
        == [(world_size, None), (world_size, steps)])
    finishes = [e for e in events if e["event"] == "finish"]
    found[f"finishes at steps {steps} and {2 * steps}, with a test accuracy"] = (
        [e["step"] for e in finishes] == [steps, 2 * steps]
        and all(isinstance(e["test_accuracy"], float) for e in finishes))
    found["no hang and no non-finite step"] = not [e for e in events
                                                  if e["event"] in ("hang", "nonfinite")]
    train_log = (run_dir / "train.log").read_text() if (run_dir / "train.log").exists() else ""
    found[f"rank 0 ran on {device}"] = f" on {device}" in train_log
    second = folder / "launch2.log"
    found["the second launch resumed"] = second.exists() and "resumed from" in second.read_text()
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not (args.folder / "ckpt").is_dir():
        print(f"check_smoke: {args.folder / 'ckpt'} is not a folder", file=sys.stderr)
        return 2
    found = checks(args.folder, args.steps, args.world_size, args.device)
    passed = all(found.values())
    if args.out is not None:
        args.out.write_text(json.dumps({"device": args.device, "world_size": args.world_size,
                                        "steps": [args.steps, 2 * args.steps],
                                        "checks": found, "passed": passed}, indent=2) + "\n")
    for check, held in found.items():
        print(f"smoke: {'ok' if held else 'FAILED'}: {check}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
