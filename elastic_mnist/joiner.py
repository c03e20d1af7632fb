"""A worker of a node that joins a job as it trains (``ELASTIC_MNIST_JOIN``, set by our
rendezvous's handler): its start-up, which runs none of the job's start-up collectives.

There is no group to run them in until the job admits the node. The worker learns the run id,
the launch, the generation from the rendezvous records (``job``, which the job's rank 0
publishes), and the job's flags, data and model from rank 0's description of the job (below);
prepares the data on its node (the node's first worker prepares, the others wait on the store);
builds the trainer, checks it against the job's (a mismatch is one line and a non-zero exit);
and then, in :meth:`Trainer.fit`, says it is ready, waits for the job to admit its node, takes
its place and rank 0's state, and trains as any rank.
"""

from __future__ import annotations

import datetime
import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elastic_mnist.config import TrainConfig
from elastic_mnist.data.datasets import Dataset, dataset_root, load
from elastic_mnist.data.fingerprint import SHORT
from elastic_mnist.duties import Duties
from elastic_mnist.env import OUR_BACKEND, DistEnv
from elastic_mnist.errors import DataError, EnvError, first_line
from elastic_mnist.job import DESCRIPTION, prepare_files, train_to_the_end
from elastic_mnist.resilience.admissions import join_key
from elastic_mnist.resilience.fence import Fence
from elastic_mnist.resilience.lease import LeaseHold
from elastic_mnist.resilience.membership import PREFIX, Membership
from elastic_mnist.resilience.roster import Roster
from elastic_mnist.resilience.torchrun_agents import agents_for
from elastic_mnist.state import check_compatible, check_lockstep
from elastic_mnist.trainer import Trainer

log = logging.getLogger(__name__)


def join_training(cfg: TrainConfig, env: DistEnv, device: torch.device,
                  store: dist.Store | None = None, lease: LeaseHold | None = None) -> int:
    """Joins the job published at this worker's rendezvous, trains to its end, and returns the
    exit status as :func:`~elastic_mnist.job.run_training` does (0, also when the job finished
    before it admitted this node)."""
    rdzv = env.rendezvous
    if rdzv is None or rdzv.backend != OUR_BACKEND:
        raise EnvError("ELASTIC_MNIST_JOIN is set, but not ELASTIC_MNIST_RDZV: a node joins a "
                       "job in process only under --rdzv_backend=elastic-mnist")
    timeout = datetime.timedelta(seconds=cfg.run.pg_timeout)
    raw = dist.TCPStore(rdzv.host, rdzv.port, is_master=False, timeout=timeout)
    records = Roster(raw.clone(), rdzv.run_id)
    job = records.job()
    if job is None or not job.in_process:
        raise EnvError(f"ELASTIC_MNIST_JOIN is set, but no job that nodes can join in process "
                       f"is published at the rendezvous {rdzv.endpoint} (id {rdzv.run_id})")
    if job.finished:
        log.warning("the job %s finished before this node could join it", job.run_id)
        return 0
    launch = dist.PrefixStore(f"{PREFIX}/{rdzv.run_id}/{job.launch}", raw)
    run_id, checkpoint_dir = job.run_id, Path(cfg.checkpoint.checkpoint_dir)
    log.info("joining run %s at generation %d (join %d of round %d)", run_id, job.generation,
             env.join, rdzv.round)

    dataset = prepare_node_data(cfg, env, launch)
    description = json.loads(launch.get(DESCRIPTION))
    check_joinable(description, cfg, dataset)
    membership = Membership(env, device, launch, job.generation, cfg.run.pg_timeout,
                            bound_s=2 * cfg.run.hang_timeout, folder=checkpoint_dir,
                            launch=job.launch, agents=agents_for(env), records=records,
                            run_id=run_id, joining=True)
    duties = Duties(cfg, run_id, Path(cfg.run.logdir) / run_id, checkpoint_dir, store,
                    membership, Fence(membership.dropped,
                                      *([lease.taken] if lease is not None else []),
                                      fallback=membership.dropped_by_file))
    if lease is not None:
        lease.fence_renewals(duties.fence)
    trainer = Trainer(cfg, env, device, dataset, run_id=run_id,
                      restart_generation=job.generation, membership=membership,
                      after_change=duties.after)
    check_compatible(payload_of(description), trainer.model, cfg, dataset,
                     f"the job {run_id} that this node joins")
    duties.total_steps = trainer.total_steps
    return train_to_the_end(cfg, env, trainer, duties)


def prepare_node_data(cfg: TrainConfig, env: DistEnv, store: dist.Store) -> Dataset:
    """The node's first joining worker prepares the files while the others wait on ``store``
    (the node's joiners have no group either); all then load them."""
    key = join_key(env.rendezvous.round, env.join, "data")
    if env.is_local_main:
        try:
            kind = prepare_files(cfg)
        except DataError as e:
            store.set(key, json.dumps({"error": first_line(e)}))
            raise
        store.set(key, json.dumps({"kind": kind}))
    else:
        prepared = json.loads(store.get(key))
        if "error" in prepared:
            raise DataError("preparing the data failed on this node's first worker; see its log")
        kind = prepared["kind"]
    return load(dataset_root(Path(cfg.data.data_dir), cfg.data.dataset, kind), kind)


def check_joinable(description: dict[str, Any], cfg: TrainConfig, dataset: Dataset) -> None:
    """ConfigError or DataError, in one line, unless this worker runs with the flags that keep
    it in step with the job's ranks, on the same digits."""
    check_lockstep(description["config"], cfg)
    theirs = description["data"]
    if theirs["fingerprint"] != dataset.fingerprint:
        raise DataError(f"the job this node joins trains on other digits (fingerprint "
                        f"{theirs['fingerprint'][:SHORT]}, {theirs['num_train']} "
                        f"{theirs['kind']} samples) than this node's {dataset.root} "
                        f"({dataset.fingerprint[:SHORT]}, {len(dataset.train)} "
                        f"{dataset.kind}); give this node the job's data")


def payload_of(description: dict[str, Any]) -> dict[str, Any]:
    """The job's description as the payload that :func:`check_compatible` reads: shapes
    without values."""
    model = {key: torch.empty(shape, device="meta") for key, shape in
             description["model"].items()}
    return {"model": model, "config": description["config"], "data": description["data"]}
