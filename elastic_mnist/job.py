"""Assembling one worker's training job: identity, data, resume, membership, the writers
(duties.py), the loop, and how it ends."""

from __future__ import annotations

import datetime
import json
import logging
import os
import platform
import secrets
import shlex
import sys
import uuid
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from elastic_mnist import distributed
from elastic_mnist.checkpoint import (
    check_writable,
    deserialize,
    newest_valid,
    read_run_file,
    write_run_file,
)
from elastic_mnist.config import TrainConfig
from elastic_mnist.data.datasets import (
    SYNTHETIC_WARNING,
    Dataset,
    dataset_root,
    load,
    prepare,
)
from elastic_mnist.data.fingerprint import SHORT
from elastic_mnist.distributed import backend_for
from elastic_mnist.duties import Duties, record_fallback
from elastic_mnist.env import (
    OUR_BACKEND,
    DistEnv,
    agent_command_line,
    torchrun_arguments,
    why_no_rendezvous,
)
from elastic_mnist.errors import (
    EXIT_CANNOT_SAVE,
    EXIT_INTERRUPTED,
    EXIT_PREEMPTED,
    CheckpointWriteError,
    ConfigError,
    DataError,
    Dropped,
    PeerStopped,
    first_line,
)
from elastic_mnist.eviction import evicted
from elastic_mnist.logs import add_file_handler
from elastic_mnist.metrics import flat_hparams
from elastic_mnist.resilience.faces import NullMembership
from elastic_mnist.resilience.faults import Faults
from elastic_mnist.resilience.fence import Fence
from elastic_mnist.resilience.lease import LeaseHold
from elastic_mnist.resilience.membership import PREFIX, Membership
from elastic_mnist.resilience.preemption import StopRequest, stop_on_signals
from elastic_mnist.resilience.roster import START_UP_S, JobRecord, Roster
from elastic_mnist.resilience.torchrun_agents import agents_for
from elastic_mnist.trainer import Trainer

log = logging.getLogger(__name__)

HPARAM_METRICS = ["test/accuracy", "test/loss", "train/loss"]
DASHBOARD = {  # TensorBoard's custom scalars tab: {category: {chart: its tags}}
    "loss": {"train and test loss": ["train/loss", "test/loss"],
             "skipped steps (non-finite)": ["train/nonfinite_steps"]},
    "accuracy": {"train and test accuracy": ["train/accuracy", "test/accuracy"]},
    "elastic": {"world size and restart generation": ["elastic/world_size",
                                                      "elastic/restart_generation"]},
    "throughput": {"samples/s": ["perf/samples_per_s"], "step ms": ["perf/step_ms"],
                   "data wait %": ["perf/data_wait_pct"]},
    "checkpoints": {"save ms (blocking)": ["ckpt/save_ms"], "bytes": ["ckpt/bytes"]},
    "pace": {"compute s (slowest, median rank)": ["pace/slowest_compute_s",
                                                  "pace/median_compute_s"],
             "share waiting for the slowest": ["pace/wait_share"]},
}


def run_training(cfg: TrainConfig, env: DistEnv, device: torch.device,
                 store: dist.Store | None = None, lease: LeaseHold | None = None) -> int:
    """Trains to the end (exit 0) or to an agreed stop after a signal (EXIT_PREEMPTED), or
    leaves while the others go on (EXIT_PREEMPTED too: this node was asked to stop).

    ``store`` (the process group's, None in a single process) carries the watchdog's heartbeats
    where the survivors of a lost node cannot go on in process. ``lease``: the checkpoint
    folder's, which fences the writers with the membership (fence.py).
    """
    checkpoint_dir = Path(cfg.checkpoint.checkpoint_dir)
    faults = Faults.from_environ(env.rank, env.restart_count)
    check_checkpoint_folder(checkpoint_dir, env, device)
    run_id, generation = resolve_run_identity(cfg, env, device)
    run_dir = Path(cfg.run.logdir) / run_id
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        add_file_handler(str(run_dir / "train.log"))
    log.info("run %s, generation %d: %s on %s", run_id, generation, env.describe(), device)

    dataset = prepare_dataset(cfg, env, device)
    if dataset.is_synthetic and cfg.data.dataset == "mnist" and env.is_main:  # said once
        log.warning("%s", SYNTHETIC_WARNING)
    log.info("data: %s", dataset.describe())

    membership = start_membership(cfg, env, device, generation, run_id)
    duties = Duties(cfg, run_id, run_dir, checkpoint_dir, store, membership,
                    Fence(membership.dropped, *([lease.taken] if lease is not None else []),
                          fallback=membership.dropped_by_file))
    if lease is not None:
        lease.fence_renewals(duties.fence)
    trainer = Trainer(cfg, env, device, dataset, run_id=run_id, restart_generation=generation,
                      membership=duties.membership, after_change=duties.after)
    describe_job(duties.membership, trainer)
    resume = find_resume_payload(checkpoint_dir, env, device)
    if resume is not None:  # checked against this run before any run file is opened
        payload, source = resume
        trainer.restore(payload, source)
        log.info("resumed from %s: %s (saved at world size %d, now %d)", source,
                 trainer.report.whereabouts(), payload["world_size"], env.world_size)
    step = trainer.progress.step
    # Steps after the checkpoint were lost with the old workers: the dashboards hide what they
    # logged (opened at the step after it).
    writers = duties.first(env, generation, faults, step, trainer.total_steps)
    trainer.take(writers)
    writers.metrics.layout(DASHBOARD)
    writers.metrics.text("launch", launch_summary(cfg, env, device, dataset, trainer), step)
    writers.metrics.hparams({**flat_hparams(cfg.to_dict()), "world_size": env.world_size,
                             "dataset_kind": dataset.kind}, HPARAM_METRICS)
    writers.events.emit("start", step, world_size=env.world_size, restart_generation=generation,
                        resumed_from_step=trainer.resumed_from, run_id=run_id,
                        torchelastic_restart_count=env.restart_count, dataset=dataset.kind,
                        recovery="in-process" if duties.membership.in_process else "restart")
    if resume is not None and payload["world_size"] != env.world_size:
        writers.events.emit("resize", step, old_world_size=payload["world_size"],
                            new_world_size=env.world_size)

    writers.watchdog.start()
    return train_to_the_end(cfg, env, trainer, duties)


def train_to_the_end(cfg: TrainConfig, env: DistEnv, trainer: Trainer, duties: Duties) -> int:
    """The loop, and how the job ends for this worker (every worker, whether it started with
    the job or joined it): the records, the lines, the exit status."""
    duties.membership.on_fallback = partial(record_fallback, duties, trainer.progress)
    try:
        with stop_on_signals() as stop:
            try:
                outcome = trainer.fit(stop)
            except RuntimeError:  # a collective failed: quietly, if a peer declared a hang
                trainer.writers.watchdog.absorb()
                raise
            finally:  # no step follows: nothing left to watch, no change to bound
                trainer.writers.watchdog.close()
                duties.membership.no_more_changes()
        trainer.writers.checkpointer.wait()
    finally:  # a rank the job went on without leaves with that line alone
        trainer.writers.close(dropped=isinstance(sys.exc_info()[1], Dropped))
    step, events = trainer.progress.step, trainer.writers.events
    if outcome == "unadmitted":
        log.warning("the job ended before it admitted this node: nothing to do")
        return 0
    if outcome == "stopped":
        log.warning("the job stopped before it admitted this node (its beat stood still for "
                    "%.0f s): exiting with %d, so that torchrun restarts this node into the "
                    "job's next round", duties.membership.bound_s, EXIT_PREEMPTED)
        return EXIT_PREEMPTED
    if outcome == "evicted":  # its record is written (eviction.py): nothing more to say there
        events.close()
        return evicted(step)
    if outcome != "finished":
        events.emit(outcome, step, signal=stop.signal_name)
        events.close()
        if outcome == "left":
            log.warning("leaving at step %d after %s: the other nodes go on without this one; "
                        "exiting with %d", step, stop.signal_name, EXIT_PREEMPTED)
            return EXIT_PREEMPTED
        return report_stop(trainer, stop, cfg, env)
    test_loss, test_accuracy = trainer.report.last_eval or (None, None)
    events.emit("finish", step, test_accuracy=test_accuracy, test_loss=test_loss)
    events.close()
    duties.membership.finish()
    duties.membership.release_agents()
    log.info("finished at step %d", step)
    if trainer.env.is_main:  # rank 0 now: after a change of membership, maybe not at launch
        log.info("%s", where_it_went(cfg, trainer))
    return 0


def where_it_went(cfg: TrainConfig, trainer: Trainer) -> str:
    """The run's last line: where its checkpoints and logs are, and how to look at them."""
    manifest = trainer.writers.checkpointer.last_manifest
    checkpoints = Path(cfg.checkpoint.checkpoint_dir)
    newest = f" (newest: {manifest.file})" if manifest is not None else ""
    logdir = cfg.run.logdir
    view = f"tensorboard --logdir {shlex.quote(logdir)}"
    if cfg.run.resume_command.startswith("make "):  # launched by the Makefile: its own target
        view = "make tensorboard" + ("" if logdir == "runs" else f" LOGDIR={shlex.quote(logdir)}")
    return (f"checkpoints in {checkpoints}/{newest}; TensorBoard events, events.jsonl and "
            f"train.log in {Path(logdir) / trainer.run_id}/; look at them with: {view}")


def start_membership(cfg: TrainConfig, env: DistEnv, device: torch.device,
                     generation: int, run_id: str = "") -> NullMembership:
    """The membership survivors recover through in process, on the rendezvous store, where they
    can (``--recovery``, a multi-node c10d rendezvous, a store that answers on every rank);
    else the restart path: every fault restarts the job through torchrun. In process, the job
    is published in the rendezvous records (``run_id``: the training run's), and nodes join
    it in process (admissions.py)."""
    wanted = cfg.run.recovery
    unread = unread_rendezvous(env) if wanted != "restart" else None
    # Every rank takes the same path (a wrapper may hide the agent on some nodes only).
    everywhere = wanted == "restart" or distributed.all_agree(env.rendezvous is not None, device)
    reason = ("--recovery restart" if wanted == "restart" else
              unread if unread is not None else
              "one node: torchrun restarts its workers together" if env.rendezvous is None else
              "another node's worker cannot read its agent's rendezvous" if not everywhere else
              "the watchdog is off (--hang-timeout 0)" if cfg.run.hang_timeout <= 0 else
              "NCCL recovers by restart until it has run on GPUs"
              if backend_for(device) == "nccl" else None)
    if reason is not None:
        ours = env.rendezvous is not None and env.rendezvous.backend == OUR_BACKEND
        say_it = wanted == "in-process" or (unread is not None and env.is_local_main) or (
            ours and env.is_main)
        (log.warning if say_it else log.info)("faults are recovered by a restart: %s", reason)
        if ours and env.is_main:
            publish_restart_path(env, run_id, cfg.run.pg_timeout)
        return NullMembership()
    rdzv = env.rendezvous
    launch = distributed.broadcast_object(secrets.token_hex(8), src=0, device=device)
    agents = agents_for(env)
    try:
        store = dist.TCPStore(rdzv.host, rdzv.port, is_master=False,
                              timeout=datetime.timedelta(seconds=cfg.run.pg_timeout))
    except RuntimeError as e:
        store, reason = None, str(e).strip().splitlines()[0]
    if not distributed.all_agree(store is not None, device):
        log.warning("faults are recovered by a restart: the rendezvous store %s does not answer "
                    "on every rank (%s)", rdzv.endpoint, reason or "on another rank")
        if store is not None and rdzv.backend == OUR_BACKEND and env.is_main:
            publish_restart_path(env, run_id, cfg.run.pg_timeout)
        return NullMembership()
    reason = agents.unusable(store)
    if not distributed.all_agree(reason is None, device):
        if reason is not None and env.is_local_main:
            log.warning("faults are recovered by a restart: %s", reason)
        return NullMembership()
    log.info("a lost, departing or frozen node is recovered in process (coordination on the "
             "rendezvous store %s)", rdzv.endpoint)
    return Membership(env, device, dist.PrefixStore(f"{PREFIX}/{rdzv.run_id}/{launch}", store),
                      generation, cfg.run.pg_timeout, bound_s=2 * cfg.run.hang_timeout,
                      folder=Path(cfg.checkpoint.checkpoint_dir), launch=launch,
                      agents=agents, records=Roster(store.clone(), rdzv.run_id),
                      run_id=run_id)


def publish_restart_path(env: DistEnv, run_id: str, timeout_s: float) -> None:
    """Rank 0 of a job on our rendezvous that recovers by restarts: says so in the records, so
    that an agent which comes late moves every node to the next round at once, as torch's c10d
    rendezvous does, instead of waiting for a job record (``START_UP_S``) that never comes."""
    rdzv = env.rendezvous
    try:
        store = dist.TCPStore(rdzv.host, rdzv.port, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        roster = Roster(store, rdzv.run_id)
        if roster.round() > (rdzv.round or 0):
            return  # the rendezvous went on: this job is being restarted, its record would lie
        roster.publish_job(JobRecord(
            round=rdzv.round or 0, launch="", generation=0, nodes=[],
            world_size=env.world_size, in_process=False, run_id=run_id, finished=False))
    except RuntimeError as e:  # DistStoreError: a late agent then waits START_UP_S
        log.warning("could not publish the job at the rendezvous %s (%s): a node that comes "
                    "late waits up to %.0f s for it before the job restarts", rdzv.endpoint,
                    first_line(e), START_UP_S)


DESCRIPTION = "description"
"""Key, in the launch's store, of rank 0's description of the job (:func:`describe_job`)."""


def describe_job(membership: NullMembership, trainer: Trainer) -> None:
    """Rank 0 of a job that nodes may join in process: its flags, its data and its model's
    shapes, in the launch's store, for a joining worker to check itself against before it says
    it is ready (joiner.py)."""
    if not (membership.in_process and trainer.env.is_main):
        return
    data = trainer.dataset
    membership.store.set(DESCRIPTION, json.dumps({
        "config": trainer.cfg.to_dict(),
        "data": {"kind": data.kind, "num_train": len(data.train),
                 "fingerprint": data.fingerprint},
        "model": {key: list(tensor.shape) for key, tensor in trainer.model.state_dict().items()},
    }))


def check_recovery(recovery: str, device: torch.device) -> None:
    """Raises ConfigError for ``--recovery in-process`` on NCCL: written with torch's own calls
    (the communicator aborted from the wake-up thread, a new group), but never run on GPUs, and
    torch's rules for it (a wait on NCCL's future that waits for the device, the default group
    cleared by an abort, TORCH_NCCL_ASYNC_ERROR_HANDLING=0 for a process that lives on) are not
    yet proven to hold; ``auto`` recovers NCCL jobs by a restart."""
    if recovery == "in-process" and backend_for(device) == "nccl":
        raise ConfigError(f"--recovery in-process is not available on NCCL ({device}): it has "
                          f"not run on GPUs yet; use --recovery auto or restart (a restart then "
                          f"recovers faults), or --device cpu (gloo)")


def unread_rendezvous(env: DistEnv) -> str | None:
    """Why a launch over several nodes has no rendezvous to recover through, in words; None
    where it has one, or runs on one node. Several nodes: ``GROUP_WORLD_SIZE``, or, where the
    agent's command line cannot be read (a wrapper that forks), a rendezvous id of the user's
    (``--standalone`` names each launch with a fresh uuid4, one node's default rendezvous is
    ``none``)."""
    if env.rendezvous is not None or not env.launched:
        return None
    argv = agent_command_line()
    named = env.run_id is not None and not is_generated_id(env.run_id)
    if env.group_world_size > 1 or (named and torchrun_arguments(argv) is None):
        return why_no_rendezvous(argv, os.getppid())
    return None


def report_stop(trainer: Trainer, stop: StopRequest, cfg: TrainConfig, env: DistEnv) -> int:
    """The line a stop before the end leaves, and the worker's exit status.

    SIGTERM (a scheduler's preemption or time limit) and a stop at another rank's request: every
    rank says it, exit EXIT_PREEMPTED, which schedulers and torchrun read as "not finished"
    (torchrun restarts the group). SIGINT (Ctrl-C) received by this process: rank 0 alone says it, with the
    checkpoint and the command that resumes, and the worker exits 0 under torchrun, which then
    ends as after a finished run instead of restarting it (under torchrun a worker gets SIGINT
    from the agent's own shutdown, or from a launcher that wants the job to end: jobs/local.sh),
    and EXIT_INTERRUPTED without a launcher, as shells expect of a program ended by Ctrl-C.
    Decided after the checkpoint is saved: ranks that a launcher signalled a moment after another
    have their signal by then.
    """
    step = trainer.progress.step
    if stop.signal_name != "SIGINT":
        log.warning("stopped at step %d after %s; checkpoint saved, exiting with %d", step,
                    stop.signal_name or "another rank's stop request", EXIT_PREEMPTED)
        return EXIT_PREEMPTED
    manifest = trainer.writers.checkpointer.last_manifest
    saved = (f"checkpoint saved: {Path(cfg.checkpoint.checkpoint_dir) / manifest.file}"
             if manifest is not None else "checkpoint saved")
    resume = cfg.run.resume_command or (
        "" if env.launched else shlex.join(["elastic-mnist", *sys.argv[1:]]))
    how = f"resume with: {resume}" if resume else "the same launch command resumes from it"
    say = log.warning if env.is_main else log.info
    say("stopped at step %d after Ctrl-C; %s; %s", step, saved, how)
    return 0 if env.launched else EXIT_INTERRUPTED


def check_checkpoint_folder(checkpoint_dir: Path, env: DistEnv, device: torch.device) -> None:
    """Every node's first rank makes sure the checkpoint folder can be written, before any step:
    a read-only or forbidden folder is said at once, in one line, on every node."""
    error: CheckpointWriteError | None = None
    if env.is_local_main:
        try:
            check_writable(checkpoint_dir)
        except CheckpointWriteError as e:
            error = e
    if not distributed.all_agree(error is None, device):
        if error is not None:
            raise error
        raise PeerStopped("another node cannot write the checkpoint folder",
                          exit_code=EXIT_CANNOT_SAVE)


def resolve_run_identity(cfg: TrainConfig, env: DistEnv, device: torch.device) -> tuple[str, int]:
    """The run id (the flag, else torchrun's when the user named it, else the one kept beside the
    checkpoints, else a new one) and this start's restart generation (one more than any before it
    in this checkpoint folder)."""
    checkpoint_dir = Path(cfg.checkpoint.checkpoint_dir)
    record = read_run_file(checkpoint_dir)
    previous = torch.tensor([record.get("restart_generation", -1)], device=device)
    generation = int(distributed.all_reduce_(previous, dist.ReduceOp.MAX).item()) + 1
    launcher_id = env.run_id if env.run_id and not is_generated_id(env.run_id) else None
    run_id = cfg.run.run_id or launcher_id or record.get("run_id") or new_run_id()
    run_id = distributed.broadcast_object(run_id, src=0, device=device)
    if env.is_local_main:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        write_run_file(checkpoint_dir, run_id, generation)
    return run_id, generation


def is_generated_id(run_id: str) -> bool:
    """torchrun --standalone names each launch with a fresh uuid4: not a name to keep."""
    try:
        return uuid.UUID(run_id).version == 4
    except ValueError:
        return False


def new_run_id() -> str:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"run-{stamp}-{uuid.uuid4().hex[:6]}"


def prepare_dataset(cfg: TrainConfig, env: DistEnv, device: torch.device) -> Dataset:
    """LOCAL_RANK 0 of each node prepares the files while the others wait; all then load them."""
    error: DataError | None = None
    kind = cfg.data.dataset
    if env.is_local_main:
        try:
            kind = prepare_files(cfg)
        except DataError as e:
            error = e
    outcome = torch.tensor([error is not None, kind == "synthetic"], dtype=torch.int32,
                           device=device)
    failed, synthetic = distributed.all_reduce_(outcome, dist.ReduceOp.MAX).tolist()
    if error is not None:
        raise error
    if failed:
        raise DataError("preparing the data failed on another node; see its log")
    kind = "synthetic" if synthetic else "mnist"
    dataset = load(dataset_root(Path(cfg.data.data_dir), cfg.data.dataset, kind), kind)
    check_same_data(dataset, env, device)
    return dataset


def prepare_files(cfg: TrainConfig) -> str:
    """Makes this node's data files exist, as ``--data-dir``, ``--dataset``, ``--download`` and
    ``--synthetic-fallback`` ask; returns the kind prepared."""
    d = cfg.data
    return prepare(Path(d.data_dir), d.dataset, download=d.download,
                   synthetic_fallback=d.synthetic_fallback)


def check_same_data(dataset: Dataset, env: DistEnv, device: torch.device) -> None:
    """Raises DataError, naming the ranks and hosts, unless every rank loaded the same digits
    (node-local data folders can hold other files, or files rendered by other code)."""
    mine = (dataset.fingerprint, platform.node(), str(dataset.root))
    everyone = distributed.all_gather_object(mine, device)
    if len({fingerprint for fingerprint, _, _ in everyone}) == 1:
        return
    groups: dict[str, list[str]] = {}
    for rank, (fingerprint, host, root) in enumerate(everyone):
        groups.setdefault(fingerprint, []).append(f"rank {rank} on {host} ({root})")
    described = "; ".join(f"{fingerprint[:SHORT]}: {', '.join(ranks)}"
                          for fingerprint, ranks in groups.items())
    raise DataError(f"the ranks would train on different data (fingerprints {described}); "
                    f"give every node the same files")


def find_resume_payload(checkpoint_dir: Path, env: DistEnv,
                        device: torch.device) -> tuple[dict, str] | None:
    """The newest valid checkpoint on any rank, agreed by all; its holder shares it when the
    checkpoint folders are node-local and not every rank has it."""
    found = newest_valid(checkpoint_dir) if checkpoint_dir.exists() else None
    mine = found[0].step if found else -1
    best = int(distributed.all_reduce_(torch.tensor([mine], device=device),
                                       dist.ReduceOp.MAX).item())
    if best < 0:
        return None
    if distributed.all_agree(mine == best, device):
        manifest, data = found
    else:
        candidate = torch.tensor([env.rank if mine == best else env.world_size], device=device)
        holder = int(distributed.all_reduce_(candidate, dist.ReduceOp.MIN).item())
        manifest, data = distributed.broadcast_object(
            found if env.rank == holder else None, src=holder, device=device)
        log.warning("checkpoint step %d came from rank %d", best, holder)
    source = str(checkpoint_dir / manifest.file)
    return deserialize(data, source), source


def launch_summary(cfg: TrainConfig, env: DistEnv, device: torch.device, dataset: Dataset,
                   trainer: Trainer) -> str:
    """The text entry of one launch, for TensorBoard."""
    lines = [
        f"command: `{' '.join(sys.argv)}`",
        f"torch {torch.__version__}, python {platform.python_version()}, host {platform.node()}",
        f"world: {env.describe()}, device {device}",
        f"precision: {trainer.engine.float32_math}",
        f"compile: {trainer.engine.compilation.describe()}",
        f"data: {dataset.describe()}",
        f"resumed from: {trainer.resumed_source or 'nothing (a fresh start)'}",
    ]
    if dataset.is_synthetic:
        lines.append(f"**{SYNTHETIC_WARNING}**")
    return "  \n".join(lines)
