"""The chaos harness's simulated nodes: each a torchrun agent started as users start one
(``jobs/node.sh``, or the README's multi-node torchrun line) in a session of its own, meeting at a
rendezvous store (``elastic-mnist rendezvous``, or the first node's agent), on loopback or each on
a host of its own (scripts/hosts.py), and the store's host beside them."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import hosts
import netfaults
import psutil
from processes import free_port, kill_tree

REPO = Path(__file__).resolve().parents[1]
# jobs/node.sh's own rendezvous timing (its variables' defaults), for --launch torchrun.
NODE_SH_TIMING = {"LAST_CALL_TIMEOUT": "2", "KEEP_ALIVE_INTERVAL": "1",
                  "KEEP_ALIVE_MAX_ATTEMPT": "3", "MONITOR_INTERVAL": "0.5"}
STORE_PORT = 29400
"""The store's port on hosts of their own: torchrun's default, as on a real cluster."""


def worker_pids(pid: int) -> list[int]:
    """The training workers below agent ``pid``."""
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)
                if "elastic_mnist" in " ".join(p.cmdline()) and "train" in p.cmdline()]
    except psutil.NoSuchProcess:
        return []


def network_hosts(max_nodes: int, store: str) -> dict[str, tuple[str, ...]]:
    """The hosts of a cluster on hosts of their own: ``node0`` to ``node{max_nodes - 1}``, each
    with a control and a data link, and the store's host on the control bridge alone."""
    nodes = {f"node{i}": ("control", "data") for i in range(max_nodes)}  # Cluster.free_host
    return {netfaults.STORE_HOST: ("control",), **nodes} if store == "external" else nodes


class Cluster:
    """Simulated nodes on this machine, each a torchrun agent (through `jobs/node.sh`, or the
    README's plain line) in a session of its own: on loopback, or each on a host of its own
    (``network``, a :class:`hosts.Network` of :func:`network_hosts`)."""

    def __init__(self, workdir: Path, train_args: list[str], max_nodes: int, store: str,
                 env: dict[str, str], nproc_per_node: int = 1, launch: str = "node.sh",
                 rdzv_backend: str = "elastic-mnist", network: hosts.Network | None = None,
                 node_prefix: Callable[[int], list[str]] | None = None):
        self.workdir, self.train_args, self.max_nodes, self.store = (workdir, train_args,
                                                                     max_nodes, store)
        self.nproc_per_node, self.launch = nproc_per_node, launch
        self.rdzv_backend = rdzv_backend
        self.network = network
        self.node_prefix = node_prefix
        """A command prefix for each node (by its number), outside its host's: a CPU budget's
        (scripts/cpu_groups.py), say."""
        self.port = STORE_PORT if network else free_port()
        self.endpoint_host = ("127.0.0.1" if network is None else
                              netfaults.STORE_HOST if store == "external" else "node0")
        self.host_of: dict[int, str] = {}
        """Each node's host, on hosts of their own: a node that comes back (requeued, or a
        join) takes a host that no live node has."""
        self.env = env
        self.nodes: dict[int, subprocess.Popen] = {}
        self.exited: dict[int, int] = {}
        self.store_proc: subprocess.Popen | None = None
        self._next_id = 0
        self.frozen: set[int] = set()
        """Nodes whose worker is stopped for good (the others went on without it): their agent
        waits for it forever, and no later fault can take them."""

    def start_store(self) -> None:
        if self.store == "external":
            log = open(self.workdir / "store.log", "w")  # noqa: SIM115 - the child's
            serve = [sys.executable, "-m", "elastic_mnist", "rendezvous"]
            if self.network is None:
                serve += ["--host", "127.0.0.1", "--port", str(self.port)]
            else:  # as on a machine of its own: its host name, torchrun's port
                serve = self.network.command(netfaults.STORE_HOST, serve)
            self.store_proc = subprocess.Popen(serve, stdout=log, stderr=subprocess.STDOUT,
                                               env=self.env)

    def start_node(self) -> int:
        node = self._next_id
        self._next_id += 1
        is_host = self.store == "agent" and node == 0
        endpoint = f"{self.endpoint_host}:{self.port}"
        if self.launch == "torchrun":
            cmd, env = self.torchrun_line(is_host), self.env
        else:
            cmd = ["bash", str(REPO / "jobs" / "node.sh"), *self.train_args]
            env = {**self.env, "NNODES": f"1:{self.max_nodes}",
                   "NPROC_PER_NODE": str(self.nproc_per_node),
                   "RDZV_ENDPOINT": endpoint, "RUN_ID": "chaos",
                   "MAX_RESTARTS": "100", "RDZV_STORE": self.store,
                   "RDZV_BACKEND": self.rdzv_backend,
                   "RDZV_IS_HOST": "true" if is_host else "false"}
        if self.network is not None:
            host = self.free_host()
            self.host_of[node] = host
            cmd = self.network.command(host, cmd)
            env = {**env, "GLOO_SOCKET_IFNAME": hosts.INNER["data"]}
        if self.node_prefix is not None:
            cmd = [*self.node_prefix(node), *cmd]
        log = open(self.workdir / f"node{node}.log", "w")  # noqa: SIM115 - the child's
        self.nodes[node] = subprocess.Popen(cmd, cwd=self.workdir, env=env, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        return node

    def free_host(self, timeout: float = 60.0) -> str:
        """A node's host that no live node has (a node that left may take some seconds to)."""
        deadline = time.time() + timeout
        while True:
            taken = {self.host_of[n] for n in self.alive()}
            free = [h for h in (f"node{i}" for i in range(self.max_nodes)) if h not in taken]
            if free:
                return free[0]
            if time.time() > deadline:
                raise TimeoutError(f"no host left for a new node: {sorted(taken)} are taken")
            time.sleep(0.2)

    def torchrun_line(self, is_host: bool) -> list[str]:
        """The README's multi-node line, as a user would type it on each node (on loopback,
        with ``is_host`` said: every agent there is on the endpoint's host)."""
        timing = {k: self.env.get(k, v) for k, v in NODE_SH_TIMING.items()}  # --rdzv-defaults
        conf = (f"join_timeout=600,last_call_timeout={timing['LAST_CALL_TIMEOUT']},"
                f"keep_alive_interval={timing['KEEP_ALIVE_INTERVAL']},"
                f"keep_alive_max_attempt={timing['KEEP_ALIVE_MAX_ATTEMPT']}"
                + ("" if self.network else f",is_host={str(is_host).lower()}"))
        return [sys.executable, "-m", "torch.distributed.run", f"--nnodes=1:{self.max_nodes}",
                f"--nproc_per_node={self.nproc_per_node}", f"--rdzv_backend={self.rdzv_backend}",
                f"--rdzv_endpoint={self.endpoint_host}:{self.port}", "--rdzv_id=chaos",
                f"--rdzv_conf={conf}", "--max_restarts=100",
                f"--monitor_interval={timing['MONITOR_INTERVAL']}",
                "-m", "elastic_mnist", "train", *self.train_args]

    def alive(self) -> list[int]:
        for node, proc in list(self.nodes.items()):
            if proc.poll() is not None:
                self.exited[node] = proc.returncode
                del self.nodes[node]
        return sorted(self.nodes)

    def workers(self, but: int | None = None) -> list[int]:
        """The workers of every node, or of every node but ``but``."""
        return [pid for node, proc in self.nodes.items() if node != but
                for pid in worker_pids(proc.pid)]

    def stopped(self, node: int) -> bool:
        """A worker of the node is stopped (SIGSTOP, by chaos or by a fault it was told to
        inject): its agent waits for it forever."""
        for pid in worker_pids(self.nodes[node].pid):
            try:
                if psutil.Process(pid).status() == psutil.STATUS_STOPPED:
                    return True
            except psutil.NoSuchProcess:
                pass
        return False

    def victims(self) -> list[int]:
        """Nodes a fault may take: never the store's host, never the last one, never a frozen
        one."""
        alive = [n for n in self.alive() if n not in self.frozen]
        candidates = [n for n in alive if not (self.store == "agent" and n == 0)]
        return candidates if len(alive) > 1 else []

    def stop(self) -> None:
        for proc in self.nodes.values():
            kill_tree(proc.pid)
        if self.store_proc is not None:
            self.store_proc.terminate()
            self.store_proc.wait(timeout=10)
