"""Each attempt's process group is built on a fresh store, never on one an earlier attempt left.

The job under plain torchrun, restarted after SIGKILLs, is tests/test_elastic.py's
test_random_sigkills_resume_bitwise_identical; here the protocol itself, on real TCPStores.
"""

from __future__ import annotations

import datetime
import json
import threading
import time

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


def test_without_the_shared_store_torch_rendezvous_is_used():
    env = DistEnv(rank=0, world_size=2, launched=True, uses_agent_store=False)
    assert attempt_store(env, TIMEOUT) is None


def test_torchrun_environment_says_whether_the_store_is_shared():
    base = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert DistEnv.from_environ({**base, "TORCHELASTIC_USE_AGENT_STORE": "True"}).uses_agent_store
    assert not DistEnv.from_environ({**base, "TORCHELASTIC_USE_AGENT_STORE": "False"}) \
        .uses_agent_store
    assert not DistEnv.from_environ(base).uses_agent_store
