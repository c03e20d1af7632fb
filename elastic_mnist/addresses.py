"""Where gloo listens, said at start when ranks on other machines could not reach it.

torch 2.14 gives each gloo group one device (``torch/csrc/distributed/c10d/init.cpp``,
``ProcessGroupGloo.cpp``): with ``GLOO_SOCKET_IFNAME`` longer than one character, one per
interface it names (a comma-separated list); otherwise ``createDefaultDevice``: this host's name
(``gethostname``), resolved by ``getaddrinfo``, and the first of its addresses that a socket can
bind (gloo's ``lookupAddrForHostname``); when none can, 127.0.0.1, with torch's warning. Gloo
listens there and publishes that address in the group's store, and every other rank connects to
it. Where the host name resolves to 127.0.1.1 (Debian's ``/etc/hosts`` maps it so) a rank on
another machine connects to its own loopback and is refused ("Gloo connectFullMesh failed ...
Connection refused, remote=[127.0.1.1]:PORT"), while the rank it wanted waits out its timeout:
so it went with two ranks on hosts of their own (scripts/hosts.py) whose hosts files map their
names so, and with ``GLOO_SOCKET_IFNAME`` set they met. tests/test_addresses.py shows this
module's line on such a host.

It is a warning, not a refusal: nodes that all run on this machine (several agents on one host,
as the tests start them) reach each other on loopback, and a worker cannot tell at its start
whether the other nodes are on this machine. Where every node meets at a rendezvous on a loopback
name (``localhost``, 127.0.0.1), they all are, and nothing is said.

NCCL is not concerned: it picks its interface itself (``NCCL_SOCKET_IFNAME`` chooses), never by
the host name. Standard library only: a worker imports it before torch's process group exists.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import Mapping, Sequence

from elastic_mnist.env import DistEnv

log = logging.getLogger(__name__)

IFNAME = "GLOO_SOCKET_IFNAME"
"""The interfaces gloo listens on, by name (comma-separated), instead of the host name's address."""
FALLBACK = "127.0.0.1"
"""Where gloo listens when no address of the host name can be bound here."""
SIOCGIFADDR = 0x8915
"""Linux's ioctl for an interface's IPv4 address."""


# --- what gloo would do, and what to say (pure) --------------------------------------------------


def ifname_is_set(value: str | None) -> bool:
    """Whether torch reads ``GLOO_SOCKET_IFNAME``: only a value longer than one character."""
    return value is not None and len(value) > 1


def is_loopback(address: str) -> bool:
    """``localhost`` or a loopback address (127.0.0.0/8, ::1): this machine alone, wherever it is
    resolved. A name that resolves elsewhere is not."""
    try:
        return address == "localhost" or ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


def gloo_address(addresses: Sequence[str]) -> str:
    """The address gloo listens on, given the host name's addresses that bind here, in the
    resolver's order: the first, else its fallback."""
    return addresses[0] if addresses else FALLBACK


def advice(host_name: str, addresses: Sequence[str], ifname: str | None, spans_machines: bool,
           interfaces: Sequence[tuple[str, str]] = (), toward_store: str | None = None
           ) -> str | None:
    """The one line to say at start, or None when gloo can be reached from other machines, or
    need not be.

    ``addresses``: the host name's addresses that bind here, in the resolver's order (gloo takes
    the first); ``ifname``: ``GLOO_SOCKET_IFNAME``; ``spans_machines``: the job's nodes may run on
    other machines; ``interfaces``: this host's (name, IPv4 address), loopback left out;
    ``toward_store``: the address this host reaches the rendezvous store from, to name its
    interface."""
    if not spans_machines or ifname_is_set(ifname):
        return None
    address = gloo_address(addresses)
    if not is_loopback(address):
        return None
    where = (f"where this host's name {host_name!r} resolves" if addresses else
             f"its fallback: this host's name {host_name!r} resolves to no address of its own")
    listed = "; ".join(f"{name} {ip}" + (", toward the rendezvous store" if ip == toward_store
                                         else "") for name, ip in interfaces)
    return (f"gloo will listen on {address}, {where}, which ranks on other machines cannot "
            f"reach; set {IFNAME} on every node to its interface on the nodes' network (this "
            f"host: {listed or 'none but loopback'}), or map {host_name!r} to that address in "
            f"/etc/hosts; nodes that all run on this machine need neither")


# --- this host -----------------------------------------------------------------------------------


def this_machine() -> str | None:
    """This host, told apart from the others where their host names are not: the kernel's boot
    id and the network namespace's (hosts of their own on one kernel, scripts/hosts.py, differ
    by the second); None where Linux's /proc does not say."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return None


def spans_machines(env: DistEnv) -> bool:
    """Whether the job's nodes may run on other machines than this one: a multi-node
    rendezvous whose store is not on a loopback name, or, where none can be read (another
    backend), a round of several nodes whose ``MASTER_ADDR`` is not a loopback name."""
    if env.rendezvous is not None:
        return not is_loopback(env.rendezvous.host)
    return env.group_world_size > 1 and not is_loopback(env.master_addr or "localhost")


def bindable_addresses(host_name: str) -> list[str]:
    """The addresses of ``host_name`` that a socket can bind here, in the resolver's order, as
    gloo tries them (any family, stream sockets); empty when the name does not resolve."""
    try:
        found = socket.getaddrinfo(host_name, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    bindable = []
    for family, kind, proto, _, sockaddr in found:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.bind(sockaddr)
        except OSError:
            continue
        bindable.append(sockaddr[0])
    return bindable


def interface_address(name: str) -> str | None:
    """The IPv4 address of the interface ``name`` on this host; None where it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            answer = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(answer[20:24])


def interfaces() -> list[tuple[str, str]]:
    """This host's interfaces that have an IPv4 address, loopback left out: (name, address)."""
    found = [(name, interface_address(name)) for _, name in socket.if_nameindex()]
    return [(name, address) for name, address in found
            if address is not None and not is_loopback(address)]


def source_toward(host: str, port: int) -> str | None:
    """The address this host sends from to ``host``, as its routes choose (a UDP socket's
    connect sends nothing); None where it cannot tell."""
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.connect(sockaddr)
            return sock.getsockname()[0]
    except (OSError, UnicodeError, IndexError):
        return None


def store_endpoint(env: DistEnv) -> tuple[str, int] | None:
    """Where this host meets the others: the rendezvous store, else ``MASTER_ADDR``."""
    if env.rendezvous is not None:
        return env.rendezvous.host, env.rendezvous.port
    if env.master_addr is not None:
        return env.master_addr, env.master_port or 0
    return None


def maybe_warn_unreachable_gloo(env: DistEnv, backend: str,
                                environ: Mapping[str, str] | None = None) -> str | None:
    """Says in one line (:func:`advice`) when gloo would listen where ranks on other machines
    cannot reach it; returns the line said. Once per node: its local rank 0, at its agent's first
    start of workers (a restart would say it again to no one new)."""
    environ = os.environ if environ is None else environ
    if backend != "gloo" or not env.is_local_main or env.restart_count:
        return None
    if not spans_machines(env) or ifname_is_set(environ.get(IFNAME)):
        return None  # before resolving anything
    host_name = socket.gethostname()
    addresses = bindable_addresses(host_name)
    if not is_loopback(gloo_address(addresses)):
        return None
    endpoint = store_endpoint(env)
    line = advice(host_name, addresses, environ.get(IFNAME), True, interfaces(),
                  None if endpoint is None else source_toward(*endpoint))
    if line:
        log.warning("%s", line)
    return line
