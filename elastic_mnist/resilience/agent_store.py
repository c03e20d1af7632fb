"""An agent's rendezvous store (agents.py), its one job: the TCPStore of ``--rdzv_endpoint``,
served by the agent on the endpoint's host (listening where that host's name resolves,
elastic_mnist/stores.py; another agent there connects when the port is taken), else connected
to, once it listens: the nodes of a job start together, and an agent waits for the store as long
as for the job's first nodes.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from elastic_mnist.errors import first_line
from elastic_mnist.resilience.agent_settings import Settings
from elastic_mnist.resilience.in_flight import InFlight, within

log = logging.getLogger(__name__)

POLL_S = 0.05
"""How often an agent looks whether the store listens."""

CONNECT_S = 2.0
"""How long the opening of a fresh connection is waited for (:meth:`Connection.renew`)."""


class Connection:
    """The agent's connection to the store, which :meth:`renew` replaces by a fresh one; every
    call goes to the current one. A call held by a silent connection waits, in torch 2.14.1, as
    long as TCP keeps the connection (about 15 minutes), and after the heal as long as TCP's
    retransmissions were backed off, where a fresh connection answers at once (agent_monitor.py
    renews it). So each call is made in a thread of its own and waited for ``bound_s`` (the
    rendezvous' ``join_timeout``) at most: then the agent ends in one line. Every call of the
    rendezvous is a quick one (none waits for a key), and none is retried: an ``add`` held may
    still land."""

    def __init__(self, store: dist.TCPStore, reopen: Callable[[], dist.TCPStore],
                 bound_s: float):
        self._store, self.bound_s, self._held = store, bound_s, False
        self._opening = InFlight(reopen, "rdzv-connect", lambda _: None)
        """One opening at a time: one held by a store that accepts and says nothing is waited
        for again by the next renewal, not opened anew."""

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._store, name)
        if not callable(found):
            return found
        return lambda *args, **kwargs: self._bounded(name, args, kwargs)

    def _bounded(self, name: str, args: tuple, kwargs: dict) -> Any:
        """One call, bounded; after a call held past the bound the connection is held too: the
        next goes on a fresh one, or fails at once (the agent's shutdown, after the round
        that failed, leaves in seconds instead of waiting as long again)."""
        if self._held and not self.renew():
            raise RendezvousConnectionError(f"the rendezvous store does not answer {name}()")
        self._held = False
        call = getattr(self._store, name)
        try:
            return within(lambda: call(*args, **kwargs), self.bound_s, "rdzv-call")
        except TimeoutError:
            self._held = True
            raise RendezvousConnectionError(
                f"the rendezvous store did not answer {name}() within {self.bound_s:g} s "
                f"(join_timeout of --rdzv_conf): this agent leaves") from None

    def renew(self) -> bool:
        """Whether a fresh connection opened within ``CONNECT_S``: then the calls go to it (one
        in flight on the old one is left to it)."""
        try:
            self._store = self._opening.result(CONNECT_S, lambda in_flight, left: left)
        except (RuntimeError, TimeoutError) as e:  # refused, or held: the store is still away
            log.debug("no fresh connection to the rendezvous store: %s", first_line(e))
            return False
        return True


def client(settings: Settings, port: int) -> dist.TCPStore:
    """A connection to the store at ``settings``' host and ``port``."""
    return dist.TCPStore(settings.host, port, is_master=False,
                         timeout=datetime.timedelta(seconds=settings.timeout_s))


def connect(s: Settings) -> tuple[dist.TCPStore | None, dist.TCPStore]:
    """(the store this agent serves, or None; this agent's connection to the store)."""
    from elastic_mnist.stores import listening, serve_store

    server = None
    if s.is_host if s.is_host is not None else is_this_machine(s.host):
        try:
            server = serve_store(s.host, s.port, peers_local=False,
                                 timeout=datetime.timedelta(seconds=s.timeout_s))
            log.info("this agent (pid %d) serves the rendezvous store on %s:%d",
                     os.getpid(), s.host, server.port)
        except (OSError, RuntimeError) as e:
            if s.is_host:
                raise RendezvousConnectionError(
                    f"cannot serve the rendezvous store on {s.host}:{s.port} (is_host=true): "
                    f"{first_line(e)}") from None
    if server is not None:
        return server, client(s, server.port)
    # Another node's agent serves it, or `elastic-mnist rendezvous`: the nodes of a job start
    # together, and this one waits for the store as long as for the job's first nodes.
    deadline = time.monotonic() + s.join_timeout_s
    # Not torch's own retries: they log a C++ trace when they end.
    while not listening(s.host, s.port, timeout_s=1.0):
        if time.monotonic() >= deadline:
            sys.stderr.write(f"torchrun: error: no rendezvous store answers at {s.host}:"
                             f"{s.port} after {s.join_timeout_s:g} s (join_timeout of "
                             f"--rdzv_conf); start the head node or the store first, or fix "
                             f"--rdzv_endpoint\n")
            raise SystemExit(2)
        time.sleep(POLL_S)
    try:
        return None, client(s, s.port)
    except RuntimeError as e:
        raise RendezvousConnectionError(f"cannot reach the rendezvous store at {s.host}:"
                                        f"{s.port}: {first_line(e)}") from None


def is_this_machine(host: str) -> bool:
    """Whether ``host`` names this machine: a loopback name or address, its host name, or a
    name that resolves to one of its host name's addresses."""
    try:
        if host == "localhost" or ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        pass
    if host in (socket.gethostname(), socket.getfqdn()):
        return True
    try:
        theirs = {info[4][0] for info in socket.getaddrinfo(host, None)}
        ours = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    except (OSError, UnicodeError):
        return False
    return bool(theirs & ours)
