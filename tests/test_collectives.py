"""Tests for ``elastic_mnist.collectives``: the tutorial primitives, run under torchrun."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest
from launch import LAUNCHER_VARS, REPO, clean_env

from elastic_mnist import collectives

TIMEOUT_S = 120
LAUNCH = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
MODULE = ["-m", "elastic_mnist.collectives"]
NAMES = list(collectives.DEMOS)
# main() is wrapped by torch's @record, which cannot enable faulthandler under pytest's capture.
quiet_record = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")

def _run(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Runs ``cmd`` in its own session; on timeout kills the whole group (torchrun + workers)."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=clean_env() if env is None else env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{cmd} timed out after {TIMEOUT_S}s\n{out}\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _torchrun(nproc: int, *args: str) -> tuple[int, str]:
    """Launches the module under torchrun; returns (exit status, stdout + stderr)."""
    done = _run([*LAUNCH, f"--nproc_per_node={nproc}", *MODULE, *args])
    return done.returncode, done.stdout + done.stderr


def _holds(output: str, rank: int, name: str) -> str:
    """What ``rank`` logged it holds after primitive ``name``."""
    pattern = rf"^\[rank {rank}\] {name}: holds (\[.*?\]) \(expected"
    match = re.search(pattern, output, re.MULTILINE)
    assert match, f"rank {rank} logged no result for {name}:\n{output}"
    return match.group(1)


@pytest.mark.slow
def test_two_ranks_skip_the_exchange_and_pass():
    rc, out = _torchrun(2)
    assert rc == 0, out
    assert "exchange: skipped (needs >= 3 ranks, world size is 2)" in out, out
    assert _holds(out, 1, "isend_irecv") == "[2.0]"
    assert _holds(out, 0, "reduce") == "[3.0]"
    assert "all 5 checks passed on all 2 ranks" in out, out


@pytest.mark.slow
def test_one_injected_fault_fails_only_that_primitive():
    """Three ranks, all_reduce spoiled on the last rank only: the others must still learn of it
    and fail; every other primitive holds what it should on every rank (a clean run's exit 0 and
    summary line: test_two_ranks_skip_the_exchange_and_pass)."""
    rc, out = _torchrun(3, "--inject-fault", "all_reduce")
    assert rc != 0, out
    assert "[rank 2] all_reduce: holds [106.0] (expected [6.0]) FAILED" in out, out
    assert "CHECK FAILED: all_reduce gave a wrong result on 1 of 3 ranks" in out, out
    assert set(re.findall(r"CHECK FAILED: (\w+)", out)) == {"all_reduce"}, out
    assert "checks passed" not in out, out
    for rank in range(3):
        assert f"[rank {rank}] joined: rank {rank}/3" in out, out
        for name in NAMES:
            assert re.search(rf"^\[rank {rank}\] {name}: ", out, re.MULTILINE), (rank, out)
    assert _holds(out, 1, "send_recv") == "[1.0]"
    assert _holds(out, 2, "isend_irecv") == "[2.0]"
    assert _holds(out, 0, "exchange") == "[18.0]"  # (10 - 1) back from ranks 1 and 2
    assert _holds(out, 1, "exchange") == _holds(out, 2, "exchange") == "[9.0]"
    assert _holds(out, 0, "gather") == "[1.0, 2.0, 3.0]"
    assert _holds(out, 0, "reduce") == "[6.0]"
    assert _holds(out, 0, "all_reduce") == _holds(out, 1, "all_reduce") == "[6.0]"


@pytest.mark.slow
def test_every_injected_fault_is_caught():
    faults = [arg for name in NAMES for arg in ("--inject-fault", name)]
    rc, out = _torchrun(3, *faults)
    assert rc != 0, out
    assert set(re.findall(r"CHECK FAILED: (\w+)", out)) == set(NAMES), out
    assert "checks passed" not in out, out


@pytest.mark.slow
def test_without_torchrun_exits_2():
    done = _run([sys.executable, *MODULE])
    assert done.returncode == 2, done
    message = done.stderr.strip()
    assert "\n" not in message, message
    assert "torchrun" in message and "--nproc_per_node=3" in message, message


@quiet_record
def test_bad_torchrun_environment_exits_2(monkeypatch, capsys):
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")  # WORLD_SIZE missing
    assert collectives.main([]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "bad torchrun environment" in err and "WORLD_SIZE" in err, err


@quiet_record
def test_world_size_one_exits_2(monkeypatch, capsys):
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert collectives.main([]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--nproc_per_node=3" in err, err


@quiet_record
def test_unknown_fault_name_is_rejected(capsys):
    with pytest.raises(SystemExit) as exc:
        collectives.main(["--inject-fault", "no_such_primitive"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
