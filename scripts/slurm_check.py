#!/usr/bin/env python3
"""jobs/slurm.sbatch under a real SLURM: submitted, preempted, requeued, resumed, finished.

    scripts/slurm_local.sh .venv/bin/python scripts/slurm_check.py   (what `make slurm-check` runs)
    .venv/bin/python scripts/slurm_check.py [--steps N] [--preempt-after N] [--keep]

Needs `sbatch` and a running controller (`scontrol ping`); scripts/slurm_local.sh starts a
one-node cluster for it. Submits the job file as users do, from the repository root, with what a
one-node CPU cluster needs on the command line (`--nodes=1 --gpus-per-node=0`, NPROC_PER_NODE
workers, SHARED in a temporary folder, the log there too) and a short run on synthetic digits.
Once the job has trained PREEMPT_AFTER steps it sends `scancel --batch --signal=TERM JOBID`, the
rehearsal the job file names, and checks what the run left behind:

- the workers stopped at one step and saved a checkpoint of it (`latest`, its manifest, `inspect`);
- the job put itself back into the queue, and SLURM started it again;
- the new workers resumed from exactly that step (events.jsonl `start`, `resumed_from_step`);
- the job finished (`finish` at --steps, state COMPLETED, exit code 0:0), every sample of every
  completed epoch used exactly once (scripts/check_audit.py);
- one run for the job however often it started: one folder under LOGDIR, named by the job id,
  and the same run id in the checkpoint folder.

A second job is submitted with it, into a SHARED folder of its own (one worker, --second-steps):
both first nodes are this machine. It must run through the first job's stop and requeue and
finish too (COMPLETED, 0:0, one run folder of its own), at a rendezvous port other than the first
job's: with one fixed port the second job's agent joined the first's store as a client (torchrun
does when it cannot serve the port), the jobs met in one store, and the requeued first job failed
when the other job's agent ended.

Prints the seconds from submission to the first step, from the TERM to the stop, from the stop to
the requeued job's first step, and from there to the finish, and the second job's from submission
to its finish. Exit 0 when all hold, 1 when one does
not (the work folder is then kept), 2 when SLURM is not there or the arguments are wrong.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from chaos import Observer
from processes import job_env

from elastic_mnist.events import event_time

REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "jobs" / "slurm.sbatch"
BIN = Path(sys.executable).parent
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
         "BOOT_FAIL", "DEADLINE"}
"""Job states after which nothing more happens (a requeued job is PENDING again instead)."""
TRAIN_IMAGES = 12800
"""Synthetic training digits the jobs share."""
BATCH = 128
"""The jobs' --global-batch-size: steps of a sixth of the default's 768, so that two jobs of a
few hundred steps each fit in about a minute on 2 cores."""


class CheckFailed(Exception):
    """One thing the run should have done and did not."""


@dataclass
class Outcome:
    job_id: str
    work: Path
    second_job_id: str = ""
    stopped_step: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def slurm_missing() -> str | None:
    """Why no SLURM job can be submitted from here, or None when one can."""
    if shutil.which("sbatch") is None or shutil.which("scontrol") is None:
        return "sbatch or scontrol is not on PATH (scripts/slurm_local.sh starts a cluster)"
    try:
        ping = subprocess.run(["scontrol", "ping"], check=False, capture_output=True,
                              text=True, timeout=15)
    except subprocess.TimeoutExpired:
        return "scontrol ping did not answer within 15 s"
    if ping.returncode != 0 or "UP" not in ping.stdout:
        said = (ping.stdout + ping.stderr).strip().splitlines()
        return f"no SLURM controller answers scontrol ping ({said[-1] if said else 'no output'})"
    return None


def job_fields(job_id: str) -> dict[str, str]:
    """`scontrol show job` as KEY=VALUE pairs (empty when SLURM has forgotten the job)."""
    shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], check=False,
                           capture_output=True, text=True)
    return dict(re.findall(r"(\w+)=(\S*)", shown.stdout)) if shown.returncode == 0 else {}


class Job:
    """The submitted job: its log, its run's records, and waiting on them."""

    def __init__(self, job_id: str, work: Path, deadline: float):
        self.id = job_id
        self.work = work
        self.log = work / f"elastic-mnist-{job_id}.out"
        self.observer = Observer(work / "runs" / job_id)
        self.deadline = deadline

    def endpoint(self) -> str:
        """The rendezvous endpoint the job file chose, from its log."""
        found = re.search(rf"job {self.id}: rendezvous at (\S+)",
                          self.log.read_text(errors="replace") if self.log.exists() else "")
        return found.group(1) if found else ""

    def state(self) -> str:
        return job_fields(self.id).get("JobState", "UNKNOWN")

    def events(self, kind: str) -> list[dict]:
        return [e for e in self.observer.events() if e["event"] == kind]

    def wait(self, what: str, ready, poll: float = 0.2):
        """Polls ``ready()`` (also following the job's state) until it returns something true."""
        while True:
            state = self.state()
            found = ready()
            if found:
                return found
            if state in ENDED:
                raise CheckFailed(f"job {self.id} ended {state} while waiting for {what}"
                                  f"{self.log_tail()}")
            if time.time() > self.deadline:
                raise CheckFailed(f"timed out waiting for {what} (job {self.id} is {state})"
                                  f"{self.log_tail()}")
            time.sleep(poll)

    def log_tail(self, lines: int = 15) -> str:
        if not self.log.exists():
            return f"; no job log at {self.log}"
        tail = self.log.read_text(errors="replace").splitlines()[-lines:]
        return f"; the job log {self.log} ends:\n  " + "\n  ".join(tail)

    def first_step_time(self, generation: int) -> float | None:
        times = [r["time"] for r in self.observer.audit() if r["generation"] == generation]
        return min(times) if times else None


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=False, capture_output=True, text=True, **kwargs)


def submit(work: Path, steps: int, nproc_per_node: int, deadline: float) -> Job:
    """jobs/slurm.sbatch as users submit it, its SHARED folder ``work``, ``steps`` steps."""
    epochs = -(-steps * BATCH // TRAIN_IMAGES)  # enough epochs for --steps
    env = job_env(threads=1, SHARED=str(work), NPROC_PER_NODE=str(nproc_per_node))
    sbatch = run(["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0",
                  f"--output={work}/elastic-mnist-%j.out", str(SBATCH),
                  "--dataset", "synthetic", "--no-download", "--epochs", str(epochs),
                  "--global-batch-size", str(BATCH),
                  "--max-steps", str(steps), "--checkpoint-every", "50", "--log-every", "50",
                  "--audit-samples", "--device", "cpu"], cwd=REPO, env=env)
    if sbatch.returncode != 0:
        raise CheckFailed(f"sbatch refused the job: {sbatch.stderr.strip()}")
    return Job(sbatch.stdout.strip().split(";")[0], work, deadline)


def check_slurm_job(work: Path, steps: int = 600, preempt_after: int = 100,
                    nproc_per_node: int = 2, timeout: float = 900,
                    second_steps: int = 600) -> Outcome:
    """Submits both jobs, preempts the first and follows both to their end; raises CheckFailed
    at the first thing that does not hold."""
    deadline = time.time() + timeout
    data = work / "data"
    synth = run([str(BIN / "elastic-mnist"), "synth", "--out", str(data), "--train", str(TRAIN_IMAGES),
                 "--test", "512", "--seed", "0"])
    if synth.returncode != 0:
        raise CheckFailed(f"elastic-mnist synth failed: {synth.stderr.strip()}")
    (work / "second").mkdir()
    (work / "second" / "data").symlink_to(data)  # the same digits, its own checkpoints and runs
    submitted = time.time()
    job = submit(work, steps, nproc_per_node, deadline)
    second = submit(work / "second", second_steps, 1, deadline)
    outcome = Outcome(job.id, work, second.id)
    print(f"slurm_check: jobs {job.id} and {second.id} submitted; work folder {work}", flush=True)

    first = job.wait("the first step", lambda: job.first_step_time(0))
    outcome.timings["submit → first step"] = first - submitted
    job.wait(f"step {preempt_after}", lambda: job.observer.step() >= preempt_after)
    if job.events("finish"):
        raise CheckFailed("the job finished before it could be preempted; raise --steps")
    term_step, term_sent = job.observer.step(), time.time()
    scancel = run(["scancel", "--batch", "--signal=TERM", job.id])
    if scancel.returncode != 0:
        raise CheckFailed(f"scancel --batch --signal=TERM {job.id}: {scancel.stderr.strip()}")
    print(f"slurm_check: TERM sent to the batch shell at step {term_step}", flush=True)

    preempted = job.wait("the workers' stop (a `preempted` record)",
                         lambda: job.events("preempted"))[0]
    stopped = outcome.stopped_step = preempted["step"]
    outcome.timings["TERM → stopped, checkpoint saved"] = event_time(preempted) - term_sent
    if not preempt_after <= stopped < steps:
        raise CheckFailed(f"stopped at step {stopped}, not between {preempt_after} and {steps}")
    last_steps = {}
    for record in job.observer.audit():
        if record["generation"] == 0:
            last_steps[record["rank"]] = max(last_steps.get(record["rank"], 0), record["step"])
    if last_steps != dict.fromkeys(range(nproc_per_node), stopped):
        raise CheckFailed(f"the {nproc_per_node} workers did not all stop at step {stopped}: "
                          f"last step of each rank {last_steps}")
    check_checkpoint(work / "checkpoints", stopped)
    print(f"slurm_check: all {nproc_per_node} workers stopped at step {stopped}, checkpoint saved", flush=True)

    starts = job.wait("the requeued job's start", lambda: job.events("start")[1:])
    if starts[0].get("resumed_from_step") != stopped:
        raise CheckFailed(f"the requeued job resumed from step "
                          f"{starts[0].get('resumed_from_step')}, not {stopped}")
    generation = starts[0]["restart_generation"]
    resumed = job.wait("the requeued job's first step", lambda: job.first_step_time(generation))
    outcome.timings["stopped → requeued job's first step"] = resumed - event_time(preempted)
    outcome.timings.update(requeue_breakdown(job, event_time(preempted), resumed))
    print(f"slurm_check: the requeued job resumed from step {stopped}", flush=True)

    finish = job.wait("the finish", lambda: job.events("finish"))[0]
    outcome.timings["requeued job's first step → finish"] = event_time(finish) - resumed
    job.wait("the job's end", lambda: job.state() in ENDED)
    ended = time.time()
    check_end(job, finish, steps, stopped)
    outcome.timings["submit → job completed"] = ended - submitted
    check_second_job(second, job, second_steps, event_time(preempted))
    outcome.timings["second job: submit → completed"] = \
        event_time(second.events("finish")[0]) - submitted
    log = job.log.read_text(errors="replace")
    if "SignalException" in log:
        outcome.notes.append("the job log holds torchrun's SignalException traceback (the "
                             "agent passing SIGTERM on; expected)")
    return outcome


def requeue_breakdown(job: Job, stopped: float, resumed: float) -> dict[str, float]:
    """The time between the stop and the requeued job's first step, split at the start SLURM
    records for the job's new run (StartTime, whole seconds): before it, the job requeueing
    itself, SLURM's hold and its scheduling; after it, the agent and workers starting."""
    try:
        started = time.mktime(time.strptime(job_fields(job.id)["StartTime"], "%Y-%m-%dT%H:%M:%S"))
    except (KeyError, ValueError):
        return {}
    return {"… stopped → started again (requeue, SLURM's hold; whole seconds)": started - stopped,
            "… started again → first step": resumed - started}


def check_checkpoint(checkpoint_dir: Path, step: int) -> None:
    """The newest checkpoint is the one of ``step``: `latest` names it, its manifest records the
    step, and `elastic-mnist inspect` finds it valid."""
    name = f"step-{step:08d}"
    shown = run([str(BIN / "elastic-mnist"), "inspect", "--checkpoint-dir", str(checkpoint_dir),
                 "--json"])
    if shown.returncode != 0:
        raise CheckFailed(f"elastic-mnist inspect failed: {shown.stderr.strip()}")
    listing = json.loads(shown.stdout)
    if not (listing["latest"] or "").startswith(name):
        raise CheckFailed(f"checkpoints/latest names {listing['latest']!r}, not the stop's {name}")
    if json.loads((checkpoint_dir / f"{name}.json").read_text())["step"] != step:
        raise CheckFailed(f"{name}.json does not record step {step}")
    if not any(c.get("step") == step and c["valid"] for c in listing["checkpoints"]):
        raise CheckFailed(f"inspect finds no valid checkpoint of step {step}: "
                          f"{listing['checkpoints']}")


def check_end(job: Job, finish: dict, steps: int, stopped: int) -> None:
    """Finished, once, in one run folder named by the job, every sample once per epoch."""
    fields = job_fields(job.id)
    if (fields.get("JobState"), fields.get("ExitCode")) != ("COMPLETED", "0:0"):
        raise CheckFailed(f"job {job.id} ended {fields.get('JobState')} with exit code "
                          f"{fields.get('ExitCode')}{job.log_tail()}")
    if fields.get("Restarts") != "1":
        raise CheckFailed(f"job {job.id} was started {fields.get('Restarts')} more times, not 1")
    if finish["step"] != steps:
        raise CheckFailed(f"the job finished at step {finish['step']}, not {steps}")
    starts = [e.get("resumed_from_step") for e in job.events("start")]
    if len(starts) != 2 or starts[1] != stopped or len(job.events("preempted")) != 1:
        raise CheckFailed(f"two starts (the second from step {stopped}) and one stop expected; "
                          f"events.jsonl has starts from {starts} and "
                          f"{len(job.events('preempted'))} stops")
    runs = sorted(p.name for p in (job.work / "runs").iterdir())
    if runs != [job.id]:
        raise CheckFailed(f"one run folder named {job.id} expected under runs/, found {runs}")
    kept = json.loads((job.work / "checkpoints" / "run.json").read_text())
    if kept.get("run_id") != job.id:
        raise CheckFailed(f"checkpoints/run.json names run {kept.get('run_id')!r}, not {job.id}")
    audit = run([sys.executable, str(REPO / "scripts" / "check_audit.py"),
                 str(job.work / "runs" / job.id)])
    if audit.returncode != 0:
        raise CheckFailed(f"sample audit: {(audit.stdout + audit.stderr).strip()}")
    if "requeueing it" not in job.log.read_text(errors="replace"):
        raise CheckFailed(f"the job log does not say that the job requeued itself{job.log_tail()}")


def check_second_job(second: Job, first: Job, steps: int, first_stopped: float) -> None:
    """The job beside the first: its own rendezvous port, through the first job's stop, finished
    in one run folder of its own."""
    if not first.endpoint() or first.endpoint() == second.endpoint():
        raise CheckFailed(f"jobs {first.id} and {second.id} met at rendezvous endpoints "
                          f"{first.endpoint()!r} and {second.endpoint()!r}: not two of their own")
    finish = second.wait("the second job's finish", lambda: second.events("finish"))[0]
    second.wait("the second job's end", lambda: second.state() in ENDED)
    fields = job_fields(second.id)
    if (fields.get("JobState"), fields.get("ExitCode")) != ("COMPLETED", "0:0"):
        raise CheckFailed(f"the second job {second.id} ended {fields.get('JobState')} with exit "
                          f"code {fields.get('ExitCode')}{second.log_tail()}")
    if finish["step"] != steps:
        raise CheckFailed(f"the second job finished at step {finish['step']}, not {steps}")
    starts = [event_time(e) for e in second.events("start")]
    if not starts or starts[0] > first_stopped or event_time(finish) < first_stopped:
        raise CheckFailed("the second job did not run through the first job's stop; make "
                          "--second-steps longer")
    runs = sorted(p.name for p in (second.work / "runs").iterdir())
    if runs != [second.id]:
        raise CheckFailed(f"one run folder named {second.id} expected under the second job's "
                          f"runs/, found {runs}")


def report(outcome: Outcome) -> str:
    passed = (f"slurm_check: passed (job {outcome.job_id}, stopped and resumed at step "
              f"{outcome.stopped_step}; job {outcome.second_job_id} beside it)")
    lines = [passed, "| interval | seconds |", "| --- | ---: |"]
    lines += [f"| {name} | {seconds:.1f} |" for name, seconds in outcome.timings.items()]
    lines += [f"slurm_check: {note}" for note in outcome.notes]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600, help="steps the job trains in all")
    parser.add_argument("--preempt-after", type=int, default=100,
                        help="send the TERM once the job has trained this many steps")
    parser.add_argument("--nproc-per-node", type=int, default=2, help="workers (NPROC_PER_NODE)")
    parser.add_argument("--second-steps", type=int, default=600,
                        help="steps of the second job (one worker), which must outlast the "
                             "first job's stop")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for all of it")
    parser.add_argument("--keep", action="store_true", help="keep the work folder after a pass")
    args = parser.parse_args(argv)
    if not 0 < args.preempt_after < args.steps or args.nproc_per_node < 1 or args.timeout <= 0 \
            or args.second_steps < 1:
        parser.error("need 0 < --preempt-after < --steps, --nproc-per-node >= 1, --timeout > 0, "
                     "--second-steps >= 1")
    missing = slurm_missing()
    if missing:
        print(f"slurm_check: {missing}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="slurm-check-"))
    try:
        outcome = check_slurm_job(work, args.steps, args.preempt_after, args.nproc_per_node,
                                  args.timeout, args.second_steps)
    except CheckFailed as failure:
        print(f"slurm_check: FAILED: {failure}\nslurm_check: work folder kept: {work}",
              file=sys.stderr)
        return 1
    print(report(outcome))
    if args.keep:
        print(f"slurm_check: work folder kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
