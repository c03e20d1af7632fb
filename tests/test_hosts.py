"""Hosts of their own (scripts/hosts.py): each fact the partition harness relies on, shown on
this machine without training. Skipped where the machine does not allow network namespaces (not
root, no ``ip netns``); CI runs as root.

The facts: a network is made and removed whole, its names within Linux's 15 bytes and its own,
its addresses in 198.18.0.0/15 and none in the root namespace; each host has its own host name
and resolves the others as meant; a cut is silent (no reset: the peer's wait times out) and a
heal restores the same connection, in both directions and in each one alone; ``tbf`` slows a
link; and nothing is left when the harness is SIGKILLed, or by a run whose owner is gone.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import hosts

PROBE = str(REPO / "tests" / "programs" / "netprobe.py")
REASON = hosts.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"hosts of their own: {REASON}")
SPEC = {"store": ("control",), "node0": ("control", "data"), "node1": ("control", "data")}


def root_namespace() -> tuple[str, str]:
    """The root namespace's addresses and routes, as ``ip`` prints them."""
    return (hosts.run("ip", "-o", "addr", "show").stdout,
            hosts.run("ip", "route", "show", "table", "all").stdout)


def nothing_left(prefix: str, within_s: float = 5.0) -> dict:
    """What remains of run ``prefix`` once ``within_s`` has passed (empty lists: nothing)."""
    deadline = time.time() + within_s
    while True:
        left = hosts.made_by(prefix)
        if not any(left.values()) or time.time() > deadline:
            return left
        time.sleep(0.1)


def test_a_network_is_made_whole_in_its_own_names_and_addresses_and_removed_whole():
    before = root_namespace()
    with hosts.Network(SPEC) as net:
        made = hosts.made_by(net.prefix)
        assert len(made["namespaces"]) == 3
        # two bridges, and a veth's root end per link
        assert sorted(made["links"]) == sorted([*net.bridges.values(), *(
            link.outer for host in net.hosts.values() for link in host.links.values())])
        assert len(made["links"]) == 2 + 5
        names = made["links"] + [link.inner for h in net.hosts.values() for link in h.links.values()]
        assert all(len(name.encode()) <= hosts.IFNAMSIZ for name in names)
        assert len(set(made["links"])) == len(made["links"])
        assert not [n for n in hosts.links() if n.startswith(net.prefix)
                    and n not in made["links"]]
        addresses = []
        for host in net.hosts.values():
            shown = hosts.run("ip", "-n", host.netns, "-o", "addr", "show").stdout
            addresses += [line.split()[3].split("/")[0] for line in shown.splitlines()
                          if " inet" in line and " lo " not in line]
        assert len(addresses) == len(set(addresses)) == 5
        assert all(ipaddress.ip_address(a) in hosts.ALLOWED for a in addresses), addresses
        assert root_namespace() == before, "the root namespace got an address or a route"
        prefix = net.prefix
    assert nothing_left(prefix, within_s=0) == {"namespaces": [], "links": [], "files": []}
    assert root_namespace() == before


def test_each_host_has_its_own_name_and_resolves_the_others_as_meant():
    with hosts.Network(SPEC) as net:
        seen = json.loads(subprocess.run(
            net.command("node0", [sys.executable, PROBE, "names", "node1", "store",
                                  "node1-ctl"]),
            capture_output=True, text=True, check=True).stdout)
        data_link = subprocess.run(net.command("node0", ["ip", "-o", "addr", "show", "data"]),
                                   capture_output=True, text=True, check=True).stdout
    node0, node1, store = (net.hosts[n] for n in ("node0", "node1", "store"))
    assert seen["hostname"] == seen["fqdn"] == "node0"
    assert seen["resolved"] == {"node1": node1.links["data"].address,
                                "store": store.links["control"].address,
                                "node1-ctl": node1.links["control"].address}
    assert node0.links["data"].address in data_link  # what GLOO_SOCKET_IFNAME=data picks


def probe(client: subprocess.Popen, line: str) -> dict:
    client.stdin.write(line + "\n")
    client.stdin.flush()
    return json.loads(client.stdout.readline())


@pytest.fixture(scope="module")
def served():
    """A network and an echo server on the store's host, for every test of a connection."""
    with hosts.Network(SPEC) as net:
        server = subprocess.Popen(net.command("store", [sys.executable, PROBE, "serve", "store",
                                                        "7001"]),
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert json.loads(server.stdout.readline())["listening"]
            yield net
        finally:
            server.kill()
            server.wait()


@pytest.fixture
def connection(served):
    """A client on node0 connected to the echo server over node0's control link; node0's links
    healed after the test, whatever it did to them."""
    client = subprocess.Popen(served.command("node0", [sys.executable, PROBE, "client", "store",
                                                       "7001"]),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(client.stdout.readline())["connected"]
        yield served, client
    finally:
        client.kill()
        client.wait()
        served.heal("node0")


@pytest.mark.parametrize("direction", ["both", "in", "out"])
def test_a_cut_is_silent_and_a_heal_restores_the_same_connection(connection, direction):
    """Cut from outside the host, the connection's peer gets no reset: its wait times out, and
    once healed the same connection carries on (TCP retransmitted into the silence)."""
    net, client = connection
    assert probe(client, "probe 2")["result"] == "ok"
    net.cut("node0", "control", direction)
    assert probe(client, "probe 0.5")["result"] == "timeout"
    net.heal("node0", "control")
    assert probe(client, "probe 5")["result"] == "ok"


def test_a_cut_data_link_leaves_the_control_link_alone(connection):
    net, client = connection
    net.cut("node0", "data")
    assert probe(client, "probe 2")["result"] == "ok"


def test_tbf_slows_a_link(connection):
    """200 kB at 4 Mbit/s take 0.4 s at least; unslowed, a few milliseconds."""
    net, client = connection
    assert probe(client, "bulk 200000 5")["seconds"] < 0.2
    net.slow("node0", "4mbit", "control", direction="in")
    slowed = probe(client, "bulk 200000 10")
    assert slowed["result"] == "ok" and slowed["seconds"] > 0.3


OWNER = """
import sys, time
sys.path.insert(0, {scripts!r})
import hosts
with hosts.Network({{"a": ("control", "data"), "b": ("data",)}}) as net:
    sleeper = __import__("subprocess").Popen(net.command("a", ["sleep", "600"]))
    print(net.prefix, sleeper.pid, flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_nothing_is_left_when_the_harness_is_killed(sig):
    """A run's namespaces, links and files are gone, and what ran in its hosts ended, whatever
    ended its process: SIGTERM and SIGINT end it through its ``finally``, SIGKILL through its
    reaper."""
    owner = subprocess.Popen([sys.executable, "-c", OWNER.format(scripts=str(REPO / "scripts"))],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    prefix, sleeper = owner.stdout.readline().split()
    assert any(hosts.made_by(prefix).values())
    os.kill(owner.pid, sig)
    owner.wait()
    assert nothing_left(prefix) == {"namespaces": [], "links": [], "files": []}
    assert not Path(f"/proc/{sleeper}").exists() or \
        Path(f"/proc/{sleeper}/stat").read_text().split()[2] == "Z"


def test_a_run_sweeps_what_a_run_whose_owner_is_gone_left_and_nothing_else():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stale = hosts.FAMILY + "zzzz"
    with hosts.Network({"a": ("data",)}) as live:
        hosts.REGISTRY.mkdir(exist_ok=True)
        (hosts.REGISTRY / f"{stale}.json").write_text(json.dumps(
            {"prefix": stale, "pid": int(dead), "started": 0.0}))
        hosts.run("ip", "netns", "add", f"{stale}-x")
        hosts.run("ip", "link", "add", f"{stale}d0", "type", "bridge")
        hosts.sweep()  # (or another test's, running beside this one: the same sweep)
        assert hosts.made_by(stale) == {"namespaces": [], "links": [], "files": []}
        assert len(hosts.made_by(live.prefix)["namespaces"]) == 1
