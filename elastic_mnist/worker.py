"""The worker's entry point: it owns the process group's lifecycle and the run's exit code."""

from __future__ import annotations

from torch.distributed.elastic.multiprocessing.errors import record

from elastic_mnist.config import TrainConfig
from elastic_mnist.distributed import process_group, resolve_device
from elastic_mnist.env import DistEnv
from elastic_mnist.job import run_training
from elastic_mnist.logs import setup_logging


@record
def worker_main(cfg: TrainConfig, env: DistEnv) -> int:
    """Sets up logging, the device and the process group; trains; always tears down."""
    setup_logging(env)
    device = resolve_device(cfg.run.device, env)
    with process_group(env, device, cfg.run.pg_timeout):
        return run_training(cfg, env, device)
