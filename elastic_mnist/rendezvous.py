"""``elastic-mnist rendezvous``: the rendezvous store as a small process of its own.

Under our rendezvous and torch's c10d alike, the agent on the endpoint's host serves the TCPStore
in which all agents meet (the rendezvous store); lose that node and the store goes with it, and so
does the job. Served by this process instead, on a machine outside every training node
(``RDZV_STORE=external`` in jobs/node.sh, where every agent starts with
``--rdzv_conf=is_host=false``), the store outlives any node, the first one included. It holds only
rendezvous state, a few small keys per round, so it needs no GPU and next to no memory; one store
serves any number of jobs (their ``--rdzv_id`` keeps them apart). It listens on the address
``--host`` resolves to (elastic_mnist/stores.py), not on every interface as torch's own store
server does; ``--host 0.0.0.0`` asks for every one. By default ``--host`` is this machine's host
name, which the agents on other machines reach it by (a name that resolves to loopback here, as
Debian's hosts file maps it, listens on every interface: the others resolve it otherwise); the
start-up line says what the agents must be given.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import threading
from datetime import timedelta

from elastic_mnist.errors import RendezvousError

log = logging.getLogger(__name__)

DEFAULT_PORT = 29400  # torchrun's default c10d rendezvous port
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# The store's own client connects to HOST:PORT once at start; a wrong HOST fails within this.
CONNECT_TIMEOUT = timedelta(seconds=30)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    host = socket.gethostname()
    parser.add_argument("--host", default=host,
                        help="this machine's name or address as the agents' --rdzv_endpoint "
                             "names it; the store listens on the address it resolves to here "
                             "(0.0.0.0: every interface; localhost: this machine alone) "
                             f"(default: this machine's host name, {host})")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help="port to listen on (0: any free port, logged) "
                             f"(default: {DEFAULT_PORT}, torchrun's)")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")
    return serve(args.host, args.port)


def serve(host: str, port: int) -> int:
    """Serves the store on ``port`` until SIGTERM or SIGINT, then returns 0."""
    if not 0 <= port <= 65535:
        raise RendezvousError(f"port {port} is not a TCP port (0 to 65535)")
    from torch.distributed import DistError  # torch is imported only when serving

    from elastic_mnist.stores import listen_address, serve_store

    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda signum, frame: stop.set()) for sig in STOP_SIGNALS}
    try:
        try:
            # The agents create their own keys (each rendezvous under its run id), so the store
            # waits for nobody and expects no world size. Agents may come from anywhere.
            address = listen_address(host, peers_local=False)[1] or "every interface"
            store = serve_store(host, port, timeout=CONNECT_TIMEOUT, peers_local=False)
        except (DistError, OSError) as e:
            raise RendezvousError(_explain(e, host, port)) from None
        log.info("rendezvous store listening on %s:%d (%s); %s", host, store.port, address,
                 agents_line(host, store.port))
        stop.wait()
        log.info("rendezvous store on %s:%d stopping", host, store.port)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def agents_line(host: str, port: int) -> str:
    """What the start-up line tells the operator to give the agents, or why none elsewhere can
    use this store."""
    from elastic_mnist.stores import EVERY_INTERFACE, names_loopback

    if names_loopback(host):
        return (f"{host} is this machine alone: agents on other machines cannot reach it; for "
                f"them pass --host with this machine's name or address "
                f"({socket.gethostname()})")
    if host in EVERY_INTERFACE:
        host = f"<this machine's name or address, e.g. {socket.gethostname()}>"
    endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return (f"agents: RDZV_STORE=external RDZV_ENDPOINT={endpoint} (jobs/node.sh), or "
            f"torchrun --rdzv_endpoint={endpoint} --rdzv_conf=is_host=false,...")


def _explain(error: Exception, host: str, port: int) -> str:
    message = str(error).splitlines()[0] if str(error) else type(error).__name__
    if isinstance(error, socket.gaierror):
        return (f"--host {host} does not resolve on this machine ({message}): pass a name or "
                f"address of this machine that the agents reach")
    if "EADDRINUSE" in message or "address already in use" in message.lower():
        return (f"port {port} is already in use (another rendezvous store, or a job's agent, "
                f"listens there): choose another --port")
    return f"cannot serve the rendezvous store on {host}:{port}: {message}"
