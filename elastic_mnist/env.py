"""Who this process is: torchrun's environment, read and validated in one place.

Everything else receives a :class:`DistEnv` as an argument; nothing else reads these variables.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from elastic_mnist.errors import EnvError


@dataclass(frozen=True)
class Rendezvous:
    """The multi-node rendezvous that torchrun's agents meet at (ours, or torch's c10d): its
    store outlives any one node (any but its own host's, unless served by `elastic-mnist
    rendezvous`)."""

    host: str
    port: int
    run_id: str
    """``--rdzv_id``: the job's name at the store; its keys are kept apart by it."""
    keep_alive_interval_s: float = 5.0
    """``keep_alive_interval`` of ``--rdzv_conf``: how often each agent renews its place."""
    keep_alive_max_attempt: int = 3
    """``keep_alive_max_attempt`` of ``--rdzv_conf``: the renewals an agent may miss before the
    rendezvous drops it."""
    local_addr: str | None = None
    """``--local_addr``: the name the agent goes by in the rendezvous (its host's fully qualified
    name when None)."""
    backend: str = "c10d"
    """``--rdzv_backend``: torch's ``c10d``, or ``elastic-mnist`` (ours: resilience/agents.py),
    whose agents tell their workers all of this in their environment."""
    agent: str = ""
    """Our backend: this process's agent's name in the rendezvous (``ELASTIC_MNIST_AGENT``)."""
    round: int | None = None
    """Our backend: the rendezvous round the agent started this worker in
    (``ELASTIC_MNIST_ROUND``)."""
    join: int | None = None
    """Our backend: the admission this worker's node joins the running job by
    (``ELASTIC_MNIST_JOIN``); None for a worker of the round's own start."""

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class DistEnv:
    """The torchrun environment of one worker process."""

    rank: int = 0
    """Global rank of this process (``RANK``)."""
    local_rank: int = 0
    """Rank of this process on its node (``LOCAL_RANK``); also its GPU index."""
    world_size: int = 1
    """Number of processes in the job (``WORLD_SIZE``)."""
    local_world_size: int = 1
    """Number of processes on this node (``LOCAL_WORLD_SIZE``)."""
    group_rank: int = 0
    """Rank of this node among the nodes (``GROUP_RANK``)."""
    group_world_size: int = 1
    """Number of nodes (torchrun agents) of the rendezvous round (``GROUP_WORLD_SIZE``)."""
    restart_count: int = 0
    """How many times torchrun restarted this node's workers (``TORCHELASTIC_RESTART_COUNT``)."""
    run_id: str | None = None
    """The rendezvous id (``TORCHELASTIC_RUN_ID``); None when torchrun did not name one."""
    master_addr: str | None = None
    """Address of the rank-0 store (``MASTER_ADDR``)."""
    master_port: int | None = None
    """Port of the rank-0 store (``MASTER_PORT``)."""
    launched: bool = False
    """True when a launcher (torchrun) set ``RANK`` and ``WORLD_SIZE``."""
    uses_agent_store: bool = False
    """``MASTER_ADDR:MASTER_PORT`` is torchrun's own rendezvous store, shared with the workers
    and kept across restarts (``TORCHELASTIC_USE_AGENT_STORE=True``, torch's default)."""
    rendezvous: Rendezvous | None = None
    """The rendezvous torchrun's agents meet at: ours (``--rdzv_backend=elastic-mnist``), as
    its agent tells its workers (:func:`our_rendezvous`); or torch's multi-node c10d one
    (``--rdzv_endpoint``, ``--rdzv_id``), for which torchrun hands its workers no variable: it is
    read from the agent's command line, with torchrun's own argument parser. None for one node
    on c10d (``--standalone``, ``--nnodes=1``), other backends, or when it cannot be read."""
    requeue_count: int = 0
    """How often the scheduler put this job back into its queue (SLURM's
    ``SLURM_RESTART_COUNT``; 0 elsewhere): which copy of the job this is."""

    @property
    def is_main(self) -> bool:
        """True on the one process that writes logs, events and checkpoints."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """True on the one process per node that prepares node-local files."""
        return self.local_rank == 0

    @property
    def join(self) -> int | None:
        """The admission this worker's node joins a running job by (our rendezvous's
        ``ELASTIC_MNIST_JOIN``): its workers start no group of their own, and enter the job's next
        generation when it admits them (joiner.py). None for a worker of a whole job's start."""
        return None if self.rendezvous is None else self.rendezvous.join

    @property
    def is_distributed(self) -> bool:
        """True when a process group must be created."""
        return self.launched

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None,
                     launcher_argv: Sequence[str] | None = None) -> DistEnv:
        """Builds the environment from ``os.environ`` (or ``environ``), raising EnvError if bad.

        ``launcher_argv``: the agent's command line (default: read from ``/proc`` for
        ``os.environ``, none for a given ``environ``).
        """
        env = os.environ if environ is None else environ
        ours = our_rendezvous(env)
        if launcher_argv is None and environ is None and ours is None:
            launcher_argv = agent_command_line()
        has_rank, has_world = "RANK" in env, "WORLD_SIZE" in env
        if has_rank != has_world:
            missing = "WORLD_SIZE" if has_rank else "RANK"
            present = "RANK" if has_rank else "WORLD_SIZE"
            raise EnvError(f"{present} is set but {missing} is not; launch with torchrun")
        requeue_count = _int(env, "SLURM_RESTART_COUNT", 0, minimum=0)
        if not has_rank:
            return cls(restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0, minimum=0),
                       requeue_count=requeue_count)

        world_size = _int(env, "WORLD_SIZE", minimum=1)
        rank = _int(env, "RANK", minimum=0)
        if rank >= world_size:
            raise EnvError(f"RANK={rank} must be below WORLD_SIZE={world_size}")
        local_world_size = _int(env, "LOCAL_WORLD_SIZE", world_size, minimum=1)
        if local_world_size > world_size:
            raise EnvError(
                f"LOCAL_WORLD_SIZE={local_world_size} exceeds WORLD_SIZE={world_size}"
            )
        local_rank = _int(env, "LOCAL_RANK", rank if world_size == local_world_size else None,
                          minimum=0)
        if local_rank >= local_world_size:
            raise EnvError(
                f"LOCAL_RANK={local_rank} must be below LOCAL_WORLD_SIZE={local_world_size}"
            )
        run_id = env.get("TORCHELASTIC_RUN_ID") or None
        master_port = env.get("MASTER_PORT")
        return cls(
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=local_world_size,
            group_rank=_int(env, "GROUP_RANK", 0, minimum=0),
            group_world_size=_int(env, "GROUP_WORLD_SIZE", 1, minimum=1),
            restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0, minimum=0),
            run_id=None if run_id == "none" else run_id,
            master_addr=env.get("MASTER_ADDR") or None,
            master_port=None if master_port is None else _int(env, "MASTER_PORT", minimum=1),
            launched=True,
            uses_agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            rendezvous=ours or rendezvous_of(launcher_argv or ()),
            requeue_count=requeue_count,
        )

    def describe(self) -> str:
        """One line for logs: rank, world and restart."""
        return (
            f"rank {self.rank}/{self.world_size} (local {self.local_rank}/"
            f"{self.local_world_size}, node {self.group_rank}), restart {self.restart_count}"
        )


def _int(env: Mapping[str, str], name: str, default: int | None = None, *,
         minimum: int) -> int:
    raw = env.get(name)
    if raw is None:
        if default is None:
            raise EnvError(f"{name} is not set; launch with torchrun")
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise EnvError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise EnvError(f"{name}={value} must be at least {minimum}")
    return value


def agent_command_line(pid: int | None = None) -> list[str]:
    """The command line of the process that started this one (torchrun's agent, when launched
    by it); empty where ``/proc`` cannot tell."""
    try:
        raw = Path(f"/proc/{pid or os.getppid()}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0")[:-1]]


LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch")
"""Modules that start torchrun's agent (``python -m MODULE``; ``launch`` is its deprecated
name, with the same arguments and one more)."""


def torchrun_arguments(argv: Sequence[str]) -> list[str] | None:
    """The arguments of a torchrun command line (``torchrun ARGS``, ``python -m
    torch.distributed.run ARGS``, ``python -mtorch.distributed.run ARGS``, the same with
    ``torch.distributed.launch``); None when ``argv`` starts no torchrun agent."""
    argv = list(argv)
    for i, arg in enumerate(argv):
        module = arg.removeprefix("-m") in LAUNCHER_MODULES and (
            arg.startswith("-m") or (i > 0 and argv[i - 1] == "-m"))
        if module or Path(arg).name == "torchrun":
            return argv[i + 1:]
    return None


def why_no_rendezvous(argv: Sequence[str], pid: int) -> str:
    """Why the command line ``argv`` of the worker's parent ``pid`` gives no multi-node c10d
    rendezvous (:func:`rendezvous_of`), in words."""
    if torchrun_arguments(argv) is None:
        return (f"the worker's parent (pid {pid}, `{Path(argv[0]).name if argv else '?'}`) is "
                f"not a torchrun agent whose --rdzv_endpoint it can read")
    return ("its torchrun agent's rendezvous is not a multi-node c10d one "
            "(--rdzv_backend=c10d, --rdzv_endpoint, --nnodes above 1)")


OUR_BACKEND = "elastic-mnist"
"""Our rendezvous backend's name (``--rdzv_backend=elastic-mnist``)."""


def our_rendezvous(env: Mapping[str, str]) -> Rendezvous | None:
    """The rendezvous our backend's agent exported to this worker (resilience/agents.py:
    ``ELASTIC_MNIST_RDZV`` host:port, ``..._RDZV_ID``, ``..._AGENT``, ``..._ROUND``,
    ``..._KEEP_ALIVE`` interval,attempts, and ``..._JOIN`` for a node joining the running job);
    None without it. Raises EnvError for values no agent of ours writes."""
    endpoint = env.get("ELASTIC_MNIST_RDZV")
    if not endpoint:
        return None
    host, _, port = endpoint.rpartition(":")
    interval, _, attempts = env.get("ELASTIC_MNIST_KEEP_ALIVE", "5,3").partition(",")
    try:
        keep_alive = (float(interval), int(attempts))
        if not host or int(port) <= 0 or keep_alive[0] <= 0 or keep_alive[1] < 1:
            raise ValueError
    except ValueError:
        raise EnvError(f"ELASTIC_MNIST_RDZV={endpoint!r} with ELASTIC_MNIST_KEEP_ALIVE="
                       f"{env.get('ELASTIC_MNIST_KEEP_ALIVE')!r} is not a rendezvous of "
                       f"--rdzv_backend={OUR_BACKEND}") from None
    join = env.get("ELASTIC_MNIST_JOIN")
    return Rendezvous(host.strip("[]"), int(port), env.get("ELASTIC_MNIST_RDZV_ID", ""),
                      *keep_alive, backend=OUR_BACKEND, agent=env.get("ELASTIC_MNIST_AGENT", ""),
                      round=_int(env, "ELASTIC_MNIST_ROUND", 0, minimum=0),
                      join=None if join is None else _int(env, "ELASTIC_MNIST_JOIN", minimum=0))


def rendezvous_of(argv: Sequence[str]) -> Rendezvous | None:
    """The multi-node c10d rendezvous in a torchrun command line (:func:`torchrun_arguments`),
    parsed as torchrun parses it (its ``PET_*`` variables included); None when there is none
    to outlive a node."""
    arguments = torchrun_arguments(argv)
    if arguments is None:
        return None
    from torch.distributed.elastic.rendezvous.utils import (  # only under torchrun: torch is there
        _parse_rendezvous_config,  # torchrun's own parser of --rdzv_conf
        parse_rendezvous_endpoint,
    )
    from torch.distributed.run import get_args_parser

    try:
        args, _ = get_args_parser().parse_known_args(arguments)
        host, port = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=29400)
        conf = _parse_rendezvous_config(args.rdzv_conf)
        keep_alive = (float(conf.get("keep_alive_interval") or 5),
                      int(conf.get("keep_alive_max_attempt") or 3))
    except (SystemExit, ValueError):  # not a command line torchrun would take
        return None
    max_nodes = str(args.nnodes).rpartition(":")[2]
    if args.standalone or args.rdzv_backend != "c10d" or max_nodes == "1" or port == 0:
        return None
    return Rendezvous(host, port, args.rdzv_id, *keep_alive, local_addr=args.local_addr)
