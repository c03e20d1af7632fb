#!/usr/bin/env python3
"""Hosts of their own on one machine: Linux network namespaces as the nodes of a cluster.

    scripts/hosts.py check     what this machine allows (root, namespaces, tbf, a one-way cut)
    scripts/hosts.py sweep     remove what runs that are gone left behind

A :class:`Network` makes, for one run, a control bridge and a data bridge in the root namespace,
and per host a namespace with ``lo`` up and one veth per link it has: ``ctl`` on the control
bridge, ``data`` on the data bridge (``GLOO_SOCKET_IFNAME=data``). Every host has an address on
each of its links, in 198.18.0.0/24 (control) and 198.18.1.0/24 (data), inside its namespace:
the root namespace gets no address and no route, and two runs side by side never meet (each has
bridges of its own). Each host resolves every host's name through its own
``/etc/netns/<namespace>/hosts`` (a host's name is its data address, or its control address when
it has no data link; ``NAME-ctl`` its control address), and :meth:`Network.command` runs a
command there under the host's own host name (a UTS namespace of its own).

Faults, all from outside the host and all silent (no FIN, no RST: the peers' TCP retransmits
into nothing): :meth:`Network.cut` sets a link's root end down (both directions); with
``direction="in"`` or ``"out"`` it drops one direction only, by a ``pfifo`` queue of length 0
on the end that sends it (this kernel has no ``matchall`` filter and no ``gact`` action);
:meth:`Network.slow` puts a ``tbf`` on a link (this kernel has no ``netem``: no delay, no loss);
:meth:`Network.flap` cuts and heals on a period; :meth:`Network.heal` undoes any of them.

Everything a run makes is named after its prefix (``emh`` and four random characters, so that
interface names stay within Linux's 15 bytes) and is removed when the network is closed, on
SIGINT and SIGTERM, and when the process that made it is SIGKILLed: a reaper process of its own
waits on a pipe whose other end only the owner holds, and removes everything of the prefix once
that pipe closes. A run also sweeps, at its start, the leftovers of earlier runs whose owner is
gone (a registry file per run, under /run, names its owner).
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import random
import shutil
import signal
import string
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import psutil

FAMILY = "emh"
"""The start of every name a :class:`Network` makes: namespaces, interfaces, files."""
PREFIX_LEN = len(FAMILY) + 4
ALLOWED = ipaddress.ip_network("198.18.0.0/15")
"""The benchmarking range: the only addresses a network here may use."""
SUBNETS = {"control": ipaddress.ip_network("198.18.0.0/24"),
           "data": ipaddress.ip_network("198.18.1.0/24")}
INNER = {"control": "ctl", "data": "data"}
"""Each link's name inside its host (``GLOO_SOCKET_IFNAME=data``)."""
REGISTRY = Path("/run/elastic-mnist-hosts")
"""One file per live run: its prefix, its owner's pid and start time."""
ETC_NETNS = Path("/etc/netns")
"""Where ``ip netns exec`` finds each namespace's own /etc files."""
IFNAMSIZ = 15
SLOW_BURST = "32kb"
SLOW_LATENCY = "200ms"


class HostsError(RuntimeError):
    """A command of ``ip`` or ``tc`` failed: what it was, in one line."""


@dataclass(frozen=True)
class Link:
    """One veth of a host: its root end on the kind's bridge, its inner end in the host."""

    kind: str
    """``control`` (to the rendezvous store) or ``data`` (to the peers)."""
    outer: str
    """The root end's name, on the bridge: where a cut is made."""
    inner: str
    """The host's end's name, in its namespace (``ctl`` or ``data``)."""
    address: str
    """The host's address on this link, in 198.18.0.0/15."""


@dataclass(frozen=True)
class Host:
    """A node: a network namespace with its host name and its links."""

    name: str
    netns: str
    links: dict[str, Link]

    def address(self) -> str:
        """What the host's name resolves to: its data address, else its control address."""
        return (self.links.get("data") or self.links["control"]).address


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    """``argv`` run to its end; a failure raised as :class:`HostsError` with its own words."""
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        raise HostsError(f"{' '.join(argv)}: {said[0] if said else f'exit {done.returncode}'}")
    return done


def unavailable() -> str | None:
    """Why this machine cannot run hosts of their own (None: it can): not root, no ``ip``,
    ``tc`` or ``unshare``, or a namespace cannot be made."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    missing = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"needs {', '.join(missing)} (iproute2, util-linux)"
    probe = f"em-probe-{os.getpid()}"  # not of the family: no sweep takes it
    made = run("ip", "netns", "add", probe, check=False)
    run("ip", "netns", "del", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add fails here: {made.stderr.strip()}"
    return None


# --- what a run made, and removing it ------------------------------------------------------------


def namespaces() -> list[str]:
    return [line.split()[0] for line in run("ip", "netns", "list").stdout.splitlines() if line]


def links() -> list[str]:
    """The root namespace's interfaces, by name."""
    return [line.split(":")[1].strip().split("@")[0]
            for line in run("ip", "-o", "link", "show").stdout.splitlines()]


def pids(netns: str) -> list[int]:
    """The processes in network namespace ``netns``."""
    return [int(p) for p in run("ip", "netns", "pids", netns, check=False).stdout.split()]


def made_by(prefix: str) -> dict[str, list]:
    """What exists of run ``prefix``: its namespaces, links, /etc/netns folders and registry
    file."""
    return {"namespaces": [n for n in namespaces() if n.startswith(prefix)],
            "links": [n for n in links() if n.startswith(prefix)],
            "files": [p for p in [*ETC_NETNS.glob(f"{prefix}*"), *REGISTRY.glob(f"{prefix}*")]]}


def remove(prefix: str) -> None:
    """Removes everything of run ``prefix``: SIGKILLs every process in its namespaces, deletes
    its links (a veth's root end takes its peer with it), its namespaces and its files. Safe to
    repeat; it removes nothing else."""
    assert prefix.startswith(FAMILY) and len(prefix) == PREFIX_LEN, prefix
    record = _read_registry(REGISTRY / f"{prefix}.json") or {}
    mine = made_by(prefix)
    for netns in mine["namespaces"]:
        deadline = time.time() + 5
        while (left := pids(netns)) and time.time() < deadline:
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
    for name in sorted(mine["links"], key=len, reverse=True):  # veths before bridges
        run("ip", "link", "del", name, check=False)
    for netns in mine["namespaces"]:
        run("ip", "netns", "del", netns, check=False)
    for path in mine["files"]:
        # another run's sweep may be removing the same at the same time
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    for folder, made in ((ETC_NETNS, record.get("made_etc_netns")), (REGISTRY, True)):
        if made:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only when empty: another run may be using it


def _read_registry(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def owner_alive(record: dict | None) -> bool:
    """The process a registry record names still runs (the same one: its start time agrees)."""
    if not record:
        return False
    try:
        return abs(psutil.Process(record["pid"]).create_time() - record["started"]) < 1e-3
    except (psutil.NoSuchProcess, KeyError):
        return False


def sweep() -> list[str]:
    """Removes the leftovers of runs whose owner is gone (killed, and its reaper too); returns
    their prefixes. A live run's things are left alone: it registers before it makes any."""
    found = {n[:PREFIX_LEN] for n in [*namespaces(), *links()] if n.startswith(FAMILY)}
    found |= {p.name[:PREFIX_LEN] for folder in (ETC_NETNS, REGISTRY) if folder.is_dir()
              for p in folder.iterdir() if p.name.startswith(FAMILY)}
    stale = sorted(p for p in found if len(p) == PREFIX_LEN
                   and not owner_alive(_read_registry(REGISTRY / f"{p}.json")))
    for prefix in stale:
        remove(prefix)
    return stale


def reap(prefix: str) -> None:
    """The reaper: waits until its standard input closes (its owner closed the pipe, or died,
    SIGKILLed or not), then removes everything of ``prefix``."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # a Ctrl-C meant for the owner must not stop it
    while sys.stdin.buffer.read(4096):
        pass
    remove(prefix)


# --- a network of hosts --------------------------------------------------------------------------


class Network:
    """Hosts of their own for one run, as a context manager: made on entry, removed on exit
    (and by the reaper, whatever ends the process).

    ``hosts`` maps each host's name to the links it has, e.g. ``{"store": ("control",),
    "node0": ("control", "data")}``; a bridge is made for each kind that some host has."""

    def __init__(self, hosts: dict[str, Sequence[str]]):
        if not hosts or len(hosts) > 250:
            raise ValueError("a network has 1 to 250 hosts")
        for name, kinds in hosts.items():
            if not kinds or set(kinds) - set(SUBNETS) or not name.replace("-", "").isalnum():
                raise ValueError(f"host {name!r}: a plain name, and links among {list(SUBNETS)}")
        self.spec = {name: tuple(kinds) for name, kinds in hosts.items()}
        self.prefix = FAMILY + "".join(random.choices(string.ascii_lowercase + string.digits,
                                                      k=PREFIX_LEN - len(FAMILY)))
        self.hosts: dict[str, Host] = {}
        self.bridges: dict[str, str] = {}
        self._reaper: subprocess.Popen | None = None
        self._pipe: int | None = None
        self._old_sigterm = None

    # -- making and removing --

    def __enter__(self) -> Self:
        return self.open()

    def open(self) -> Self:
        """Makes the network (:meth:`close` removes it): for a harness whose own ``finally``
        closes it."""
        reason = unavailable()
        if reason:
            raise HostsError(f"hosts of their own: {reason}")
        sweep()
        self._register()
        self._start_reaper()
        if threading.current_thread() is threading.main_thread():
            # SIGTERM's default ends the process without a finally: make it an exit, which runs
            # every finally on the way (the reaper covers what does not).
            self._old_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Removes every namespace, link and file of this run, and lets the reaper go."""
        remove(self.prefix)
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None
        if self._pipe is not None:
            os.close(self._pipe)
            self._pipe = None
        if self._reaper is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._reaper.wait(timeout=30)
            self._reaper = None

    def _register(self) -> None:
        REGISTRY.mkdir(mode=0o700, exist_ok=True)
        record = {"prefix": self.prefix, "pid": os.getpid(),
                  "started": psutil.Process().create_time(),
                  "made_etc_netns": _ours(ETC_NETNS)}
        path = REGISTRY / f"{self.prefix}.json"
        path.with_suffix(".tmp").write_text(json.dumps(record))
        path.with_suffix(".tmp").replace(path)

    def _start_reaper(self) -> None:
        read, self._pipe = os.pipe()  # both ends close on exec: only the reaper gets ``read``
        self._reaper = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "reap", self.prefix], stdin=read,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        os.close(read)

    def _build(self) -> None:
        kinds = sorted({kind for link_kinds in self.spec.values() for kind in link_kinds})
        for kind in kinds:
            bridge = self._name(kind[0])
            run("ip", "link", "add", bridge, "type", "bridge")
            _quiet(bridge)
            run("ip", "link", "set", bridge, "up")
            self.bridges[kind] = bridge
        for index, (name, link_kinds) in enumerate(self.spec.items()):
            netns = f"{self.prefix}-{name}"
            run("ip", "netns", "add", netns)
            run("ip", "-n", netns, "link", "set", "lo", "up")
            host_links = {}
            for kind in link_kinds:
                link = Link(kind, self._name(f"{kind[0]}{index}"), INNER[kind],
                            str(SUBNETS[kind].network_address + index + 1))
                assert ipaddress.ip_address(link.address) in ALLOWED, link
                run("ip", "link", "add", link.outer, "type", "veth", "peer", "name", link.inner,
                    "netns", netns)
                _quiet(link.outer)
                _quiet(link.inner, netns)
                run("ip", "link", "set", link.outer, "master", self.bridges[kind], "up")
                run("ip", "-n", netns, "addr", "add",
                    f"{link.address}/{SUBNETS[kind].prefixlen}", "dev", link.inner)
                run("ip", "-n", netns, "link", "set", link.inner, "up")
                host_links[kind] = link
            self.hosts[name] = Host(name, netns, host_links)
        table = self.hosts_file()
        for host in self.hosts.values():
            folder = ETC_NETNS / host.netns
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(table)

    def _name(self, suffix: str) -> str:
        name = self.prefix + suffix
        assert len(name.encode()) <= IFNAMSIZ, name
        return name

    def hosts_file(self) -> str:
        """Every host's /etc/hosts: localhost, each host's name, and ``NAME-ctl`` for each
        control address (how the store's host names its clients)."""
        lines = ["127.0.0.1\tlocalhost"]
        for host in self.hosts.values():
            lines.append(f"{host.address()}\t{host.name}")
            if "data" in host.links and "control" in host.links:
                lines.append(f"{host.links['control'].address}\t{host.name}-ctl")
        return "\n".join(lines) + "\n"

    # -- running in a host --

    def command(self, host: str, argv: Sequence[str], name: str | None = None) -> list[str]:
        """``argv`` as it runs in ``host``: in its network namespace (its /etc/hosts), under
        its own host name (``name``: another). Each of ip, unshare and sh execs the next: the
        command's pid is the Popen's."""
        return ["ip", "netns", "exec", self.hosts[host].netns, "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', name or host, *argv]

    def pids(self, host: str) -> list[int]:
        """Every process running in ``host``."""
        return pids(self.hosts[host].netns)

    # -- faults --

    def _links(self, host: str, kind: str | None) -> list[Link]:
        links_ = self.hosts[host].links
        if kind is not None and kind not in links_:
            raise ValueError(f"{host} has no {kind} link")
        return list(links_.values()) if kind is None else [links_[kind]]

    def cut(self, host: str, kind: str | None = None, direction: str = "both") -> None:
        """Cuts ``host``'s ``kind`` link (every link: None). ``both``: its root end down, as a
        switch port shut or a cable pulled; ``in`` (to the host) or ``out`` (from it): that
        direction's packets dropped where they leave their end, a queue of length 0."""
        for link in self._links(host, kind):
            if direction == "both":
                run("ip", "link", "set", link.outer, "down")
            else:
                self._qdisc(host, link, direction, "pfifo", "limit", "0")

    def slow(self, host: str, rate: str, kind: str | None = None,
             direction: str = "both") -> None:
        """Limits ``host``'s ``kind`` link to ``rate`` (tc's words, e.g. ``20mbit``), in one
        direction or both, by a token bucket (``tbf``)."""
        for link in self._links(host, kind):
            for way in (("in", "out") if direction == "both" else (direction,)):
                self._qdisc(host, link, way, "tbf", "rate", rate, "burst", SLOW_BURST,
                            "latency", SLOW_LATENCY)

    def heal(self, host: str, kind: str | None = None) -> None:
        """Undoes every cut and slowing of ``host``'s ``kind`` link (every link: None)."""
        for link in self._links(host, kind):
            run("ip", "link", "set", link.outer, "up")
            run("tc", "qdisc", "del", "dev", link.outer, "root", check=False)
            run("tc", "-n", self.hosts[host].netns, "qdisc", "del", "dev", link.inner, "root",
                check=False)

    def _qdisc(self, host: str, link: Link, direction: str, *qdisc: str) -> None:
        """``qdisc`` on the end that sends ``direction``'s packets: the root end sends them in,
        the host's end sends them out."""
        if direction not in ("in", "out"):
            raise ValueError(f"direction is both, in or out, not {direction!r}")
        where = (["dev", link.outer] if direction == "in"
                 else ["-n", self.hosts[host].netns, "dev", link.inner])
        run("tc", *where[:-2], "qdisc", "replace", *where[-2:], "root", *qdisc)

    def flap(self, host: str, down_s: float, up_s: float, kind: str | None = None) -> Flap:
        """Cuts and heals ``host``'s link on a period, from now until the returned
        :class:`Flap` is stopped (which heals it)."""
        return Flap(self, host, kind, down_s, up_s)


class Flap:
    """A link going down and up again in a thread of its own: ``down_s`` cut, ``up_s`` healed."""

    def __init__(self, network: Network, host: str, kind: str | None, down_s: float,
                 up_s: float):
        self.network, self.host, self.kind = network, host, kind
        self.down_s, self.up_s = down_s, up_s
        self.cuts: list[float] = []
        """When each cut began."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"flap-{host}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.cuts.append(time.time())
            self.network.cut(self.host, self.kind)
            self._stop.wait(self.down_s)
            self.network.heal(self.host, self.kind)
            self._stop.wait(self.up_s)

    def stop(self) -> None:
        """Stops flapping, the link healed."""
        self._stop.set()
        self._thread.join()


def _quiet(name: str, netns: str | None = None) -> None:
    """No IPv6 on ``name``: nothing of ours appears in the root namespace's routing tables
    (an interface with IPv6 gets a multicast route there), and no link-local chatter."""
    if netns is None and (Path("/proc/sys/net/ipv6/conf") / name).is_dir():
        (Path("/proc/sys/net/ipv6/conf") / name / "disable_ipv6").write_text("1")
    else:
        run("ip", *(["-n", netns] if netns else []), "link", "set", name, "addrgenmode", "none")


def _ours(folder: Path) -> bool:
    """Whether ``folder`` is ours to remove once empty: it is missing (this run makes it), or
    it holds only what runs of ours made (one of them made it). An empty folder that was there
    before is someone else's."""
    if not folder.exists():
        return True
    entries = list(folder.iterdir())
    return bool(entries) and all(p.name.startswith(FAMILY) for p in entries)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


# --- what the machine allows ---------------------------------------------------------------------


CAPABILITIES = {"namespaces": "network namespaces (root, ip, tc, unshare)",
                "slow": "slow a link: tc tbf",
                "one-way": "cut one direction: tc pfifo limit 0",
                "netem": "delay or loss: tc netem"}
"""What :func:`capabilities` tries, and in what words."""


def capabilities() -> dict[str, str | None]:
    """What this machine allows of :data:`CAPABILITIES`: None where it works, else why not
    (in the kernel's words). Tried on a network of one host, made and removed."""
    reason = unavailable()
    if reason:
        return dict.fromkeys(CAPABILITIES, reason)
    found: dict[str, str | None] = {"namespaces": None}
    with Network({"a": ("data",)}) as net:
        link = net.hosts["a"].links["data"]
        for name, qdisc in (("slow", ("tbf", "rate", "10mbit", "burst", SLOW_BURST, "latency",
                                      SLOW_LATENCY)),
                            ("one-way", ("pfifo", "limit", "0")),
                            ("netem", ("netem", "delay", "10ms"))):
            done = run("tc", "qdisc", "replace", "dev", link.outer, "root", *qdisc, check=False)
            found[name] = None if done.returncode == 0 else (done.stderr.strip() or "refused")
            run("tc", "qdisc", "del", "dev", link.outer, "root", check=False)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("check", help="what this machine allows")
    commands.add_parser("sweep", help="remove the leftovers of runs that are gone")
    reaper = commands.add_parser("reap", help="(internal) the reaper of one run")
    reaper.add_argument("prefix")
    args = parser.parse_args(argv)
    if args.command == "reap":
        reap(args.prefix)
        return 0
    if os.geteuid() != 0:
        print("hosts: needs root (network namespaces)", file=sys.stderr)
        return 2
    if args.command == "sweep":
        stale = sweep()
        print(f"hosts: removed {', '.join(stale)}" if stale else "hosts: nothing left behind")
        return 0
    for name, why_not in capabilities().items():
        print(f"{'no ' if why_not else 'yes'} {CAPABILITIES[name]}"
              + (f": {why_not}" if why_not else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
