"""Where gloo listens (elastic_mnist/addresses.py): the one line said at start where ranks on
other machines could not reach it, and silence everywhere else. In process, and once on a host of
its own whose hosts file maps its name to 127.0.1.1 (scripts/hosts.py; skipped without root or
``ip netns``)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_mnist import addresses
from elastic_mnist.addresses import advice, maybe_warn_unreachable_gloo, spans_machines
from elastic_mnist.env import OUR_BACKEND, DistEnv, Rendezvous

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import hosts

HERE = [("eth0", "10.1.0.7"), ("ib0", "10.2.0.7")]
"""A host with two interfaces: the rendezvous store is reached from eth0's address."""


def multi_node(host: str = "head", **fields) -> DistEnv:
    """A worker of a job whose nodes meet at our rendezvous on ``host``."""
    return DistEnv(**{"world_size": 4, "local_world_size": 2, "group_world_size": 2,
                      "launched": True, **fields},
                   rendezvous=Rendezvous(host, 29400, "job", backend=OUR_BACKEND))


def test_a_name_that_resolves_to_loopback_says_what_to_set_in_one_line():
    line = advice("node7", ["127.0.1.1"], None, True, HERE, toward_store="10.1.0.7")
    assert "\n" not in line
    assert line.startswith("gloo will listen on 127.0.1.1, where this host's name 'node7' "
                           "resolves, which ranks on other machines cannot reach; set "
                           "GLOO_SOCKET_IFNAME on every node")
    assert "(this host: eth0 10.1.0.7, toward the rendezvous store; ib0 10.2.0.7)" in line


def test_a_name_that_resolves_to_no_address_here_is_gloos_fallback():
    line = advice("node7", [], None, True, HERE)
    assert line.startswith("gloo will listen on 127.0.0.1, its fallback: this host's name "
                           "'node7' resolves to no address of its own")
    assert "toward" not in line
    assert "none but loopback" in advice("node7", [], None, True, [])


@pytest.mark.parametrize("resolved", [["10.1.0.7"], ["10.1.0.7", "127.0.1.1"], ["fd00::7"]])
def test_a_name_whose_first_address_is_routable_says_nothing(resolved):
    assert advice("node7", resolved, None, True, HERE) is None


def test_gloos_first_address_is_the_one_that_counts():
    assert advice("node7", ["127.0.1.1", "10.1.0.7"], None, True, HERE) is not None


@pytest.mark.parametrize("ifname, said", [("eth0", False), ("eth0,ib0", False),
                                          ("", True), ("e", True)])
def test_gloo_socket_ifname_silences_it_where_torch_reads_it(ifname, said):
    """torch reads GLOO_SOCKET_IFNAME only when it is longer than one character."""
    assert (advice("node7", ["127.0.1.1"], ifname, True, HERE) is not None) is said


def test_a_job_on_one_machine_says_nothing():
    assert advice("node7", ["127.0.1.1"], None, False, HERE) is None


@pytest.mark.parametrize("env, spans", [
    (multi_node("head"), True),
    (multi_node("10.0.0.7"), True),
    (multi_node("localhost"), False),
    (multi_node("127.0.0.1"), False),
    (multi_node("[::1]"), False),
    (DistEnv(world_size=2, group_world_size=2, master_addr="head", launched=True), True),
    (DistEnv(world_size=2, group_world_size=2, master_addr="127.0.0.1", launched=True), False),
    (DistEnv(world_size=2, local_world_size=2, master_addr="head", launched=True), False),
])
def test_which_jobs_may_span_machines(env, spans):
    assert spans_machines(env) is spans


@pytest.fixture
def loopback_host(monkeypatch):
    """This host as one whose name resolves to 127.0.1.1, whatever this machine's is."""
    monkeypatch.setattr(addresses.socket, "gethostname", lambda: "node7")
    monkeypatch.setattr(addresses, "bindable_addresses", lambda name: ["127.0.1.1"])
    monkeypatch.setattr(addresses, "interfaces", lambda: HERE)
    monkeypatch.setattr(addresses, "source_toward", lambda host, port: "10.1.0.7")


def test_a_nodes_first_worker_says_it_once(loopback_host, caplog):
    caplog.set_level(logging.WARNING, logger=addresses.__name__)
    line = maybe_warn_unreachable_gloo(multi_node(), "gloo", environ={})
    assert line and [r.getMessage() for r in caplog.records] == [line]
    for env, backend in [(multi_node(local_rank=1, rank=1), "gloo"),
                         (multi_node(restart_count=1), "gloo"),
                         (multi_node(), "nccl"),
                         (multi_node("localhost"), "gloo")]:
        assert maybe_warn_unreachable_gloo(env, backend, environ={}) is None
    assert maybe_warn_unreachable_gloo(multi_node(), "gloo",
                                       environ={"GLOO_SOCKET_IFNAME": "eth0"}) is None
    assert len(caplog.records) == 1


# --- on a host of its own ------------------------------------------------------------------------

CHECK = """
import json, sys
from elastic_mnist.addresses import maybe_warn_unreachable_gloo
from elastic_mnist.env import DistEnv, Rendezvous
env = DistEnv(rank=0, world_size=4, local_world_size=2, group_world_size=2, launched=True,
              rendezvous=Rendezvous("store", 29400, "job", backend="elastic-mnist"))
print(json.dumps([maybe_warn_unreachable_gloo(env, "gloo", environ=e)
                  for e in ({}, {"GLOO_SOCKET_IFNAME": "data"})]))
"""


@pytest.mark.skipif(hosts.unavailable() is not None,
                    reason=f"hosts of their own: {hosts.unavailable()}")
def test_on_a_host_whose_name_resolves_to_127_0_1_1_the_line_names_its_interfaces():
    """node0 has a control link (to the store's host) and a data link. With Debian's hosts file
    (its name on 127.0.1.1) its first worker says the line, naming both interfaces and the one
    toward the store; with GLOO_SOCKET_IFNAME, or with its name on its own address, nothing."""
    with hosts.Network({"store": ("control",), "node0": ("control", "data")}) as net:
        node0 = net.hosts["node0"]
        debian = (f"127.0.0.1\tlocalhost\n127.0.1.1\tnode0\n"
                  f"{net.hosts['store'].address()}\tstore\n")

        def check(table: str) -> tuple[list, str]:
            (hosts.ETC_NETNS / node0.netns / "hosts").write_text(table)
            done = subprocess.run(net.command("node0", [sys.executable, "-c", CHECK]), cwd=REPO,
                                  capture_output=True, text=True, check=True)
            return json.loads(done.stdout), done.stderr

        (said, unset), stderr = check(debian)
        assert unset is None
        ctl, data = node0.links["control"].address, node0.links["data"].address
        assert said.startswith("gloo will listen on 127.0.1.1, where this host's name 'node0' "
                               "resolves")
        assert f"(this host: ctl {ctl}, toward the rendezvous store; data {data})" in said
        assert stderr.strip() == said  # one line, said once
        assert check(net.hosts_file())[0] == [None, None]


SERVE = """
import datetime, json, sys, time
from torch.distributed import TCPStore
from elastic_mnist import attempt_store
from elastic_mnist.env import DistEnv, Rendezvous
rank = int(sys.argv[1])
env = DistEnv(rank=rank, world_size=2, group_world_size=2, launched=True, master_addr="store",
              master_port=29400, rendezvous=Rendezvous("store", 29400, "job"))
timeout = datetime.timedelta(seconds=20)
if rank == 0:
    agent = TCPStore("store", 29400, is_master=True, wait_for_workers=False, timeout=timeout)
    store = attempt_store.serve(agent, env, timeout)
    agent.wait(["found"])
    print(json.dumps(json.loads(agent.get(attempt_store.ENTRY))))
else:
    agent = TCPStore("store", 29400, is_master=False, timeout=timeout)
    store = attempt_store.find(agent, datetime.timedelta(seconds=8))
    print(json.dumps(store.get(attempt_store.NONCE).decode()))
    agent.set("found", "1")
"""


@pytest.mark.slow
@pytest.mark.skipif(hosts.unavailable() is not None,
                    reason=f"hosts of their own: {hosts.unavailable()}")
def test_two_nodes_that_go_by_one_host_name_still_meet_and_one_line_says_so():
    """node0 and node1 both go by the host name node0, and each resolves it to its own
    address (a cloned image). Rank 0 on node0 publishes its group's store by that name; rank 1
    on node1 would resolve it to itself, where nothing listens (before: ``rank 0 published no
    live store within N s``): it reaches rank 0's published address instead, and says so in
    one line. The agent store here is served where the store's host name resolves (the
    rendezvous's own host, for the test)."""
    with hosts.Network({"node0": ("control",), "node1": ("control",)}) as net:
        a0, a1 = (net.hosts[n].address() for n in ("node0", "node1"))
        (hosts.ETC_NETNS / net.hosts["node0"].netns / "hosts").write_text(
            f"127.0.0.1\tlocalhost\n{a0}\tnode0 store\n")
        (hosts.ETC_NETNS / net.hosts["node1"].netns / "hosts").write_text(
            f"127.0.0.1\tlocalhost\n{a1}\tnode0\n{a0}\tstore\n")
        runs = [subprocess.Popen(net.command(host, [sys.executable, "-c", SERVE, rank],
                                             name="node0"),
                                 cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
                for host, rank in (("node0", "0"), ("node1", "1"))]
        try:
            (entry, err0), (nonce, err1) = (run.communicate(timeout=60) for run in runs)
        finally:
            for run in runs:
                run.kill()
        assert [run.returncode for run in runs] == [0, 0], (err0, err1)
        entry = json.loads(entry)
        assert entry["host"] == "node0" and entry["address"] == a0
        assert json.loads(nonce) == entry["nonce"]
        said = [line for line in err1.splitlines() if "node0" in line]
        assert len(said) == 1 and said[0].endswith(
            f"rank 0 published its group's store by the host name 'node0', which resolves to "
            f"this machine too (two nodes go by one name): reaching it at {a0}, its address, "
            f"instead; give each node its own host name"), err1
        assert "node0" not in err0
