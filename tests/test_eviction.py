"""``--evict-slower-than``: a node that stays too slow leaves in process, and comes back by the
join path once it is fast again (eviction.py). The rule on a detector's state, the probation on
a store, and one real job: two nodes under jobs/node.sh, one of them slowed from outside."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from launch import REPO, clean_env
from torch.distributed import HashStore

from elastic_mnist.config import TrainConfig
from elastic_mnist.env import OUR_BACKEND, Rendezvous
from elastic_mnist.errors import CannotRecover, ConfigError
from elastic_mnist.eviction import PROBES, Eviction, Probation, record_key
from elastic_mnist.pace import StragglerDetector
from elastic_mnist.resilience.agreement import Identity
from elastic_mnist.step_result import StepResult

sys.path.insert(0, str(REPO / "scripts"))
import check_audit
from chaos import Observer
from cluster import Cluster, worker_pids


class Events:
    def __init__(self) -> None:
        self.emitted: list[tuple[str, int, dict]] = []

    def emit(self, kind: str, step: int, **fields) -> None:
        self.emitted.append((kind, step, fields))


class Writers:
    def __init__(self) -> None:
        self.events = Events()


class Known:
    """A generation's identities, as ``Membership.known`` gives them."""

    def __init__(self, identities: dict[int, Identity], ready: bool = True):
        self.identities, self.ready = identities, ready

    def read(self, again: bool = False) -> dict[int, Identity]:
        return self.identities


class Member:
    """What eviction.py reads of the in-process membership."""

    in_process = True

    def __init__(self, rank: int, nodes: list[int], local_rank: int = 0, read: bool = True):
        """``read``: whether this rank read the generation's identities already (a watcher);
        either way every rank's is in the store."""
        identities = {r: Identity(f"host{n}", 100 + r, 10 + n, r % 2, serial=n)
                      for r, n in enumerate(nodes)}
        self.known = Known(identities, ready=read)
        self.identity = identities[rank]
        self.store = HashStore()
        for r, identity in identities.items():
            self.store.set(self.key(f"id/{r}"), json.dumps(dataclasses.asdict(identity)))
        self.env = Env(rank, len(nodes), local_rank, local_world_size=nodes.count(nodes[rank]))

    def key(self, name: str) -> str:
        return f"g0/{name}"


class Env:
    def __init__(self, rank: int, world_size: int, local_rank: int = 0,
                 backend: str = OUR_BACKEND, local_world_size: int = 1):
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.local_world_size = local_world_size
        self.is_main = rank == 0
        self.rendezvous = Rendezvous("localhost", 29400, "job", backend=backend)


def slow_detector(world_size: int, slow: dict[int, float], steps: int = 40) -> StragglerDetector:
    detector = StragglerDetector()
    for step in range(steps):
        detector.observe(step, [0.01 * slow.get(r, 1.0) for r in range(world_size)])
    return detector


def result_of(voted: bool = True, **fields) -> StepResult:
    """A completed step's result as every rank reads it: ``voted``, some rank voted to evict."""
    return StepResult(**{"loss": 0.0, "accuracy": 0.0, "samples": 64, "stop_requested": False,
                         "evict_voted": voted, **fields})


def eviction(factor: float = 2.0, after: float = 0.0) -> Eviction:
    cfg = TrainConfig()
    cfg.run.evict_slower_than, cfg.run.evict_after = factor, after
    cfg.optim.global_batch_size, cfg.optim.micro_batch_size = 64, 16
    return Eviction(cfg)


def test_a_straggler_over_the_factor_takes_its_whole_node_and_nobody_else():
    """Rank 3 of nodes [0, 0, 1, 1], 3x slow: named, a candidate, voted at once (after 0 s),
    and its node's both ranks leave; said in an ``evicted`` record with the peers' pace per
    micro-batch, and kept in the store by the node's first rank for its next workers."""
    detector = slow_detector(4, {3: 3.0})
    assert set(detector.named) == {3}
    member = Member(rank=2, nodes=[0, 0, 1, 1])
    e, writers = eviction(), Writers()
    e.enter(member.env, writers, member)
    assert not e.vote()
    e.follow(40, detector)
    assert e.vote()
    assert e.decide(40, result_of(False), detector, done=False) == []  # nobody voted: nobody leaves
    assert e.decide(40, result_of(True), detector, done=False) == [2, 3]
    (kind, step, fields), = writers.events.emitted
    assert (kind, step, fields["ranks"], fields["named"], fields["hosts"]) == \
        ("evicted", 40, [2, 3], [3], ["host1"])
    assert fields["factor"] == pytest.approx(3.0, rel=0.01)
    assert fields["micro_batch_s"] == pytest.approx(0.01 * 4 / 4)  # W / micro-batches a step
    kept = json.loads(member.store.get(record_key("host1", 11)))
    assert kept["step"] == 40 and kept["micro_batch_s"] == fields["micro_batch_s"]


def test_a_rank_that_has_not_read_the_identities_reads_a_nodes_size_around_each_named():
    """Where this rank did not read the generation's identities (it is no watcher), it reads
    those within a node's size of the named rank, and takes the same whole node."""
    detector = slow_detector(6, {4: 3.0})
    member = Member(rank=0, nodes=[0, 0, 1, 1, 2, 2], read=False)
    member.known.read = lambda again=False: pytest.fail("read every identity")
    e = eviction()
    e.enter(member.env, Writers(), member)
    e.follow(40, detector)
    assert e.vote() and e.decide(40, result_of(True), detector, done=False) == [4, 5]


def test_a_rank_of_a_node_short_of_a_worker_reads_the_named_node_whole():
    """After a change a node may be a worker short: a rank of it (3 workers) reads on past its own
    node's size until another node bounds the named one (4 workers), and takes it whole, as the
    watcher does (a review's finding: it took ranks 3-5, the others 3-6)."""
    nodes = [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    detector = slow_detector(11, {3: 3.0})
    for rank, read in ((0, True), (1, False), (5, False), (8, False)):
        member = Member(rank=rank, nodes=nodes, read=read)
        e = eviction()
        e.enter(member.env, Writers(), member)
        e.follow(40, detector)
        assert e.vote() and e.decide(40, result_of(True), detector, done=False) == [3, 4, 5, 6]


def test_under_the_factor_or_before_the_time_nobody_is_evicted():
    """A rank named at 2x is no candidate under --evict-slower-than 3; at 4x it is, but no rank
    votes before --evict-after has passed; a world of one node is never emptied."""
    detector = slow_detector(4, {3: 2.0})
    member = Member(rank=0, nodes=[0, 0, 1, 1])
    e = eviction(factor=3.0)
    e.enter(member.env, Writers(), member)
    e.follow(40, detector)
    assert set(detector.named) == {3} and not e.since and not e.vote()

    detector = slow_detector(4, {3: 4.0})
    e = eviction(factor=3.0, after=60.0)
    e.enter(member.env, Writers(), member)
    e.follow(40, detector)
    assert list(e.since) == [3] and not e.vote()

    alone = Member(rank=0, nodes=[0, 0, 0, 0])
    e = eviction()
    e.enter(alone.env, Writers(), alone)
    e.follow(40, detector)
    assert e.vote() and e.decide(40, result_of(True), detector, done=False) == []


def test_the_vote_is_for_the_oldest_candidates_and_waits_for_a_step_of_its_own():
    """Ranks vote for rank 3, a candidate since step 40; at step 41, where the vote is
    counted, rank 5 is named too: only rank 3's node leaves (rank 5 has been one for no time).
    Where rank 3 is no candidate any more by then, nobody leaves. Nor at the job's last step,
    nor at a step where some rank leaves or every rank stops."""
    member = Member(rank=0, nodes=[0, 0, 1, 1, 2, 2])
    one, both = slow_detector(6, {3: 3.0}), slow_detector(6, {3: 3.0, 5: 3.0})
    assert set(both.named) == {3, 5}
    e = eviction()
    e.enter(member.env, Writers(), member)
    e.follow(40, one)
    assert e.vote()
    e.follow(41, both)
    assert e.decide(41, result_of(True), both, done=False) == [2, 3]

    e.enter(member.env, Writers(), member)
    e.follow(40, one)
    assert e.vote()
    e.follow(41, slow_detector(6, {5: 3.0}))
    assert e.decide(41, result_of(True), both, done=False) == []

    for result, done in ((result_of(), True), (result_of(leavers=[0]), False),
                         (result_of(stop_requested=True), False)):
        e.enter(member.env, Writers(), member)
        e.follow(40, one)
        assert e.vote() and e.decide(41, result, one, done=done) == []


def test_a_store_that_does_not_answer_as_the_job_evicts_is_one_line():
    """A rank that cannot read who the candidates' nodes are gives up on going on in process
    (CannotRecover: one line, EXIT_GAVE_UP) rather than with a traceback."""
    def silent(again: bool = False):
        raise RuntimeError("timeout: the store did not answer")

    member = Member(rank=1, nodes=[0, 0, 1, 1])
    member.known.read = silent
    detector, e = slow_detector(4, {3: 3.0}), eviction()
    e.enter(member.env, Writers(), member)
    e.follow(40, detector)
    assert e.vote()
    with pytest.raises(CannotRecover, match="does not answer as the job lets a straggler go"):
        e.decide(40, result_of(True), detector, done=False)


def test_under_torchs_c10d_nobody_is_evicted(caplog):
    """Under c10d an evicted node's return restarts every node, and its end closes the
    rendezvous: eviction is off there, said once by rank 0."""
    member = Member(rank=0, nodes=[0, 0, 1, 1])
    member.env = Env(0, 4, backend="c10d")
    e = eviction()
    for _ in range(2):
        e.enter(member.env, Writers(), member)
        e.follow(40, slow_detector(4, {3: 3.0}))
        assert not e.vote()
        assert e.decide(40, result_of(True), slow_detector(4, {3: 3.0}), done=False) == []
    assert caplog.text.count("--evict-slower-than is off") == 1


def test_the_flags_are_checked_in_one_line():
    for factor, recovery, said in ((1.2, "auto", "at least 1.5"),
                                   (2.0, "restart", "not with --recovery restart")):
        cfg = TrainConfig()
        cfg.run.evict_slower_than, cfg.run.recovery = factor, recovery
        with pytest.raises(ConfigError, match=said):
            cfg.validate()


def test_probation_asks_to_join_once_fast_again_and_stops_with_the_job(monkeypatch):
    """No eviction kept for the node: it asks at once. One kept: it waits until PROBES probes
    in a row are under pace.SLOW of the peers' pace (a slow one in between starts the count
    again), then forgets it; and gives up when the job is over or it is asked to stop."""
    monkeypatch.setattr("elastic_mnist.eviction.PROBE_EVERY_S", 0.0)
    member = Member(rank=1, nodes=[0, 1])
    cfg = TrainConfig()
    cfg.run.evict_slower_than = 2.0
    data = type("Digits", (), {"__len__": lambda self: 64})()
    probation = Probation(cfg, data, torch.device("cpu"))
    assert probation.wait(member, lambda: False, lambda: None) is None

    key = record_key(*member.identity.node)
    member.store.set(key, json.dumps({"step": 7, "factor": 3.0, "micro_batch_s": 0.010}))
    paces = iter([0.030, 0.011, 0.011, 0.020, 0.011, 0.011, 0.011])
    taken = []
    monkeypatch.setattr(Probation, "prober",
                        lambda self: lambda: taken.append(1) or next(paces))
    assert probation.wait(member, lambda: False, lambda: None) is None
    assert len(taken) == 4 + PROBES  # the count began again after 0.020
    assert not member.store.check([key])  # passed: a later restart of the node asks at once
    member.store.set(key, json.dumps({"step": 9, "factor": 3.0, "micro_batch_s": 0.010}))

    monkeypatch.setattr(Probation, "prober", lambda self: lambda: 0.030)
    assert probation.wait(member, lambda: False, lambda: "unadmitted") == "unadmitted"
    assert probation.wait(member, lambda: True, lambda: None) == "left"
    cfg.run.evict_slower_than = 0.0  # off: a kept record is not even read
    assert probation.wait(member, lambda: True, lambda: None) is None


class DutyCycle(threading.Thread):
    """Slows a node's workers from outside, as a throttled machine would be: each period they
    are stopped for its ``1 - 1/factor`` and continued (its workers looked up anew each period:
    a restarted worker is slowed too), until stopped; every one continued at the end."""

    def __init__(self, agent: int, factor: float, period: float = 0.04):
        super().__init__(daemon=True)
        self.agent, self.period, self.off = agent, period, period * (1 - 1 / factor)
        self.done = threading.Event()

    def signal(self, pids: list[int], sig: int) -> None:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def run(self) -> None:
        pids: list[int] = []
        try:
            while not self.done.is_set():
                pids = worker_pids(self.agent)
                self.signal(pids, signal.SIGSTOP)
                time.sleep(self.off)
                self.signal(pids, signal.SIGCONT)
                time.sleep(self.period - self.off)
        finally:
            self.signal(pids, signal.SIGCONT)

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=5)


@pytest.mark.slow
def test_a_node_slowed_3x_is_evicted_in_process_and_comes_back_once_fast(tmp_path):
    """Two nodes of one worker under jobs/node.sh, ``--evict-slower-than 2 --evict-after 2``;
    node 1's worker is stopped two thirds of every 40 ms from step 10. It is named, then evicted
    in process: rank 0 goes on in its own process. Its agent's next worker, slowed again for
    2 s as its probation begins, is held for them; once fast it asks to join and is admitted.
    Then both nodes are stopped (SIGTERM): every sample was used once."""
    env = clean_env(OMP_NUM_THREADS="1",  # node.sh's torchrun: this interpreter's
                    PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    data, shared = tmp_path / "data", tmp_path / "shared"
    subprocess.run([sys.executable, "-m", "elastic_mnist", "synth", "--out", str(data),
                    "--train", "1280", "--test", "256"], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    train_args = ["--dataset", "synthetic", "--data-dir", str(data), "--global-batch-size", "64",
                  "--micro-batch-size", "16", "--epochs", "1000", "--max-steps", "100000",
                  "--checkpoint-dir", str(shared / "ckpt"), "--logdir", str(shared / "runs"),
                  "--run-id", "chaos", "--log-every", "10", "--audit-samples", "--device", "cpu",
                  "--evict-slower-than", "2", "--evict-after", "2"]
    cluster = Cluster(tmp_path, train_args, 2, "external", env)
    run_dir, node1 = shared / "runs" / "chaos", tmp_path / "node1.log"
    observer, slowing = Observer(run_dir), None

    def logs() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in tmp_path.glob("*.log"))

    def wait_for(what: str, predicate, timeout: float = 120, nodes: int | None = 2) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline and nodes in (None, len(cluster.alive())), \
                f"{what}:\n{logs()}"
            time.sleep(0.05)

    def recorded(kind: str) -> list[dict]:
        return [e for e in observer.events() if e["event"] == kind]

    try:
        cluster.start_store()
        cluster.start_node()
        cluster.start_node()
        wait_for("two workers stepping", lambda: observer.step() >= 10)
        (healthy,) = worker_pids(cluster.nodes[0].pid)
        slowing = DutyCycle(cluster.nodes[1].pid, factor=3.0)
        slowing.start()
        wait_for("an eviction", lambda: recorded("evicted"))
        slowing.stop()
        wait_for("the next worker on probation", lambda: "on probation" in node1.read_text())
        slowing = DutyCycle(cluster.nodes[1].pid, factor=3.0)
        slowing.start()
        time.sleep(2)
        slowing.stop()
        wait_for("the node back", lambda: recorded("grow"))
        assert worker_pids(cluster.nodes[0].pid) == [healthy]  # nobody healthy restarted
        back = observer.step()
        wait_for("steps at two", lambda: observer.step() >= back + 10)
        for proc in cluster.nodes.values():
            proc.send_signal(signal.SIGTERM)
        wait_for("the stop", lambda: not cluster.alive(), nodes=None)
    finally:
        if slowing is not None:
            slowing.stop()
        cluster.stop()
    (evicted,) = recorded("evicted")
    assert evicted["ranks"] == [1] and evicted["factor"] >= 2 and evicted["for_s"] >= 2, evicted
    assert any(s["ranks"] == [1] and s["step"] <= evicted["step"] for s in recorded("straggler"))
    (shrink,) = recorded("shrink")
    assert (shrink["why"], shrink["lost_ranks"], shrink["new_world_size"]) == \
        ("evicted", [1], 1), shrink
    (grow,) = recorded("grow")
    assert grow["new_world_size"] == 2 and grow["step"] > shrink["step"]
    assert "evicted at step" in node1.read_text()
    (fast,) = [line for line in node1.read_text().splitlines() if "fast again after" in line]
    probes = int(fast.split("fast again after ")[1].split()[0])
    assert probes > PROBES, fast  # a probe within the 2 s slowed began the count again
    assert len(recorded("start")) == 1  # nobody restarted: rank 0 went on in its own process
    assert recorded("preempted"), logs()
    assert check_audit.main([str(run_dir), "--num-samples", "1280"]) == 0
