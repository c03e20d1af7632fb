"""TCP's retransmission backoff, capped on the job's connections (elastic_mnist/backoff.py): in
process, which sockets are capped; on hosts of their own (scripts/hosts.py; skipped without root,
``ip netns`` or a kernel that caps), what the cap buys after an outage of the store's host."""

from __future__ import annotations

import datetime
import json
import os
import select
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from elastic_mnist import backoff
from elastic_mnist.stores import serve_store

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import hosts


def tcp_sockets() -> dict[tuple, int]:
    """This process's TCP sockets, (local address, peer or None) → their cap (ms)."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            if not stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        with sock:
            if sock.family == socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
                continue
            try:
                peer = sock.getpeername()[:2]
            except OSError:
                peer = None
            found[(sock.getsockname()[:2], peer)] = sock.getsockopt(socket.IPPROTO_TCP,
                                                                  backoff.TCP_RTO_MAX_MS)
    return found


def kernel_caps() -> bool:
    with socket.socket() as sock:
        return backoff.cap(sock)


@pytest.mark.skipif(not kernel_caps(), reason="this kernel has no TCP_RTO_MAX_MS (Linux < 6.15)")
def test_a_store_we_serve_is_capped_where_it_listens_and_torchs_clients_by_the_sweep():
    """The stores this package serves pass the cap to every connection they accept (Linux
    copies the listener); torch's TCPStore clients are found among the process's files and
    capped once (the watchdog sweeps every beat, the agent every keep-alive)."""
    server = serve_store("127.0.0.1", 0, timeout=datetime.timedelta(seconds=5), peers_local=True)
    client = TCPStore("127.0.0.1", server.port, is_master=False,
                      timeout=datetime.timedelta(seconds=5))
    ours = lambda found: {k: v for k, v in found.items()
                          if server.port in (k[0][1], (k[1] or (None, None))[1])}
    before = ours(tcp_sockets())
    accepted = {k: v for k, v in before.items() if k[0][1] == server.port and k[1]}
    dialed = {k: v for k, v in before.items() if k[1] and k[1][1] == server.port}
    assert accepted and set(accepted.values()) == {backoff.RTO_MAX_MS}
    assert dialed and backoff.RTO_MAX_MS not in dialed.values()  # torch's own: uncapped
    assert backoff.cap_connections() >= len(dialed)
    assert set(ours(tcp_sockets()).values()) == {backoff.RTO_MAX_MS}
    assert backoff.cap_connections() == 0  # each socket once
    client.set("k", "v")


SERVER = """
import socket, threading
listener = socket.create_server(("0.0.0.0", 5555))
def echo(c):
    while data := c.recv(100):
        c.sendall(data)
while True:
    threading.Thread(target=echo, args=(listener.accept()[0],), daemon=True).start()
"""

CLIENT = """
import json, socket, sys, time
from elastic_mnist import backoff
sock = socket.create_connection((sys.argv[1], 5555))
if sys.argv[2] == "capped":
    backoff.cap(sock)
sock.sendall(b"x"); sock.recv(1)
print("ready", flush=True)
sys.stdin.readline()  # the store's host is cut now
sock.sendall(b"y"); sock.recv(1)
print(json.dumps(time.time()), flush=True)
"""


@pytest.mark.slow
@pytest.mark.skipif(hosts.unavailable() is not None or not kernel_caps(),
                    reason=f"hosts of their own: {hosts.unavailable() or 'no TCP_RTO_MAX_MS'}")
def test_after_an_outage_a_capped_connection_is_heard_within_a_second_of_the_heal():
    """The store's host cut for 7 s while a call is sent: TCP's doubling timeout tries again
    6.2 s after the first send, then 12.6 s (5.6 s after the heal; after a 30 s outage, 23 s:
    the module's figure); capped, within a second of the heal. The fact behind backoff.py, and
    what it buys."""
    clients: list[subprocess.Popen] = []
    with hosts.Network({"store": ("control",), "node0": ("control",)}) as net:
        server = subprocess.Popen(net.command("store", [sys.executable, "-c", SERVER]))
        try:
            time.sleep(0.3)
            clients = [subprocess.Popen(
                net.command("node0", [sys.executable, "-c", CLIENT, net.hosts["store"].address(),
                                      variant]), cwd=REPO, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, text=True) for variant in ("default", "capped")]
            assert [c.stdout.readline().strip() for c in clients] == ["ready", "ready"]
            net.cut("store")
            for c in clients:
                c.stdin.write("go\n")
                c.stdin.flush()
            time.sleep(7)
            net.heal("store")
            healed = time.time()
            default, capped = clients
            assert json.loads(capped.stdout.readline()) - healed <= 1.2
            wait = max(0.0, healed + 1.5 - time.time())
            assert not select.select([default.stdout], [], [], wait)[0]  # still backing off
        finally:
            server.kill()
            for c in clients:
                c.kill()
