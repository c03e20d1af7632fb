"""TCPStore servers of our own that listen where their peers connect, not on every interface.

torch's TCPStore server (the libuv backend, torch 2.14) binds the wildcard address ``::`` whatever
host it is given: a store created as ``TCPStore("127.0.0.1", 0, is_master=True)`` accepts
connections on every interface of the machine (``ss -ltn`` shows ``*:PORT``). Handed a socket that
is already bound and listening (``master_listen_fd``), it serves on that socket instead, so the
stores this package serves (a job's process-group store, the attempt store, ``elastic-mnist
rendezvous``) bind the address their peers reach them at: the address the advertised name
resolves to here. The stores that torch serves itself (torchrun's rendezvous store and the agent
store it shares with the workers) still listen on every interface; docs/operations.md's "What
listens where" lists them all.

The exception is a name that resolves to a loopback address here while peers on other machines
use it (a hosts file that maps this machine's name to 127.0.1.1, as Debian's does): they resolve
it to another address, which a loopback socket would not answer, so such a store listens on every
interface, as torch's own do.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket

from torch.distributed import TCPStore

from elastic_mnist.backoff import cap

EVERY_INTERFACE = ("", "*", "0.0.0.0", "::")
"""Host names that ask for every interface."""


def listen_address(host: str, *, peers_local: bool) -> tuple[socket.AddressFamily, str]:
    """(family, address) to bind so that peers that connect to ``host`` reach this machine;
    the address "" means every interface. ``peers_local``: every peer runs on this machine."""
    if host in EVERY_INTERFACE:
        return socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET, ""
    family, _, _, _, address = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0]
    ip = ipaddress.ip_address(address[0])
    if ip.is_loopback and not peers_local and not names_loopback(host):
        return listen_address("", peers_local=peers_local)
    return family, address[0]


def names_loopback(host: str) -> bool:
    """True for ``localhost`` and literal loopback addresses: names that mean this machine alone
    wherever they are resolved."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listening(host: str, port: int, timeout_s: float) -> bool:
    """Whether anything accepts connections at host:port (refused at once when nothing does)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def listening_socket(host: str, port: int, *, peers_local: bool) -> socket.socket:
    """A TCP socket bound to ``listen_address(host)`` and ``port`` (0: a free one), listening."""
    family, address = listen_address(host, peers_local=peers_local)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own server does
        cap(sock)  # passed on to every connection it accepts (backoff.py)
        if family == socket.AF_INET6 and not address:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # IPv4 too
        sock.bind((address, port))
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock


def serve_store(host: str, port: int, *, timeout: datetime.timedelta, peers_local: bool,
                world_size: int | None = None) -> TCPStore:
    """A TCPStore server on ``port`` (0: a free one) that listens where peers connecting to
    ``host`` arrive. Raises OSError when the port cannot be bound (EADDRINUSE)."""
    sock = listening_socket(host, port, peers_local=peers_local)
    bound = sock.getsockname()[1]
    # The server's own client connects to host:port; the store takes the socket over and closes
    # it, so Python must not close it too.
    return TCPStore("localhost" if host in EVERY_INTERFACE else host, bound, world_size,
                    is_master=True, timeout=timeout, wait_for_workers=False,
                    master_listen_fd=sock.detach())
