#!/usr/bin/env python3
"""scripts/gpu_check.sh's steps: the GPU claims' checks, the most decisive first, each in a time
bound of its own, inside one budget (8 minutes by default, for one H200).

    scripts/gpu_check.sh [OUT_DIR] [--budget S] [--bound STEP=S ...] [--dry-run] [bench flags]

OUT_DIR (default bench/gpu, which git keeps) receives, as the run goes: summary.json, rewritten at
every step's start and end with each step's outcome, seconds and checks (a run cut off still
says what it measured, and which step it was in), gpu_check.log (everything printed),
smoke.json, results.json and table.md (the bench's): five files. A failed or timed-out step does not stop the next; the
exit status is 1 when any step failed or timed out.

The steps, on one GPU or more (scripts/gpu_probes.py holds the probes):

  smoke     the real launch: ``torchrun --standalone --nproc_per_node=N -m elastic_mnist train
            --device cuda`` (N = 2 where two GPUs are visible, 1 else: a NCCL group of one),
            SMOKE_STEPS (4) steps, then as many more resumed from its checkpoint, with SMOKE_FLAGS
            added (scripts/check_smoke.py says what must hold)
  ddp       a NCCL group of one under torchrun: an all-reduce's future; in DDP no host-to-device
            copy per step or evaluation
  rng       the CUDA generator, advanced after the Trainer is built, saved and restored
  futures   a stand-in for ``--recovery in-process``'s futures on a side stream:
            ``Future(devices=[cuda])`` orders the reader after the side stream
  graphs    ``--compile`` at one micro-batch per step under DDP: CUDA graphs, eager's gradients
  cuda tests   the tests marked ``cuda`` (tests/): the same claims without DDP, accumulation
            without CUDA graphs, IEEE fp32 and TF32, bf16 + channels-last + compile
  laptop    a CPU test of two workers with one GPU visible, which passes only because the
            suite pins ``--device cpu``
  bench     scripts/bench.py on the GPU, in what is left of the budget

Then it says, and writes under ``not_proven``, the claims that need two GPUs and no step proved.

Without a GPU (or with --dry-run) it is its own dry run at the tiniest sizes: the smoke test in
one CPU process, the probes on CPU (the GPU's checks null), the bench's worker alone, quickly;
the GPU-only steps say "skipped (no GPU)". tests/test_gpu_check.py runs it so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from processes import free_port, stop_tree

REPO = Path(__file__).resolve().parents[1]
BUDGET_S = 480.0
"""The whole check's time: 8 minutes, what a lent H200 gives it with room to spare."""
RESERVE_S = 5.0
"""Kept back from the budget for the last writes."""
GRACE_S = 5.0
"""Between a timed-out step's SIGTERM (torchrun passes it to its workers) and SIGKILL."""

NOT_PROVEN = [
    "DDP's gradients summed by NCCL between two GPUs (the smoke test at world size 2)",
    ("the watchdog names the stalled rank on NCCL, its peer blocked in the step's read-back "
     "(issue 27, item 1)"),
    "--recovery in-process on NCCL: refused in one line until it has run on two GPUs (item 2)",
    "adopt's agreed state sent from a rank on one GPU to a rank on another (item 3)",
    "a dead worker's cost to its node's survivors on the NCCL restart path (item 5)",
    ("CUDA graphs or not where two ranks split the global batch (micro-batches per rank follow "
     "the world size)"),
    ("each worker on the GPU of its local rank; a checkpoint's CUDA generator resumed on "
     "another rank's GPU (cuda:1)"),
]
"""The claims that need two GPUs. The first is proved by the smoke test where two are visible."""


@dataclass
class Step:
    name: str
    claim: str
    command: list[str]
    bound_s: float
    result: Path | None = None
    """A JSON file the step writes (its checks), copied into the summary."""
    skip: str | None = None
    """Why it does not run here (None: it runs)."""
    env: dict[str, str] = field(default_factory=dict)
    output: Path | None = None
    """A file that gets what the step prints, besides the log."""


class Summary:
    """summary.json, rewritten whole (through a temporary file) at every change."""

    def __init__(self, path: Path, header: dict):
        self.path = path
        self.data = {**header, "started": now(), "updated": now(), "finished": False,
                     "steps": [], "not_proven": [], "exit_status": None}
        self.write()

    def write(self) -> None:
        self.data["updated"] = now()
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=2) + "\n")
        os.replace(tmp, self.path)


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class Log:
    """Prints and appends to gpu_check.log, line by line, as it comes."""

    def __init__(self, path: Path):
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the whole run

    def __call__(self, line: str) -> None:
        print(line, flush=True)
        self.file.write(line + "\n")


def run_step(step: Step, bound_s: float, log: Log) -> tuple[str, int | None]:
    """Runs the step's command for at most ``bound_s`` seconds, its output into the log; its
    outcome ("ok", "failed", "timed out") and exit code."""
    proc = subprocess.Popen(step.command, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace",
                            env={**os.environ, **step.env})

    def copy() -> None:
        with open(step.output or os.devnull, "w") as output:
            for line in proc.stdout:
                log(line.rstrip("\n"))
                output.write(line)

    reader = threading.Thread(target=copy, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=bound_s)
    except subprocess.TimeoutExpired:
        stop_tree(proc.pid, GRACE_S)
        proc.wait()
        reader.join(timeout=GRACE_S)
        return "timed out", None
    reader.join(timeout=GRACE_S)  # a left-behind descendant may hold the pipe: not for ever
    return ("ok" if code == 0 else "failed"), code


def run_steps(steps: list[Step], summary: Summary, log: Log, budget_s: float,
              bounds: dict[str, float]) -> int:
    """Runs the steps in order, each in its bound and what is left of the budget, noting each
    in the summary before and after it; 1 if any failed or timed out."""
    deadline = time.monotonic() + budget_s - RESERVE_S
    status = 0
    for step in steps:
        entry = {"name": step.name, "claim": step.claim, "status": "running",
                 "bound_s": None, "seconds": None}
        summary.data["steps"].append(entry)
        left = deadline - time.monotonic()
        bound = min(bounds.get(step.name, step.bound_s), left)
        if step.skip is not None or bound < 1:
            entry["status"] = f"skipped ({step.skip or 'no time left in the budget'})"
            summary.write()
            log(f"gpu_check: {step.name}: {entry['status']}")
            continue
        entry["bound_s"] = round(bound, 1)
        summary.write()
        log(f"== {step.name}: {step.claim} (at most {bound:.0f} s)")
        began = time.monotonic()
        outcome, code = run_step(step, bound, log)
        entry["seconds"] = round(time.monotonic() - began, 1)
        entry["status"], entry["exit_code"] = outcome, code
        if step.result is not None and step.result.exists():
            try:
                entry["result"] = json.loads(step.result.read_text())
            except ValueError:
                entry["result"] = None
        if outcome != "ok":
            status = 1
        summary.write()
        log(f"gpu_check: {step.name}: {outcome}"
            f"{f' (exit {code})' if outcome == 'failed' else ''} ({entry['seconds']:.0f} s)")
    return status


def gpu_count() -> tuple[int, dict]:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return count, {"python": platform.python_version(), "torch": torch.__version__,
                   "cuda": torch.version.cuda,
                   "gpus": [torch.cuda.get_device_name(i) for i in range(count)]}


def plan(py: str, out: Path, work: Path, gpus: int, bench_flags: list[str],
         given_digits: Path | None = None) -> list[Step]:
    """The steps, the most decisive first."""
    on_gpu = gpus > 0
    device = "cuda" if on_gpu else "cpu"
    nproc = 2 if gpus >= 2 else 1
    torchrun = [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    probes = str(REPO / "scripts" / "gpu_probes.py")
    digits = given_digits or work / "digits"
    no_gpu = None if on_gpu else "no GPU"

    def probe(name: str, claim: str, bound_s: float, grouped: bool = True) -> Step:
        result = work / f"probe-{name}.json"  # in the summary: what comes back is few files
        launcher = torchrun if grouped and on_gpu else [py]
        command = [*launcher, probes, name, "--device", device, "--data-dir", str(digits),
                   "--out", str(result)]
        if grouped and not on_gpu:  # the dry run: a group of one without torchrun's seconds
            return Step(name, claim, [py, str(REPO / "scripts" / "gpu_check.py"), "--as-rank-0",
                                      *command[1:]], bound_s, result)
        return Step(name, claim, command, bound_s, result)

    smoke_steps = os.environ.get("SMOKE_STEPS", "4" if on_gpu else "1")
    smoke = [py, str(REPO / "scripts" / "gpu_check.py"), "--smoke", str(work / "smoke"),
             "--device", device, "--nproc", str(nproc if on_gpu else 0), "--steps", smoke_steps,
             "--digits", str(digits), "--out", str(out / "smoke.json")]
    bench = ([py, str(REPO / "scripts" / "bench.py"), "--device", "cuda"] if on_gpu
             else [py, str(REPO / "scripts" / "bench.py"), "--device", "cpu", "--quick",
                   "--only", "worker"])
    bench += ["--out", str(out / "results.json"), "--work", str(work / "bench"), *bench_flags]
    laptop = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_train.py",
              "-k", "test_make_train_line_runs_via_jobs_local"]
    return [
        Step("digits", "tiny synthetic digits for the steps",
             [py, "-m", "elastic_mnist", "synth", "--out", str(digits),
              "--train", "512" if on_gpu else "64", "--test", "128" if on_gpu else "32",
              "--seed", "0"], 60, skip=given_digits and f"given: {given_digits}"),
        Step("smoke", f"the real launch on {device}, resumed", smoke, 150, out / "smoke.json"),
        probe("ddp", "a group of one under torchrun; in DDP no host-to-device copy", 90),
        probe("rng", "the CUDA generator, advanced after construction, resumes", 60),
        probe("futures", "Future(devices=[cuda]) orders a side stream's reader", 45,
              grouped=False),
        probe("graphs", "CUDA graphs under DDP at one micro-batch: eager's gradients", 150),
        Step("cuda tests", "the tests marked cuda",
             [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", "tests/"], 240,
             skip=no_gpu),
        Step("laptop", "two CPU workers with one GPU visible", laptop, 120, skip=no_gpu,
             env={"CUDA_VISIBLE_DEVICES": "0"}),
        Step("bench", f"scripts/bench.py on {device}", bench, 300, output=out / "table.md"),
    ]


def smoke(folder: Path, device: str, nproc: int, steps: int, digits: Path, out: Path) -> int:
    """The smoke step: two launches of the job (under torchrun with ``nproc`` workers; 0: one
    plain process), the second resumed from the first, then scripts/check_smoke.py."""
    py = sys.executable
    launcher = ([py, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
                if nproc else [py])
    flags = os.environ.get("SMOKE_FLAGS", "").split()
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    for launch in (1, 2):
        log = folder / f"launch{launch}.log"
        with open(log, "w") as sink:
            code = subprocess.call(
                [*launcher, "-m", "elastic_mnist", "train", "--device", device, "--dataset",
                 "synthetic", "--data-dir", str(digits), "--no-download",
                 "--global-batch-size", "64" if nproc else "16", "--epochs", "100",
                 "--max-steps", str(launch * steps), "--log-every", "1",
                 "--checkpoint-dir", str(folder / "ckpt"), "--logdir", str(folder / "runs"),
                 "--run-id", "smoke", *flags], stdout=sink, stderr=subprocess.STDOUT, env=env)
        if code != 0:
            print(log.read_text(), end="")
            return 1
    return subprocess.call([py, str(REPO / "scripts" / "check_smoke.py"), str(folder),
                            "--steps", str(steps), "--world-size", str(max(nproc, 1)),
                            "--device", device, "--out", str(out)])


def as_rank_0(argv: list[str]) -> int:
    """The dry run's stand-in for ``torchrun --nproc_per_node=1``: this process is rank 0 of 1,
    its store on a free loopback port (no agent, no second interpreter)."""
    port = free_port()
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    import gpu_probes

    return gpu_probes.main(argv[2:])  # past --as-rank-0 and gpu_probes.py's path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--as-rank-0"]:
        return as_rank_0(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    if argv[:1] == ["--smoke"]:
        parser.add_argument("--smoke", type=Path, required=True)
        parser.add_argument("--device", required=True)
        parser.add_argument("--nproc", type=int, required=True)
        parser.add_argument("--steps", type=int, required=True)
        parser.add_argument("--digits", type=Path, required=True)
        parser.add_argument("--out", type=Path, required=True)
        a = parser.parse_args(argv)
        return smoke(a.smoke, a.device, a.nproc, a.steps, a.digits, a.out)
    parser.add_argument("out", type=Path, nargs="?", default=REPO / "bench" / "gpu")
    parser.add_argument("--budget", type=float, default=BUDGET_S,
                        help="seconds for the whole check (default: 480)")
    parser.add_argument("--bound", action="append", default=[], metavar="STEP=S",
                        help="a step's own bound in seconds, in place of its default")
    parser.add_argument("--only", type=lambda s: s.split(","), default=None, metavar="STEP,...",
                        help="these steps alone (the others: skipped), e.g. to run one again")
    parser.add_argument("--digits", type=Path, default=None,
                        help="digits for the steps (elastic-mnist synth's), in place of new ones")
    parser.add_argument("--dry-run", action="store_true",
                        help="the dry run at the tiniest sizes, even where a GPU is visible")
    args, bench_flags = parser.parse_known_args(argv)
    bounds: dict[str, float] = {}
    for spec in args.bound:
        name, _, seconds = spec.rpartition("=")
        try:
            bounds[name] = float(seconds)
        except ValueError:
            name = ""
        if not name:
            print(f"gpu_check: --bound {spec}: say STEP=SECONDS", file=sys.stderr)
            return 2
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out.resolve()
    log = Log(out / "gpu_check.log")
    gpus, header = gpu_count()
    if args.dry_run:
        gpus = 0
    log(f"gpu_check: python {header['python']}, torch {header['torch']}, "
        f"GPUs: {', '.join(header['gpus']) or 'none'}"
        f"{'' if gpus else '; the dry run, at the tiniest sizes'}")
    work = Path(tempfile.mkdtemp(prefix="gpu_check."))  # runs' checkpoints, out of OUT_DIR
    try:
        steps = plan(sys.executable, out, work, gpus, bench_flags,
                     args.digits and args.digits.resolve())
        unknown = (set(bounds) | set(args.only or ())) - {step.name for step in steps}
        if unknown:
            print(f"gpu_check: no step is named {', '.join(sorted(unknown))}; the steps: "
                  f"{', '.join(step.name for step in steps)}", file=sys.stderr)
            return 2
        for step in steps:
            if args.only is not None and step.name not in args.only and step.skip is None:
                step.skip = "not asked for"
        summary = Summary(out / "summary.json", {**header, "dry_run": gpus == 0,
                                                 "budget_s": args.budget})
        status = run_steps(steps, summary, log, args.budget, bounds)
        smoke_ok = next(s["status"] for s in summary.data["steps"] if s["name"] == "smoke")
        proven = gpus >= 2 and smoke_ok == "ok"
        summary.data["not_proven"] = [{"claim": claim, "needs": "2 GPUs"}
                                      for claim in NOT_PROVEN[1 if proven else 0:]]
        summary.data["finished"], summary.data["exit_status"] = True, status
        summary.write()
        log("gpu_check: needs two GPUs, not yet proven:")
        for entry in summary.data["not_proven"]:
            log(f"  - {entry['claim']}")
        log(f"gpu_check: exit status {status}; results in {out}")
        return status
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
