"""Nodes that join a job as it trains, in process: the job's ranks admit them at a step boundary
and the joiners take rank 0's state (admissions.py, joiner.py). The job runs under plain torchrun
agents (c10d) on loopback; the joining node's workers are started as our rendezvous's handler
would start them (notes/rdzv-spec.md), its records written as the handler writes them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from launch import REPO, clean_env, free_port, kill_tree
from shared_runs import args_for, inspect
from test_agents import installed_backend
from test_dashboards import accumulate
from torch.distributed import TCPStore

from elastic_mnist.attempt_store import JOIN_HANG_WARNING
from elastic_mnist.errors import EXIT_DROPPED
from elastic_mnist.events import read_events
from elastic_mnist.resilience.faults import FAULT_VAR

sys.path.insert(0, str(REPO / "scripts"))
import check_audit

RDZV_ID = "joins"
STORES: list[TCPStore] = []
"""Stores of in-process joiners, served until the session ends."""


def register_join(store: TCPStore, nproc: int) -> tuple[dict, dict[str, str]]:
    """What our handler does for an agent that arrives while the job trains in process: its
    serial and record, a join in the job's round; and the environment it and torchrun give the
    node's workers (``RANK`` and ``WORLD_SIZE`` as the job will be once it admits the node)."""
    p = f"elastic_mnist/{RDZV_ID}/rdzv/"
    job = json.loads(store.get(p + "job"))
    serial = store.add(p + "agents", 1)
    store.set(p + f"agent/{serial}", json.dumps({"host": "joiner", "addr": "joiner",
                                                 "pid": os.getpid(), "nproc": nproc}))
    round_ = job["round"]
    join = store.add(p + f"round/{round_}/joins", 1) - 1
    store.set(p + f"round/{round_}/join/{join}", str(serial))
    group_rank = len(job["nodes"]) + join
    host, port = store.host, store.port
    env = {"WORLD_SIZE": str((group_rank + 1) * nproc), "LOCAL_WORLD_SIZE": str(nproc),
           "GROUP_RANK": str(group_rank), "GROUP_WORLD_SIZE": str(group_rank + 1),
           "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str((group_rank + 1) * nproc),
           "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
           "TORCHELASTIC_RUN_ID": RDZV_ID, "TORCHELASTIC_USE_AGENT_STORE": "True",
           "MASTER_ADDR": host, "MASTER_PORT": str(port),
           "ELASTIC_MNIST_RDZV": f"{host}:{port}", "ELASTIC_MNIST_RDZV_ID": RDZV_ID,
           "ELASTIC_MNIST_AGENT": str(serial), "ELASTIC_MNIST_ROUND": str(round_),
           "ELASTIC_MNIST_KEEP_ALIVE": "0.5,3", "ELASTIC_MNIST_JOIN": str(join)}
    return job, env


def start_joiners(tmp_path: Path, args: list[str], env: dict[str, str],
                  nproc: int) -> list[subprocess.Popen]:
    group_rank = int(env["GROUP_RANK"])
    return [subprocess.Popen(
        [sys.executable, "-m", "elastic_mnist", *args],
        env=clean_env(**env, RANK=str(group_rank * nproc + local), LOCAL_RANK=str(local),
                      ROLE_RANK=str(group_rank * nproc + local)),
        stdout=(tmp_path / f"joiner{local}.log").open("w"), stderr=subprocess.STDOUT,
        start_new_session=True) for local in range(nproc)]


def worker(agent: subprocess.Popen, rank: int) -> psutil.Process:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = [p for p in psutil.Process(agent.pid).children() if rank_of(p) == str(rank)]
        if found:
            return found[0]
        time.sleep(0.1)
    raise AssertionError(f"no worker of rank {rank}")


def rank_of(process: psutil.Process, name: str = "RANK") -> str | None:
    """A child's ``RANK`` (or ``name``); None for one gone as it was read (the agent's
    short-lived children: one ended between the listing and the read once)."""
    try:
        return process.environ().get(name)
    except psutil.NoSuchProcess:
        return None


class Watched:
    """A job launched by a test: its logs (``tmp_path``'s ``*.log``), its records, and waits
    that fail, with the logs, when it stopped (``alive``) or took too long."""

    def __init__(self, tmp_path: Path, run_dir: Path, alive):
        self.tmp_path, self.run_dir, self.alive = tmp_path, run_dir, alive

    def logs(self) -> str:
        return "\n".join(f"--- {path.name}\n{path.read_text()}"
                         for path in sorted(self.tmp_path.glob("*.log")))

    def recorded(self, kind: str) -> list[dict]:
        path = self.run_dir / "events.jsonl"
        return [e for e in read_events(path) if e["event"] == kind] if path.exists() else []

    def wait_for(self, predicate, what: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline and self.alive(), f"{what}:\n{self.logs()}"
            time.sleep(0.05)


def audit(run_dir: Path) -> dict[tuple[int, int], list[dict]]:
    """(generation, rank) -> that rank's audit records of that generation."""
    found = {}
    for path in (run_dir / "audit").glob("g*-r*.jsonl"):
        generation, rank = (int(part[1:]) for part in path.stem.split("-"))
        found[generation, rank] = [json.loads(line) for line in path.read_text().splitlines()]
    return found


@pytest.fixture
def job_to_join(tiny_digits, monkeypatch):
    """A job at generation 1 of rendezvous round 0 as its rank 0 publishes it (its records and
    its description, with ``theirs`` changed), on a store of this process's, and this process's
    environment as our handler gives a worker of the first node that joins it."""
    from elastic_mnist.config import TrainConfig
    from elastic_mnist.data.datasets import load
    from elastic_mnist.model import build_model

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    STORES.append(store)  # the joiner's threads outlive its main() here: they keep talking

    def publish(finished: bool = False, **theirs) -> TCPStore:
        store.set(f"elastic_mnist/{RDZV_ID}/rdzv/job", json.dumps({
            "round": 0, "launch": "L", "generation": 1, "nodes": [1], "world_size": 1,
            "in_process": True, "run_id": "grown", "finished": finished}))
        cfg, data = TrainConfig(), load(tiny_digits, "synthetic")
        cfg.optim.epochs, cfg.optim.seed = theirs.get("epochs", 4), theirs.get("seed", 0)
        config = cfg.to_dict()
        config["optim"].update(global_batch_size=64, micro_batch_size=16)
        config["data"]["dataset"] = "synthetic"
        store.set(f"elastic_mnist/{RDZV_ID}/L/description", json.dumps({
            "config": config, "data": {"kind": "synthetic", "num_train": 640,
                                       "fingerprint": theirs.get("fingerprint", data.fingerprint)},
            "model": {k: list(v.shape) for k, v in build_model(0).state_dict().items()}}))
        return store

    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                        "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2",
                        "TORCHELASTIC_RUN_ID": RDZV_ID,
                        "ELASTIC_MNIST_RDZV": f"127.0.0.1:{store.port}",
                        "ELASTIC_MNIST_RDZV_ID": RDZV_ID, "ELASTIC_MNIST_AGENT": "1",
                        "ELASTIC_MNIST_ROUND": "0", "ELASTIC_MNIST_JOIN": "0"}.items():
        monkeypatch.setenv(name, value)
    return publish


FLAGS_LINE = "the job this node joins runs with --{}={}, this node with {}: start it with the " \
    "job's flags"


@pytest.mark.parametrize("theirs, said", [
    ({"seed": 1}, FLAGS_LINE.format("seed", 1, 0)),
    ({"epochs": 9}, FLAGS_LINE.format("epochs", 9, 4)),
    ({"fingerprint": "0" * 64}, ("the job this node joins trains on other digits (fingerprint "
                                 "000000000000, 640 synthetic samples) than this node's ")),
])
@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # @record, in process
def test_a_joining_worker_unlike_the_job_says_why_in_one_line(tiny_digits, tmp_path, job_to_join,
                                                              capsys, theirs, said):
    """A joining worker whose flags would take it out of step with the job's ranks, or whose
    node holds other digits, says so in one line and exits 2, before it says it is ready (no
    group, no step: in process)."""
    from elastic_mnist.cli import main

    store = job_to_join(**theirs)
    assert main(args_for(tiny_digits, tmp_path, "--pg-timeout", "10")) == 2
    line, = capsys.readouterr().err.strip().splitlines()[-1:]
    assert line.startswith(f"elastic-mnist train: error: {said}"), line
    assert not store.check([f"elastic_mnist/{RDZV_ID}/rdzv/round/0/join/0/ready/0"])


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # @record, in process
def test_a_joining_worker_leaves_when_the_job_ends_or_stops_before_it_is_admitted(
        tiny_digits, tmp_path, job_to_join, capsys):
    """A joining worker that is ready but never admitted: the job finished meanwhile (exit 0:
    its node has nothing to do), or it stopped beating for the membership's bound (stopped as a
    whole, or lost: EXIT_PREEMPTED, so that torchrun restarts the node into the next round).
    In process."""
    import threading

    from elastic_mnist.cli import main
    from elastic_mnist.errors import EXIT_PREEMPTED

    store = job_to_join()
    ready = f"elastic_mnist/{RDZV_ID}/rdzv/round/0/join/0/ready/0"
    args = args_for(tiny_digits, tmp_path, "--pg-timeout", "10", "--hang-timeout", "0.5")
    start = time.monotonic()
    assert main(args) == EXIT_PREEMPTED  # nobody beats: stopped after 1 s of pulses
    assert store.check([ready]) and time.monotonic() - start < 30
    assert "the job stopped before it admitted this node (its beat stood still for 1 s): " \
        f"exiting with {EXIT_PREEMPTED}" in capsys.readouterr().err

    store.delete_key(ready)
    finisher = threading.Thread(target=lambda: (store.wait([ready]), job_to_join(finished=True)))
    finisher.start()
    assert main(args) == 0
    finisher.join()
    assert "the job ended before it admitted this node" in capsys.readouterr().err


@pytest.mark.slow
def test_a_worker_death_costs_its_node_alone_and_the_node_joins_back_in_process(tiny_digits,
                                                                                tmp_path):
    """Two plain torchrun agents (c10d): node 0 of one worker, node 1 of two. Rank 2 is
    SIGKILLed: the job goes on without every rank of node 1 (rank 1, its sibling, which node 1's
    agent stops anyway, leaves dropped, not waited for in a second round), in rank 0's process.
    Node 1 comes back at once as our handler would bring it: two workers that join. Rank 0 admits
    them at a step boundary, world size 1 -> 3, in process: they take rank 0's state (the digest
    of the checkpoint of that step), every sample is used once, rank 0 is the same process
    throughout, and the job and the joiners end with 0."""
    port = free_port()
    args = args_for(tiny_digits, tmp_path, "--run-id", "grown", "--epochs", "12",
                    "--checkpoint-every", "1", "--keep-last", "400", "--hang-timeout", "5",
                    "--audit-samples")
    env = clean_env(**{FAULT_VAR: "slow@1:0"})  # rank 0 paces the job: 6 s or more
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--nproc_per_node={n}",
         "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id={RDZV_ID}",
         f"--rdzv_conf=is_host={str(i == 0).lower()}", "--monitor_interval=0.2",
         "-m", "elastic_mnist", *args],
        env=env, stdout=(tmp_path / f"agent{i}.log").open("w"), stderr=subprocess.STDOUT,
        start_new_session=True) for i, n in enumerate((1, 2))]
    run_dir = tmp_path / "runs" / "grown"
    joiners: list[subprocess.Popen] = []
    job = Watched(tmp_path, run_dir, lambda: agents[0].poll() is None)
    logs, recorded, wait_for = job.logs, job.recorded, job.wait_for

    try:
        rank0 = worker(agents[0], 0)
        wait_for(lambda: len(audit(run_dir).get((0, 0), [])) >= 3, "no third step")
        store = TCPStore("127.0.0.1", port, is_master=False)
        worker(agents[1], 2).send_signal(signal.SIGKILL)
        # Its agent comes back at once, as a join: the job it finds may not have shrunk yet.
        job, join_env = register_join(store, nproc=2)
        assert (job["round"], job["in_process"], job["finished"]) == (0, True, False), job
        joined_at = time.time()
        joiners = start_joiners(tmp_path, args, join_env, nproc=2)
        wait_for(lambda: recorded("grow"), "no grow")
        assert rank0.is_running() and rank0.pid == worker(agents[0], 0).pid  # never restarted
        assert [joiner.wait(timeout=120) for joiner in joiners] == [0, 0], logs()
        assert agents[0].wait(timeout=60) == 0, logs()
        assert agents[1].wait(timeout=60) != 0  # its worker was killed, and no restart asked
    finally:
        for proc in [*agents, *joiners]:
            kill_tree(proc.pid)

    # Node 1's other worker left as dropped, at once: not a member of the next generation.
    assert f"exitcode  : {EXIT_DROPPED}" in (tmp_path / "agent1.log").read_text(), logs()
    assert "rank 1 was dropped from the job at generation 0 (the job is at 1): leaving without " \
        "writing" in (tmp_path / "agent1.log").read_text()
    (start,) = recorded("start")
    (shrink,) = recorded("shrink")
    (grow,) = recorded("grow")
    assert (start["world_size"], start["recovery"]) == (3, "in-process")
    assert (shrink["lost_ranks"], shrink["new_world_size"], shrink["why"]) == ([1, 2], 1, "died")
    assert (grow["old_world_size"], grow["new_world_size"], grow["joined_ranks"],
            grow["restart_generation"]) == (1, 3, [1, 2], 2), grow
    assert recorded("fallback") == [] and len(recorded("finish")) == 1
    saved = {c["step"]: c["model_digest"] for c in inspect(tmp_path / "ckpt")["checkpoints"]}
    assert grow["model_digest"] == saved[grow["step"]]  # the joiners hold rank 0's state

    # Every sample once, across the shrink and the grow; the joiners' first step is the one
    # after the grow's.
    assert check_audit.check(run_dir, num_samples=640) == []
    records = audit(run_dir)
    assert sorted(rank for generation, rank in records if generation == 2) == [0, 1, 2]
    first = [records[2, rank][0] for rank in (1, 2)]
    assert [r["step"] for r in first] == [grow["step"] + 1] * 2
    steps = {r["step"]: r["time"] for (_, rank), rs in records.items() if rank == 0 for r in rs}
    gap = steps[grow["step"] + 1] - steps[grow["step"]]
    print(f"a join: {min(r['time'] for r in first) - joined_at:.2f} s from the joiners' start to "
          f"their first step; rank 0's gap between steps at the grow {gap:.2f} s, from its "
          f"admission to the step after it {grow['admission_to_step_s']:.2f} s")
    assert gap < 5  # the admission costs the job's ranks no seconds

    from elastic_mnist.plot import read_record

    changes = [(r.world_before, r.world_after, r.in_process) for r in read_record(run_dir).restarts]
    assert changes == [(3, 1, True), (1, 3, True)]  # the plot's marks

    # TensorBoard: the world size and the generation as they changed.
    acc = accumulate(run_dir)
    worlds = [int(e.value) for e in acc.Scalars("elastic/world_size")]
    assert [w for i, w in enumerate(worlds) if i == 0 or worlds[i - 1] != w] == [3, 1, 3]
    generations = {int(e.value) for e in acc.Scalars("elastic/restart_generation")}
    assert generations == {0, 1, 2}


@pytest.mark.slow
@pytest.mark.long
def test_nodes_join_a_job_under_our_rendezvous_in_process(tiny_digits, tmp_path):
    """Real torchrun agents on our rendezvous (``--rdzv_backend=elastic-mnist``), the store
    served by `elastic-mnist rendezvous`: nodes A and B of two workers. At once a worker of B is
    SIGKILLed (B's agent restarts B's workers) and node C arrives. Nobody else restarts: the job
    goes on without both of B's ranks, then admits B and C as they come, in process, back to six
    ranks; A's workers are the same processes throughout, every sample is used once, and every
    torchrun exits 0."""
    installed_backend()
    port = free_port()
    env = clean_env(**{FAULT_VAR: "slow@1:0"})
    args = args_for(tiny_digits, tmp_path, "--run-id", "ours", "--epochs", "30",
                    "--hang-timeout", "5", "--audit-samples", "--log-every", "10")
    store = subprocess.Popen([sys.executable, "-m", "elastic_mnist", "rendezvous", "--host",
                              "127.0.0.1", "--port", str(port)], env=env,
                             stdout=(tmp_path / "store.log").open("w"),
                             stderr=subprocess.STDOUT, start_new_session=True)
    agents: dict[str, subprocess.Popen] = {}
    started: dict[str, float] = {}

    def agent(name: str) -> None:
        started[name] = time.time()
        agents[name] = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:3",
             "--nproc_per_node=2", "--max_restarts=3", "--rdzv_backend=elastic-mnist",
             f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id={RDZV_ID}",
             "--rdzv_conf=is_host=false,last_call_timeout=1,keep_alive_interval=0.5",
             "--monitor_interval=0.2", "-m", "elastic_mnist", *args],
            env=env, stdout=(tmp_path / f"agent-{name}.log").open("w"),
            stderr=subprocess.STDOUT, start_new_session=True)

    run_dir = tmp_path / "runs" / "ours"
    job = Watched(tmp_path, run_dir, lambda: store.poll() is None)
    logs, recorded, wait_for = job.logs, job.recorded, job.wait_for

    def workers(name: str) -> dict[int, psutil.Process]:
        children = psutil.Process(agents[name].pid).children()
        return {int(rank_of(p, "LOCAL_RANK")): p for p in children
                if rank_of(p, "LOCAL_RANK") is not None}

    try:
        agent("A")
        agent("B")
        wait_for(lambda: len(audit(run_dir).get((0, 0), [])) >= 5, "no fifth step")
        a_workers = {p.pid for p in workers("A").values()}
        b_ranks = sorted(int(p.environ()["RANK"]) for p in workers("B").values())
        workers("B")[1].send_signal(signal.SIGKILL)
        agent("C")
        wait_for(lambda: sum(len(g["joined_ranks"]) for g in recorded("grow")) >= 4,
                 "B and C not both admitted")
        assert {p.pid for p in workers("A").values()} == a_workers  # never restarted
        codes = {name: proc.wait(timeout=120) for name, proc in agents.items()}
        assert codes == {"A": 0, "B": 0, "C": 0}, logs()
    finally:
        for proc in [*agents.values(), store]:
            kill_tree(proc.pid)

    (start,) = recorded("start")
    (shrink,) = recorded("shrink")
    grows = recorded("grow")
    assert (start["world_size"], start["recovery"]) == (4, "in-process")
    assert (shrink["lost_ranks"], shrink["new_world_size"]) == (b_ranks, 2)  # B's, both
    assert [g["new_world_size"] for g in grows][-1] == 6 and recorded("fallback") == []
    assert check_audit.check(run_dir, num_samples=640) == []
    assert JOIN_HANG_WARNING not in logs()  # c10d's shared store's trouble is not ours
    first = {g: min(r["time"] for r in rs) for (g, _), rs in audit(run_dir).items()}
    for g in grows:  # the timings, for the record
        print(f"under our rendezvous: {g['old_world_size']} -> {g['new_world_size']} at step "
              f"{g['step']}, its first step {first[g['restart_generation']] - started['C']:.1f} s "
              f"after node C started, {g['admission_to_step_s']:.2f} s after its admission")
