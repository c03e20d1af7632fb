"""One agent's rendezvous settings (agents.py): torchrun's ``RendezvousParameters`` and its
``--nproc_per_node``, read as torch reads them.

``--rdzv_conf`` keys, read as torch's c10d backend reads them (seconds may have fractions here):
``join_timeout`` (600), ``last_call_timeout`` (30), ``keep_alive_interval`` (5),
``keep_alive_max_attempt`` (3), ``is_host`` (whether the endpoint's host is this machine),
``read_timeout`` (60: the store's, for connecting and reading). ``timeout``, which torchrun always
passes (its legacy rendezvous timeout, 900 unless given), is ignored as c10d ignores it:
``join_timeout`` bounds the join.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousParameters
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from elastic_mnist.errors import first_line
from elastic_mnist.rendezvous import DEFAULT_PORT
from elastic_mnist.resilience import roster as rs

log = logging.getLogger(__name__)

NAME = "elastic-mnist"
"""The backend's name: ``--rdzv_backend=elastic-mnist`` (pyproject.toml's entry point)."""

CONF = {"join_timeout", "last_call_timeout", "keep_alive_interval", "keep_alive_max_attempt",
        "is_host", "timeout", "read_timeout"}


@dataclass(frozen=True)
class Settings:
    """One agent's rendezvous, from torchrun's ``RendezvousParameters``."""

    run_id: str
    host: str
    port: int
    min_nodes: int
    max_nodes: int
    local_addr: str | None = None
    is_host: bool | None = None
    """``is_host`` of ``--rdzv_conf``; None: whether ``host`` is this machine."""
    join_timeout_s: float = 600.0
    last_call_timeout_s: float = 30.0
    keep_alive_interval_s: float = rs.KEEP_ALIVE_S
    keep_alive_max_attempt: int = rs.KEEP_ALIVE_ATTEMPTS
    timeout_s: float = 60.0

    @classmethod
    def from_params(cls, params: RendezvousParameters) -> Settings:
        host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
        unknown = sorted(set(params.config) - CONF)
        if unknown:
            log.warning("the %s rendezvous ignores --rdzv_conf key(s) %s (it reads %s)", NAME,
                        ", ".join(unknown), ", ".join(sorted(CONF)))

        def seconds(key: str, default: float, zero: bool = False) -> float:
            value = params.get(key, default)
            try:
                parsed = float(value)
            except (TypeError, ValueError):
                parsed = float("nan")
            if not (0 <= parsed < float("inf")) or (parsed == 0 and not zero):
                raise ValueError(f"--rdzv_conf {key}={value!r}: a number of seconds "
                                 f"{'of 0 or more' if zero else 'above 0'} is expected")
            return parsed

        attempts = params.get_as_int("keep_alive_max_attempt", rs.KEEP_ALIVE_ATTEMPTS)
        if attempts is None or attempts < 1:
            raise ValueError(f"--rdzv_conf keep_alive_max_attempt={attempts}: 1 or more")
        return cls(run_id=params.run_id, host=host, port=port, min_nodes=params.min_nodes,
                   max_nodes=params.max_nodes, local_addr=params.local_addr,
                   is_host=params.get_as_bool("is_host"),
                   join_timeout_s=seconds("join_timeout", 600.0),
                   last_call_timeout_s=seconds("last_call_timeout", 30.0, zero=True),
                   keep_alive_interval_s=seconds("keep_alive_interval", rs.KEEP_ALIVE_S),
                   keep_alive_max_attempt=attempts,
                   timeout_s=seconds("read_timeout", 60.0))


def torchrun_nproc(argv: list[str] | None = None) -> int:
    """``--nproc_per_node`` as torchrun itself reads it from this agent's command line."""
    from torch.distributed.run import determine_local_world_size, get_args_parser

    parser = get_args_parser()

    def refuse(message: str) -> None:
        raise ValueError(message)

    parser.error = refuse  # type: ignore[method-assign] - argparse would exit
    argv = sys.argv[1:] if argv is None else argv
    try:
        return determine_local_world_size(parser.parse_args(argv).nproc_per_node)
    except (ValueError, SystemExit) as e:
        raise RendezvousError(
            f"the {NAME} rendezvous reads --nproc_per_node from torchrun's command line, and "
            f"this one is not torchrun's ({first_line(e)}): {' '.join(argv)[:200]}") from None
