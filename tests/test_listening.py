"""docs/operations.md's "What listens where", held against the sockets of live jobs.

The launches record what their process trees listen on (tests/launch.py's ``listening``):
``killed_run`` under the plain torchrun line (the agent's store shared with the workers) and
``interrupted_make_train`` under jobs/local.sh (not shared). Each
socket found is named by ``identify`` and must be a row of that table whose address it
has. A feature that opens a socket adds a row to the table and a case to ``identify``.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys

import pytest
from launch import REPO, clean_env, kill_tree, listening

from elastic_mnist.stores import listen_address

PAGE = REPO / "docs" / "operations.md"
EVERY_INTERFACE = ("::", "0.0.0.0")


def readme_table() -> dict[str, dict[str, str]]:
    """The rows between the listening markers: socket id -> its columns, the address as its
    token (`*`, `advertised`, ...)."""
    text = PAGE.read_text()
    table = text.split("<!-- listening:begin -->")[1].split("<!-- listening:end -->")[0]
    lines = [line for line in table.strip().splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = dict(zip(header, (cell.strip() for cell in line.strip("|").split("|"))))
        socket_id = re.match(r"`([^`]+)`", cells["socket"]).group(1)
        cells["address"] = re.fullmatch(r"`([^`]+)`", cells["address"]).group(1)
        rows[socket_id] = cells
    return rows


def resolved(host: str) -> str:
    """The address ``host`` resolves to first here, as a peer connecting to it tries it."""
    return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]


def gloo_address() -> str:
    """gloo listens on the address of this host's name, loopback when that does not resolve."""
    try:
        return resolved(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def group_store(launch: dict) -> tuple[str, int]:
    """(the name peers are given, the port) of the process group's store."""
    if launch["attempt_store"] is not None:  # published through the agent's shared store
        return launch["attempt_store"]["host"], launch["attempt_store"]["port"]
    rank0 = next(p for p in launch["processes"] if p["rank"] == "0")
    return rank0["MASTER_ADDR"], int(rank0["MASTER_PORT"])


def identify(process: dict, port: int, launch: dict) -> str:
    """Which row of the table a socket is."""
    shared = launch["attempt_store"] is not None
    if process["role"] == "agent":
        rank0 = next(p for p in launch["processes"] if p["rank"] == "0")
        return "agent-store" if shared and port == int(rank0["MASTER_PORT"]) else "rendezvous"
    if process["role"] == "worker":
        if process["rank"] == "0" and port == group_store(launch)[1]:
            return "group-store"
        return "gloo"
    return f"unknown: {process['role']}"


def expected_addresses(token: str, launch: dict) -> set[str]:
    if token == "*":
        return set(EVERY_INTERFACE)
    if token == "advertised":
        return {resolved(group_store(launch)[0])}  # one machine: its own peers resolve it so
    if token == "hostname":
        return {gloo_address()}
    raise AssertionError(f"no test knows the address `{token}`")


def check_launch(launch: dict, expected: dict[str, int]) -> None:
    """Every socket of the launch is a row of the table and has the row's address; ``expected``
    says how many sockets of each row the launch has."""
    rows = readme_table()
    found: dict[str, int] = {}
    for process in launch["processes"]:
        for ip, port in process["sockets"]:
            socket_id = identify(process, port, launch)
            assert socket_id in rows, f"{socket_id} ({process}) is not in docs/operations.md's table"
            addresses = expected_addresses(rows[socket_id]["address"], launch)
            assert ip in addresses, (socket_id, ip, port, addresses)
            found[socket_id] = found.get(socket_id, 0) + 1
    assert found == expected, launch


def test_the_readme_table_names_every_address_it_uses():
    rows = readme_table()
    assert {"rendezvous", "our-rendezvous", "agent-store", "external-rendezvous", "group-store",
            "gloo",
            "tensorboard"} <= set(rows)
    assert "None of them authenticates" in PAGE.read_text()


@pytest.mark.slow
def test_make_train_listens_as_the_readme_says(interrupted_make_train):
    """jobs/local.sh (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): no agent store; rank 0 serves the
    round's MASTER_ADDR:MASTER_PORT on that address alone."""
    launch = json.loads((interrupted_make_train.work / "listening.json").read_text())
    check_launch(launch, {"rendezvous": 1, "group-store": 1, "gloo": 2})


@pytest.mark.slow
def test_a_plain_torchrun_job_listens_as_the_readme_says(killed_run):
    """Two workers, the agent's store shared with them: our group store on its advertised
    address alone, torch's two stores on every interface, gloo on the host's address."""
    launch = json.loads((killed_run / "listening.json").read_text())
    check_launch(launch, {"rendezvous": 1, "agent-store": 1, "group-store": 1, "gloo": 2})


@pytest.mark.parametrize("host", ["localhost", None], ids=["localhost", "default"])
def test_the_external_rendezvous_store_listens_on_its_host_alone(host):
    """`--host localhost`: this machine alone. By default this machine's host name, which the
    agents on other machines reach: the address it resolves to, or every interface where that is
    a loopback address (Debian's hosts file)."""
    given = [] if host is None else ["--host", host]
    host = host or socket.gethostname()
    proc = subprocess.Popen([sys.executable, "-m", "elastic_mnist", "rendezvous", *given,
                             "--port", "0"], cwd=REPO, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        if f"rendezvous store listening on {host}:" not in line:
            kill_tree(proc.pid)
            pytest.fail(line + proc.stdout.read())
        sockets = listening(proc.pid)["processes"][0]["sockets"]
    finally:
        kill_tree(proc.pid)
    assert readme_table()["external-rendezvous"]["address"] == "--host"
    address = listen_address(host, peers_local=False)[1]
    (ip, _), = sockets
    assert ip == address or (not address and ip in EVERY_INTERFACE), (ip, address)
