"""Several torchrun agents on loopback, each through jobs/node.sh: nodes lost, rejoined, and the
rendezvous store outliving the first node. Driven by the chaos harness (scripts/chaos.py)."""

from __future__ import annotations

import json
import sys

import pytest
from launch import REPO, cli_cmd, run

from elastic_mnist.events import read_events

sys.path.insert(0, str(REPO / "scripts"))
import chaos

pytestmark = pytest.mark.slow


def starts(workdir) -> list[dict]:
    events = read_events(workdir / "shared" / "runs" / "chaos" / "events.jsonl")
    return [e for e in events if e["event"] == "start"]


def test_a_lost_first_node_leaves_the_job_running_and_a_new_one_grows_it_back(tmp_path):
    """The external store outlives node 0, the first one. A join takes about 10 s to turn into
    a new group, hundreds of these tiny steps: it comes early in a long job. The accuracy
    against an uninterrupted run is checked by make chaos and by tests/test_elastic.py."""
    status = chaos.main(["--nodes", "2", "--start-nodes", "2", "--store", "external", "--steps",
                         "300", "--schedule", "10:kill-node:0,20:join", "--no-reference",
                         "--workdir", str(tmp_path), "--json", str(tmp_path / "faults.json")])
    assert status == 0  # finished; every sample once per epoch; valid checkpoints
    worlds = [s["world_size"] for s in starts(tmp_path)]
    assert worlds == [2, 1, 2], worlds
    kill, join = json.loads((tmp_path / "faults.json").read_text())["faults"]
    assert kill["kind"] == "kill-node" and kill["node"] == 0 and kill["first_step_s"], kill
    assert join["kind"] == "join" and join["first_step_s"] is not None, join  # grown, trained


def test_a_port_in_use_for_the_store_is_a_clear_error():
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = run(cli_cmd("rendezvous", "--host", "127.0.0.1", "--port", str(port)),
                   timeout=60)
    assert done.returncode == 2
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("elastic-mnist rendezvous: error:") and str(port) in line


def test_plain_torchrun_loses_the_node_that_does_not_serve_the_store(tmp_path, monkeypatch):
    """The README's multi-node line without TORCH_DISABLE_SHARE_RDZV_TCP_STORE: the agents share
    their store with the workers, the survivor's workers restart on a fresh store of their own."""
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    status = chaos.main(["--nodes", "2", "--start-nodes", "2", "--store", "agent", "--launch",
                         "torchrun", "--nproc-per-node", "2", "--steps", "120", "--schedule",
                         "30:kill-node:1",
                         "--no-reference", "--workdir", str(tmp_path)])
    assert status == 0  # finished; every sample once per epoch; valid checkpoints
    assert [s["world_size"] for s in starts(tmp_path)] == [4, 2]
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in (tmp_path / "node0.log").read_text()
