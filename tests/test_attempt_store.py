"""Each attempt's process group is built on a fresh store, never on one an earlier attempt left.

The job under plain torchrun, restarted after SIGKILLs, is tests/test_elastic.py's
test_random_sigkills_resume_bitwise_identical; here the protocol itself, on real TCPStores.
"""

from __future__ import annotations

import datetime
import json
import threading
import time

import psutil
from launch import free_port
from torch.distributed import TCPStore

from elastic_mnist.attempt_store import ENTRY, NONCE, attempt_store, find, serve
from elastic_mnist.env import DistEnv

TIMEOUT = datetime.timedelta(seconds=30)


def server() -> TCPStore:
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)


def client(store: TCPStore) -> TCPStore:
    return TCPStore("127.0.0.1", store.port, is_master=False, timeout=TIMEOUT)


def test_a_rank_takes_only_the_store_that_proves_to_be_this_attempts():
    agent = server()
    earlier = server()  # an earlier attempt's store, whose port a stale entry now names
    earlier.set(NONCE, "earlier")
    agent.set(ENTRY, json.dumps({"host": "127.0.0.1", "port": free_port(), "nonce": "dead"}))
    found: dict[str, TCPStore] = {}
    rank1 = threading.Thread(target=lambda: found.update(store=find(client(agent), TIMEOUT)))
    rank1.start()
    time.sleep(0.5)  # a dead store's entry
    agent.set(ENTRY, json.dumps({"host": "127.0.0.1", "port": earlier.port, "nonce": "mine"}))
    time.sleep(0.5)  # a live store that does not know the entry's nonce
    assert rank1.is_alive() and not found
    rank0 = serve(client(agent), DistEnv(rank=0, world_size=2, launched=True), TIMEOUT)
    rank1.join(timeout=20)
    assert found["store"].get(NONCE) == rank0.get(NONCE)
    found["store"].set("from rank 1", "hello")
    assert rank0.get("from rank 1") == b"hello"  # one store, both ranks


def test_without_the_shared_store_rank_0_serves_the_rounds_address_on_its_interface_alone():
    port = free_port()
    envs = [DistEnv(rank=rank, world_size=2, local_world_size=2, launched=True,
                    master_addr="127.0.0.1", master_port=port) for rank in (0, 1)]
    rank0 = attempt_store(envs[0], TIMEOUT)
    rank1 = attempt_store(envs[1], TIMEOUT)
    rank1.set("from rank 1", "hello")
    assert rank0.get("from rank 1") == b"hello"
    assert listening_addresses(port) == ["127.0.0.1"]  # torch's own server would bind ::


def listening_addresses(port: int) -> list[str]:
    return [c.laddr.ip for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port]


def test_our_stores_listen_where_peers_connect(monkeypatch):
    """The address the advertised name resolves to; every interface only when that is loopback
    and peers on other machines use the name (a hosts file mapping the host name to 127.0.1.1)."""
    import socket

    from elastic_mnist.stores import listen_address, serve_store

    resolved = {"node7": "127.0.1.1", "node8": "192.0.2.8"}
    real = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: [
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", (resolved[host], 0))] if host in resolved
        else real(host, *a, **k))
    assert listen_address("node8", peers_local=False)[1] == "192.0.2.8"
    assert listen_address("node7", peers_local=True)[1] == "127.0.1.1"
    assert listen_address("node7", peers_local=False)[1] == ""  # every interface
    assert listen_address("localhost", peers_local=False)[1] in ("127.0.0.1", "::1")
    assert listen_address("0.0.0.0", peers_local=True)[1] == ""
    store = serve_store("127.0.0.1", 0, timeout=TIMEOUT, peers_local=False)
    assert listening_addresses(store.port) == ["127.0.0.1"]
    everywhere = serve_store("0.0.0.0", 0, timeout=TIMEOUT, peers_local=False)
    assert listening_addresses(everywhere.port) in (["::"], ["0.0.0.0"])
    everywhere.set("k", "v")
    assert client(everywhere).get("k") == b"v"  # reached on loopback too


def test_torchrun_environment_says_whether_the_store_is_shared():
    base = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert DistEnv.from_environ({**base, "TORCHELASTIC_USE_AGENT_STORE": "True"}).uses_agent_store
    assert not DistEnv.from_environ({**base, "TORCHELASTIC_USE_AGENT_STORE": "False"}) \
        .uses_agent_store
    assert not DistEnv.from_environ(base).uses_agent_store
