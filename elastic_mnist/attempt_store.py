"""The store each attempt builds its process group on: always a fresh one.

torchrun (torch 2.14) shares its rendezvous TCPStore with the workers by default
(``TORCHELASTIC_USE_AGENT_STORE=True``): every attempt's workers would build their process group
on the agent's store, which outlives restarts with no namespace per attempt. Workers restarted
after a failure can then read a dead worker's gloo address and fail ("Gloo connectFullMesh failed
... Connection refused") or hang; pytorch/pytorch#135712 reports the same for NCCL. Restart
counts cannot tell attempts apart: each agent counts its own, and a membership change does not
count at all.

So under the shared store rank 0 serves a fresh store of its own and publishes its address, with
a random nonce, through the agent's store; every other rank takes an address only once the store
there answers with that nonce. An entry left by an earlier attempt points to a dead store (its
workers were stopped before this attempt's rendezvous), or, if the port was taken again, to one
that does not know the nonce: either way the rank reads the entry again until this attempt's rank
0 has replaced it. Nothing depends on restart counts.

Two nodes may go by one host name (a cloned image, a cluster that names every node alike): the
other one then resolves the name that rank 0 published to itself, where nothing listens. So rank
0 publishes beside its name the machine it is (``this_machine``) and an address its store listens
on, and a rank on another machine whose resolver gives that name an address of its own connects
to the address instead, saying so once in one line.

Without the shared store (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, as jobs/*.sh set) torchrun
gives every round a fresh address for a store of rank 0's (``MASTER_ADDR:MASTER_PORT``), and rank
0 serves it there, as torch's ``env://`` would, but listening only on the address that
``MASTER_ADDR`` names (elastic_mnist/stores.py): torch's own server binds every interface.
"""

from __future__ import annotations

import datetime
import json
import logging
import secrets
import socket
import time

from torch.distributed import TCPStore

from elastic_mnist.addresses import (
    bindable_addresses,
    is_loopback,
    source_toward,
    store_endpoint,
    this_machine,
)
from elastic_mnist.env import OUR_BACKEND, DistEnv
from elastic_mnist.errors import EnvError
from elastic_mnist.stores import listen_address, listening, serve_store

log = logging.getLogger(__name__)

ENTRY = "elastic_mnist/attempt_store"
"""Key in the agent's store of the current attempt's store: {"host", "port", "nonce",
"machine", "address"}."""
NONCE = "nonce"
PROBE_TIMEOUT = datetime.timedelta(seconds=2)
"""How long a rank tries an advertised store before it reads the entry again."""
JOIN_HANG_WARNING = (
    "torchrun shares its rendezvous store with the workers (torch 2.14's default): restarts "
    "are safe, but a node that joins this running job will hang every agent for 60 s and fail "
    "it; set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in every node's environment (as jobs/*.sh do)")


def attempt_store(env: DistEnv, timeout: datetime.timedelta) -> TCPStore:
    """The store for this attempt's process group, served by rank 0.

    Under the shared store of torch's c10d rendezvous rank 0 also says, once per launch, what
    no worker can mend (our rendezvous shares its store and takes joining nodes in process).
    """
    if not env.uses_agent_store:
        return round_store(env, timeout)
    ours = env.rendezvous is not None and env.rendezvous.backend == OUR_BACKEND
    if env.is_main and env.restart_count == 0 and not ours:  # ours admits joins as they come
        log.warning("%s", JOIN_HANG_WARNING)
    agent = TCPStore(env.master_addr, env.master_port, is_master=False, timeout=timeout)
    return serve(agent, env, timeout) if env.is_main else find(agent, timeout)


def round_store(env: DistEnv, timeout: datetime.timedelta) -> TCPStore:
    """The store at the address torchrun gave this round (``MASTER_ADDR:MASTER_PORT``): rank 0
    serves it, the others connect."""
    if env.master_addr is None or env.master_port is None:
        raise EnvError("MASTER_ADDR and MASTER_PORT must be set under torchrun")
    if env.is_main:
        return serve_store(env.master_addr, env.master_port, timeout=timeout,
                           peers_local=all_local(env), world_size=env.world_size)
    return TCPStore(env.master_addr, env.master_port, is_master=False, timeout=timeout)


def all_local(env: DistEnv) -> bool:
    """Every rank of this attempt runs on this machine."""
    return env.world_size == env.local_world_size


def serve(agent: TCPStore, env: DistEnv, timeout: datetime.timedelta) -> TCPStore:
    """Rank 0: a new store on a free port, published with a nonce it alone knows."""
    host = socket.getfqdn(socket.gethostname())  # what torchrun advertises for its own stores
    store = serve_store(host, 0, timeout=timeout, peers_local=all_local(env),
                        world_size=env.world_size)
    nonce = secrets.token_hex(16)
    store.set(NONCE, nonce)
    agent.set(ENTRY, json.dumps({"host": host, "port": store.port, "nonce": nonce,
                                 "machine": this_machine(), "address": address_of(host, env)}))
    return store


def address_of(host: str, env: DistEnv) -> str | None:
    """An address of this machine's that the store served for ``host`` listens on, as ranks on
    other machines reach it: where it listens on ``host``'s address, that one; where on every
    interface, the one this machine reaches the rendezvous from (None: loopback only)."""
    _, address = listen_address(host, peers_local=all_local(env))
    if address:
        return None if is_loopback(address) else address
    endpoint = store_endpoint(env)
    toward = None if endpoint is None else source_toward(*endpoint)
    return None if toward is None or is_loopback(toward) else toward


def _reachable(entry: dict) -> str:
    """Where a rank connects to the store of ``entry``: its host name, or its address where
    the name resolves to this machine but rank 0 runs on another (two nodes, one name)."""
    host, address = entry["host"], entry.get("address")
    if address and entry.get("machine") != this_machine() and bindable_addresses(host):
        global _SAID_SHARED
        if not _SAID_SHARED:
            _SAID_SHARED = True
            log.warning("rank 0 published its group's store by the host name %r, which "
                        "resolves to this machine too (two nodes go by one name): reaching it "
                        "at %s, its address, instead; give each node its own host name", host,
                        address)
        return address
    return host


_SAID_SHARED = False
"""Whether this process said that rank 0's host name resolves here (once is enough)."""


def find(agent: TCPStore, timeout: datetime.timedelta) -> TCPStore:
    """Other ranks: the advertised store, once it proves to be this attempt's."""
    deadline = time.monotonic() + timeout.total_seconds()
    while time.monotonic() < deadline:
        entry = json.loads(agent.get(ENTRY))  # waits until some attempt has published one
        host = _reachable(entry)
        # A dead attempt's entry: c10d would log the refused connection.
        if not listening(host, entry["port"], PROBE_TIMEOUT.total_seconds()):
            time.sleep(0.05)
            continue
        try:
            store = TCPStore(host, entry["port"], is_master=False, timeout=PROBE_TIMEOUT)
            if store.get(NONCE).decode() == entry["nonce"]:
                store.set_timeout(timeout)
                return store
        except RuntimeError:  # DistNetworkError, DistStoreError: dead, or not this attempt's
            pass
        time.sleep(0.05)
    raise TimeoutError(f"rank 0 published no live store within {timeout.total_seconds():.0f} s")

