"""A node's board: its workers' pulses side by side, one speaker writing them into the store."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

from torch.distributed import TCPStore

from elastic_mnist.resilience.agreement import SILENT_PULSES, Pulses
from elastic_mnist.resilience.board import (
    SPEAKER_SILENT,
    NodeBoard,
    board_for,
    parse,
    record_key,
)


def test_the_lowest_live_slot_speaks_and_the_next_takes_over_when_it_stops(tmp_path):
    first, second = (NodeBoard(tmp_path, "node", 3, slot) for slot in (0, 1))
    assert first.node == second.node and first.key == record_key(first.node)
    for _ in range(3):
        assert first.beat() is not None  # the lowest live slot
        assert second.beat() is None
    assert parse(first.beat()) == [4, 3, 0]  # slot 2's worker never started: it stands still
    # Slot 0 freezes: slot 1 sees it move once more, then speaks once it stood still for
    # SPEAKER_SILENT of slot 1's own beats.
    for beats in range(1, SPEAKER_SILENT + 2):
        said = second.beat()
        assert (said is None) == (beats <= SPEAKER_SILENT)
    assert parse(said) == [4, 4 + SPEAKER_SILENT, 0]
    assert first.beat() is not None  # woken, slot 0 speaks again (it sees itself live) ...
    assert second.beat() is None  # ... and slot 1, which sees it move, leaves it to speak
    first.close()
    assert not first.path.exists()
    second.close()


def test_nodes_of_one_name_in_folders_of_their_own_keep_records_of_their_own(tmp_path):
    """Containers whose agents are both pid 1 on hosts of one name: the file's name is the same,
    the nonce of the first worker to make each is not."""
    a, b = NodeBoard(tmp_path / "a", "host-1-launch", 1, 0), NodeBoard(tmp_path / "b",
                                                                      "host-1-launch", 1, 0)
    assert a.key != b.key


def test_an_agents_board_of_an_earlier_launch_is_removed_by_the_next(tmp_path, monkeypatch):
    """torchrun restarts an agent's workers as a new launch, whose board is a new file: the
    last one's (its workers killed, none closed it) goes, a live agent's stays, and the boards
    of agents that have exited go."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    exited = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                            capture_output=True, text=True, check=True)
    gone = int(exited.stdout)  # an agent that has exited
    me, parent = os.getpid(), os.getppid()  # agents alive
    first = board_for("host", me, "launch1", 2, 0)
    other = board_for("host", parent, "launch1", 2, 0)
    dead = NodeBoard(tmp_path / f"elastic-mnist-{os.getuid()}", f"host+{gone}+launch1", 1, 0)
    elsewhere = NodeBoard(dead.path.parent, f"otherhost+{gone}+launch1", 1, 0)
    second = board_for("host", me, "launch2", 2, 1)
    assert second.node != first.node
    assert not first.path.exists() and not dead.path.exists()
    assert second.path.exists() and other.path.exists() and elsewhere.path.exists()


def beat_until_stopped(folder, slot: int) -> None:
    board = NodeBoard(folder, "node", 2, slot)
    store = TCPStore("127.0.0.1", int(os.environ["BOARD_PORT"]), is_master=False)
    while True:
        record = board.beat()
        if record is not None:
            store.set(board.key, record)
        time.sleep(0.1)


def test_a_frozen_worker_is_silent_in_its_nodes_record_and_its_sibling_speaks_for_the_node(
        tmp_path, monkeypatch):
    """Two real processes on one board: SIGSTOP the speaker (slot 0). Its sibling takes over the
    node's record within SPEAKER_SILENT beats, in which slot 0 stands still: a reader finds slot
    0 silent, slot 1 alive."""
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=30))
    monkeypatch.setenv("BOARD_PORT", str(server.port))
    workers = [mp.get_context("spawn").Process(target=beat_until_stopped, args=(tmp_path, s))
               for s in (0, 1)]
    for worker in workers:
        worker.start()
    try:
        key = NodeBoard(tmp_path, "node", 2, 1).key
        server.wait([key], timedelta(seconds=30))
        reader = NodeBoard(tmp_path / "reader", "reader", 1, 0)  # the reader's own pulse
        server.set(reader.key, reader.record([0]))
        pulses = Pulses(server, {0: (key, 0), 1: (key, 1)}, (reader.key, 0))
        os.kill(workers[0].pid, signal.SIGSTOP)
        silent, deadline = set(), time.monotonic() + 30
        for own in range(1, 10 * SILENT_PULSES):
            server.set(reader.key, str(own))
            silent = pulses.silent()
            if silent or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert silent == {0}
        assert parse(server.get(key))[1] > parse(server.get(key))[0]
    finally:
        for worker in workers:
            os.kill(worker.pid, signal.SIGKILL)
            worker.join()
