"""The worker's entry point: it owns the process group's lifecycle and the run's exit code."""

from __future__ import annotations

import logging

from torch.distributed.elastic.multiprocessing.errors import record

from elastic_mnist.config import TrainConfig
from elastic_mnist.distributed import process_group, resolve_device
from elastic_mnist.env import DistEnv
from elastic_mnist.errors import (
    EXIT_GAVE_UP,
    USER_ERRORS,
    CannotRecover,
    CheckpointError,
    Dropped,
    FolderInUse,
    PeerStopped,
    TrainingDiverged,
    first_to_say_dropped,
    report_user_error,
    wait_for_the_end,
)
from elastic_mnist.job import check_recovery, run_training
from elastic_mnist.joiner import join_training
from elastic_mnist.logs import setup_logging
from elastic_mnist.resilience.lease import checkpoint_folder_lease

log = logging.getLogger(__name__)


@record
def worker_main(cfg: TrainConfig, env: DistEnv) -> int:
    """Sets up logging, the device and the process group; trains; always tears down.

    Bad input (data, checkpoints, environment) ends the worker with one line and its exit code
    (errors.py: EXIT_USAGE, or the error's own); only real failures reach ``@record``, whose traceback torchrun prints in its summary.
    """
    setup_logging(env)
    try:
        device = resolve_device(cfg.run.device, env)
        check_recovery(cfg.run.recovery, device)  # before the group: every worker says it
        train = run_training if env.join is None else join_training  # a node joining a job
        with process_group(env, device, cfg.run.pg_timeout) as store, \
                checkpoint_folder_lease(cfg, env, device) as lease:  # one live job per folder
            return lease.ended(train(cfg, env, device, store, lease))
    except USER_ERRORS + (CheckpointError, TrainingDiverged, FolderInUse) as e:
        return report_user_error("train", e)
    except PeerStopped as e:
        return e.exit_code
    except Dropped as e:  # the others went on without this rank: its one line, no record
        if not first_to_say_dropped():  # a writer's fence says it, and ends the process
            wait_for_the_end()
        log.error("%s", e)
        return e.exit_code
    except CannotRecover as e:  # the survivors could not go on in process
        log.error("cannot go on in process: %s; leaving, so that torchrun restarts the job", e)
        return EXIT_GAVE_UP
