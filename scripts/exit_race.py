"""Shows why a worker ends with ``distributed.end_process`` rather than a normal interpreter exit.

Each launch is torchrun with ``--nproc`` workers that wrap a model in DDP, run a few gloo
all-reduces, destroy the process group and exit, while ``--load`` busy processes compete for the
cores. Half the launches exit the normal way, half through ``end_process``, alternating. A launch
counts as aborted when it exits non-zero or a worker prints "terminate called".

    .venv/bin/python scripts/exit_race.py --launches 20
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from processes import job_env

REPO = Path(__file__).resolve().parent.parent

WORKER = """
import sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 3))
for _ in range(3):
    dist.all_reduce(torch.ones(1000))
del model
dist.destroy_process_group()
if sys.argv[1] == "end_process":
    from elastic_mnist.distributed import end_process

    end_process(0)
"""

MODES = ("finalize", "end_process")


def spin() -> None:
    while True:
        pass


def launch(script: Path, mode: str, nproc: int) -> bool:
    """True if the launch aborted."""
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={nproc}", "--monitor_interval=0.1", str(script), mode],
        cwd=REPO, env=job_env(PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=120,
        check=False)
    return done.returncode != 0 or "terminate called" in done.stdout + done.stderr


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=20, help="per mode (default: 20)")
    parser.add_argument("--nproc", type=int, default=4, help="workers per launch (default: 4)")
    parser.add_argument("--load", type=int, default=os.cpu_count(),
                        help="busy processes beside the launches (default: one per core)")
    args = parser.parse_args(argv)

    busy = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.load)]
    for proc in busy:
        proc.start()
    aborted = dict.fromkeys(MODES, 0)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            script = Path(tmp) / "worker.py"
            script.write_text(WORKER)
            for i in range(args.launches):
                for mode in MODES if i % 2 == 0 else MODES[::-1]:
                    aborted[mode] += launch(script, mode, args.nproc)
    finally:
        for proc in busy:
            proc.kill()
    for mode in MODES:
        print(f"{mode}: {aborted[mode]} of {args.launches} launches aborted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
