"""The launch specs in jobs/ as data, and the rendezvous store that runs outside every node.

node.sh is run for real (DRY_RUN=1 prints the torchrun command it would exec; a fake launcher
records what it really execs), the SLURM script runs with stand-ins for srun and scontrol, and the
PyTorchJob is validated against the training operator's own CRD, strictly, where that is at hand.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from launch import REPO, clean_env, kill_tree

from elastic_mnist.cli import build_parser
from elastic_mnist.errors import RendezvousError
from elastic_mnist.rendezvous import DEFAULT_PORT, add_arguments, agents_line, serve

JOBS = REPO / "jobs"
NODE_SH = JOBS / "node.sh"
SBATCH = JOBS / "slurm.sbatch"
SBATCH_JOIN = JOBS / "slurm_join.sbatch"
MANIFEST = JOBS / "kubernetes" / "pytorchjob.yaml"
CRD = Path(__file__).resolve().parents[2] / "shared" / "k8s" / "kubeflow.org_pytorchjobs.yaml"

LAUNCHER = [sys.executable, "-m", "torch.distributed.run"]
TRAIN = ["-m", "elastic_mnist", "train"]
NODE_VARS = ("NNODES", "NPROC_PER_NODE", "RDZV_ENDPOINT", "RUN_ID", "MAX_RESTARTS", "RDZV_STORE",
             "RDZV_IS_HOST", "MONITOR_INTERVAL", "LAST_CALL_TIMEOUT", "KEEP_ALIVE_INTERVAL",
             "KEEP_ALIVE_MAX_ATTEMPT", "JOIN_TIMEOUT", "TORCHRUN", "DRY_RUN")
# The rendezvous timing measured to make recovery fast (node.sh's defaults).
MEASURED_CONF = {"join_timeout": "600", "last_call_timeout": "2", "keep_alive_interval": "1",
                 "keep_alive_max_attempt": "3"}

# Stands in for torchrun: records its arguments and environment in $FAKE_TORCHRUN_OUT, then exits
# with $FAKE_TORCHRUN_EXIT, or with "wait" waits for SIGTERM and exits 1 as torchrun does after
# passing it on to its workers.
FAKE_TORCHRUN = """\
import json, os, signal, sys, time

out = os.environ["FAKE_TORCHRUN_OUT"]
record = {"argv": sys.argv[1:], "env": dict(os.environ), "signal": None}

def save():
    with open(out + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(out + ".tmp", out)

def stop(signum, frame):
    record["signal"] = signal.Signals(signum).name
    save()
    sys.exit(1)

signal.signal(signal.SIGTERM, stop)
save()
mode = os.environ.get("FAKE_TORCHRUN_EXIT", "0")
if mode == "wait":
    time.sleep(60)
sys.exit(int(mode) if mode != "wait" else 3)
"""


# ---------------------------------------------------------------------------------------------
# jobs/node.sh


def node_env(**extra: str) -> dict[str, str]:
    """The test's environment without node.sh's variables, the launcher set to this Python's."""
    env = {k: v for k, v in clean_env().items() if k not in NODE_VARS}
    env.update(TORCHRUN=" ".join(LAUNCHER), NPROC_PER_NODE="2")
    env.update(extra)
    return env


def dry_run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(NODE_SH), *args], env=node_env(DRY_RUN="1", **env),
                          capture_output=True, text=True, timeout=30, check=False)


def launch_of(argv: list[str], launcher: list[str] = LAUNCHER) -> tuple[dict[str, str], list[str]]:
    """torchrun's --name=value options as a dict, and the arguments given to `train`."""
    assert argv[:len(launcher)] == launcher, argv
    rest = argv[len(launcher):]
    cut = next(i for i in range(len(rest)) if rest[i:i + 3] == TRAIN)
    options = {}
    for option in rest[:cut]:
        name, sep, value = option.partition("=")
        assert option.startswith("--") and sep, f"not --name=value: {option!r}"
        assert name not in options, f"{name} given twice"
        options[name[2:]] = value
    return options, rest[cut + 3:]


def conf_of(options: dict[str, str]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in options["rdzv_conf"].split(","))


def planned(*args: str, **env: str) -> tuple[dict[str, str], list[str]]:
    done = dry_run(*args, **env)
    assert done.returncode == 0, done.stderr
    return launch_of(done.stdout.splitlines())


def test_node_sh_multi_node_command():
    options, train = planned("--epochs", "2", "--checkpoint-dir", "/shared/a dir",
                             NNODES="2:4", RDZV_ENDPOINT="head:29400", RUN_ID="job7",
                             NPROC_PER_NODE="3", MAX_RESTARTS="5")
    assert options == {"nnodes": "2:4", "nproc_per_node": "3", "rdzv_backend": "elastic-mnist",
                       "rdzv_endpoint": "head:29400", "rdzv_id": "job7",
                       "rdzv_conf": options["rdzv_conf"], "max_restarts": "5",
                       "monitor_interval": "0.5"}
    assert conf_of(options) == MEASURED_CONF  # torchrun decides who hosts the store
    assert train == ["--epochs", "2", "--checkpoint-dir", "/shared/a dir"]


def test_node_sh_single_node_defaults():
    options, train = planned()
    assert options["nnodes"] == "1"
    assert options["rdzv_endpoint"] == "localhost:0"  # like --standalone: a port the OS picks
    assert uuid.UUID(options["rdzv_id"]).version == 4  # as --standalone: a job of its own
    assert planned()[0]["rdzv_id"] != options["rdzv_id"]
    # Several nodes: named after the store they share, alike on every node, another elsewhere.
    assert planned(NNODES="2", RDZV_ENDPOINT="h:1")[0]["rdzv_id"] == "elastic-mnist-h-1"
    assert planned(NNODES="2", RDZV_ENDPOINT="h.x:2")[0]["rdzv_id"] == "elastic-mnist-h-x-2"
    assert planned(NNODES="2", RDZV_ENDPOINT="h")[0]["rdzv_id"] == "elastic-mnist-h-29902"
    assert options["max_restarts"] == "3"
    assert options["monitor_interval"] == "0.5"
    assert conf_of(options) == MEASURED_CONF
    assert train == []


@pytest.mark.parametrize(("env", "is_host"), [
    ({"RDZV_STORE": "external"}, "false"),
    ({"RDZV_STORE": "external", "RDZV_IS_HOST": "auto"}, "false"),
    ({"RDZV_STORE": "agent", "RDZV_IS_HOST": "false"}, "false"),
    ({"RDZV_IS_HOST": "true"}, "true"),
])
def test_node_sh_who_hosts_the_store(env, is_host):
    options, _ = planned(NNODES="1:2", RDZV_ENDPOINT="127.0.0.1:29400", **env)
    assert conf_of(options) == {**MEASURED_CONF, "is_host": is_host}


def test_node_sh_derives_a_port_of_the_job_when_the_endpoint_names_a_host_alone():
    ports = {}
    for run_id in ("4242", "5242", "4243", "job-a", "job-b"):
        options, _ = planned(NNODES="2:4", RDZV_ENDPOINT="head", RUN_ID=run_id)
        host, port = options["rdzv_endpoint"].split(":")
        assert host == "head" and 29400 <= int(port) < 30400
        assert planned(NNODES="2:4", RDZV_ENDPOINT="head", RUN_ID=run_id)[0] == options  # alike
        ports[run_id] = int(port)
    assert ports["4242"] == ports["5242"] == 29642 and ports["4243"] == 29643
    assert ports["job-a"] != ports["job-b"]
    assert planned(NNODES="2", RDZV_ENDPOINT="head:1234")[0]["rdzv_endpoint"] == "head:1234"


def test_node_sh_timing_overrides():
    options, _ = planned(MONITOR_INTERVAL="1", JOIN_TIMEOUT="60", LAST_CALL_TIMEOUT="5",
                         KEEP_ALIVE_INTERVAL="2", KEEP_ALIVE_MAX_ATTEMPT="4")
    assert options["monitor_interval"] == "1"
    assert conf_of(options) == {"join_timeout": "60", "last_call_timeout": "5",
                                "keep_alive_interval": "2", "keep_alive_max_attempt": "4"}


@pytest.mark.parametrize(("env", "named"), [
    ({"NNODES": "2:4"}, "RDZV_ENDPOINT"),
    ({"RDZV_STORE": "external"}, "RDZV_ENDPOINT"),
    ({"RDZV_ENDPOINT": "h:1", "RDZV_STORE": "etcd"}, "RDZV_STORE"),
    ({"RDZV_ENDPOINT": "h:1", "RDZV_STORE": "external", "RDZV_IS_HOST": "true"}, "RDZV_IS_HOST"),
    ({"RDZV_ENDPOINT": "h:1", "RDZV_STORE": "external", "RDZV_IS_HOST": "yes"}, "RDZV_IS_HOST"),
    ({"RDZV_IS_HOST": "yes"}, "RDZV_IS_HOST"),
])
def test_node_sh_refuses_contradictions_in_one_line(env, named):
    done = dry_run(**env)
    assert done.returncode == 2
    assert done.stdout == ""
    assert len(done.stderr.splitlines()) == 1 and named in done.stderr, done.stderr


def test_node_sh_execs_the_launcher_with_its_environment(tmp_path):
    """Not a dry run: what the launcher receives, and the environment node.sh exports for it."""
    fake = tmp_path / "fake_torchrun.py"
    fake.write_text(FAKE_TORCHRUN)
    store = socket.create_server(("127.0.0.1", 0))  # what node.sh waits for before launching
    env = node_env(TORCHRUN=f"{sys.executable} {fake}", FAKE_TORCHRUN_OUT=str(tmp_path / "rec"),
                   NNODES="1:2", RDZV_ENDPOINT=f"127.0.0.1:{store.getsockname()[1]}",
                   RDZV_STORE="external",
                   # No GPU, and `python` is one with torch: node.sh counts the GPUs itself.
                   CUDA_VISIBLE_DEVICES="",
                   PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    for computed in ("NPROC_PER_NODE", "OMP_NUM_THREADS", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"):
        env.pop(computed, None)
    with store:
        done = subprocess.run(["bash", str(NODE_SH), "--max-steps", "1"], env=env, timeout=60,
                              capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "rec").read_text())
    options, train = launch_of(record["argv"], launcher=[])
    assert options["nproc_per_node"] == "2"  # no GPU: 2 CPU workers
    assert conf_of(options)["is_host"] == "false"
    assert train == ["--max-steps", "1"]
    assert record["env"]["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert record["env"]["OMP_NUM_THREADS"] == str(max(1, len(os.sched_getaffinity(0)) // 2))


@pytest.mark.parametrize("backend", ["elastic-mnist", "c10d"])
def test_node_sh_says_when_no_store_answers_within_the_join_timeout(backend):
    """Under our rendezvous the agent itself waits for the store (torchrun starts at once, so
    nodes that start together arrive together); under c10d node.sh waits before torchrun. Either
    way: one line once JOIN_TIMEOUT has passed, exit 2."""
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
    env = node_env(NNODES="1:2", RDZV_ENDPOINT=f"127.0.0.1:{port}", RDZV_IS_HOST="false",
                   JOIN_TIMEOUT="2", NPROC_PER_NODE="1", OMP_NUM_THREADS="1",
                   RDZV_BACKEND=backend)
    start = time.monotonic()
    done = subprocess.run(["bash", str(NODE_SH)], env=env, timeout=60, capture_output=True,
                          text=True, check=False)
    assert done.returncode == 2 and time.monotonic() - start < 20
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert f"no rendezvous store answers at 127.0.0.1:{port} after 2 s" in done.stderr
    said_by = {"elastic-mnist": "torchrun: error: ", "c10d": "jobs/node.sh: "}[backend]
    assert done.stderr.startswith(said_by), done.stderr


def test_node_sh_falls_back_to_python_module():
    path = "/usr/bin:/bin"
    if shutil.which("torchrun", path=path):
        pytest.skip(f"torchrun is on {path}")
    env = node_env(PATH=path)
    del env["TORCHRUN"]
    done = subprocess.run(["bash", str(NODE_SH)], env={**env, "DRY_RUN": "1"}, timeout=30,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    launch_of(done.stdout.splitlines(), launcher=["python", "-m", "torch.distributed.run"])


# Stands in for torchrun under jobs/local.sh: one worker in a session of its own (as torchrun
# starts them) that exits 0 on SIGINT; records the signals the agent itself got, the worker's
# status and its own arguments in $FAKE_TORCHRUN_OUT, and exits with the worker's status.
FAKE_AGENT = """\
import json, os, signal, subprocess, sys

got = []
for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda signum, frame: got.append(signal.Signals(signum).name))
worker = subprocess.Popen([sys.executable, "-c", os.environ["FAKE_WORKER"]],
                          start_new_session=True)
status = worker.wait()
with open(os.environ["FAKE_TORCHRUN_OUT"], "w") as f:
    json.dump({"agent_signals": got, "worker_status": status, "argv": sys.argv[1:]}, f)
sys.exit(status)
"""
FAKE_WORKER = """\
import os, signal, sys, time
signal.signal(signal.SIGINT, lambda signum, frame: sys.exit(0))
open(os.environ["FAKE_READY"], "w").close()
time.sleep(60)
sys.exit(3)
"""


@pytest.mark.parametrize(("interrupt_status", "expected"), [(None, 130), ("0", 0)])
def test_local_sh_answers_ctrl_c_through_the_workers_not_torchrun(tmp_path, interrupt_status,
                                                                 expected):
    """A terminal's SIGINT to the process group reaches jobs/local.sh, which asks the workers to
    stop; torchrun, in a process group of its own, gets nothing (its own answer would be a
    traceback). The script then ends with INTERRUPT_STATUS (130; make train gives 0)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text(f"#!{sys.executable}\n{FAKE_AGENT}")
    (bin_dir / "torchrun").chmod(0o755)
    env = node_env(PATH=f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin",
                   FAKE_TORCHRUN_OUT=str(tmp_path / "rec"), FAKE_WORKER=FAKE_WORKER,
                   FAKE_READY=str(tmp_path / "ready"))
    if interrupt_status is not None:
        env["INTERRUPT_STATUS"] = interrupt_status
    proc = subprocess.Popen(["bash", str(JOBS / "local.sh"), "--epochs", "3"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "ready").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        out, _ = proc.communicate(timeout=30)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == expected, out
    record = json.loads((tmp_path / "rec").read_text())
    assert record["agent_signals"] == [] and record["worker_status"] == 0, record
    train = record["argv"][record["argv"].index("train") + 1:]
    assert train == ["--resume-command", f"{JOBS / 'local.sh'} --epochs 3", "--epochs", "3"]


@pytest.mark.parametrize("script", sorted([*JOBS.glob("*.sh"), *JOBS.glob("*.sbatch")]),
                         ids=lambda p: p.name)
def test_shell_scripts_parse(script):
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr


# ---------------------------------------------------------------------------------------------
# jobs/slurm.sbatch


def sbatch_directives(script: Path = SBATCH) -> list[str]:
    """The options of the #SBATCH lines that SLURM reads: those before the first command."""
    directives = []
    for line in script.read_text().splitlines()[1:]:
        if line.startswith("#SBATCH"):
            directives += line.split()[1:]
        elif line.strip() and not line.startswith("#"):
            break
    return directives


@pytest.mark.parametrize(("script", "expected"), [
    (SBATCH, ("--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8", "--signal=B:TERM@120",
              "--requeue", "--no-kill", "--open-mode=append")),
    (SBATCH_JOIN, ("--nodes=1", "--ntasks-per-node=1", "--gpus-per-node=8", "--open-mode=append")),
], ids=lambda x: getattr(x, "name", None))
def test_sbatch_asks_for_nodes_of_eight_gpus(script, expected):
    """The job: 4 nodes, a warning before the time limit, kept when a node fails (--no-kill);
    a joiner: one node of the same shape."""
    directives = sbatch_directives(script)
    for option in expected:
        assert option in directives, directives
    assert len({d.split("=")[0] for d in directives}) == len(directives), "an option twice"
    assert script.read_text().count("#SBATCH") == len(directives), "an #SBATCH after a command"


FAKE_SRUN = """\
#!/usr/bin/env bash
# srun on one node: runs the task, and like the real srun answers SIGTERM with SIGKILL to it.
# Its own options go to $FAKE_SRUN_OPTIONS, one a line.
while [[ $1 == -* ]]; do echo "$1" >> "$FAKE_SRUN_OPTIONS"; shift; done
"$@" &
task=$!
echo "$task" > "$FAKE_SLURM_TASKS"
trap 'kill -KILL "$task"' TERM
while :; do
  wait "$task"
  status=$?
  kill -0 "$task" 2> /dev/null || exit "$status"
done
"""
FAKE_SCANCEL = """\
#!/usr/bin/env bash
# scancel --signal=SIG JOBID: the signal reaches the tasks of the job's steps, not the batch shell;
# scancel --batch ... (another job, a joiner): recorded only.
echo "scancel $*" >> "$FAKE_SLURM_LOG"
[[ $1 == --batch ]] || kill -s "${1#--signal=}" "$(cat "$FAKE_SLURM_TASKS")"
"""
FAKE_SQUEUE = """\
#!/usr/bin/env bash
# squeue -h -j JOBID -o %T: the state given in $FAKE_SQUEUE_STATE (RUNNING by default).
echo "${FAKE_SQUEUE_STATE:-RUNNING}"
"""
FAKE_SCONTROL = """\
#!/usr/bin/env bash
if [[ "$1 $2" == "show hostnames" ]]; then
  printf "node-a\\nnode-b\\nnode-c\\nnode-d\\n"
else
  echo "scontrol $*" >> "$FAKE_SLURM_LOG"
fi
"""


@pytest.fixture
def slurm(tmp_path):
    """Runs jobs/slurm.sbatch as SLURM would, on one node: srun, scancel and scontrol faked."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, text in (("srun", FAKE_SRUN), ("scancel", FAKE_SCANCEL),
                       ("scontrol", FAKE_SCONTROL), ("squeue", FAKE_SQUEUE)):
        (bin_dir / tool).write_text(text)
        (bin_dir / tool).chmod(0o755)
    fake = tmp_path / "fake_torchrun.py"
    fake.write_text(FAKE_TORCHRUN)

    def start(launcher_exit: str, job_id: str = "42", script: Path = SBATCH,
              args: tuple[str, ...] = ("--epochs", "3"), **extra: str) -> subprocess.Popen:
        env = node_env(**{"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                          "TORCHRUN": f"{sys.executable} {fake}", "NPROC_PER_NODE": "8",
                          "FAKE_TORCHRUN_OUT": str(tmp_path / "rec"),
                          "FAKE_TORCHRUN_EXIT": launcher_exit,
                          "FAKE_SLURM_LOG": str(tmp_path / "slurm.log"),
                          "FAKE_SLURM_TASKS": str(tmp_path / "tasks"),
                          "FAKE_SRUN_OPTIONS": str(tmp_path / "srun"),
                          "SHARED": str(tmp_path / "shared"), "SLURM_JOB_ID": job_id,
                          "SLURM_JOB_NODELIST": "node-[a-d]", "SLURM_JOB_NUM_NODES": "4",
                          "SLURM_SUBMIT_DIR": str(REPO),
                          "RDZV_PRECHECK": "0",  # there is no node-a to answer
                          **extra})
        return subprocess.Popen(["bash", str(script), *args], cwd=tmp_path, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    return start


def launched(tmp_path: Path, proc: subprocess.Popen, timeout: float = 20) -> dict:
    """What the fake torchrun recorded, once it has started."""
    rec = tmp_path / "rec"
    deadline = time.monotonic() + timeout
    while not rec.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_tree(proc.pid)
            pytest.fail(f"the launcher never started:\n{proc.communicate()[0]}")
        time.sleep(0.05)
    return json.loads(rec.read_text())


def slurm_calls(tmp_path: Path) -> list[str]:
    """The scancel and scontrol commands the script ran (`show hostnames` aside)."""
    log = tmp_path / "slurm.log"
    return log.read_text().splitlines() if log.exists() else []


def test_sbatch_launches_every_node_alike_and_elastic(slurm, tmp_path):
    """Every node the same torchrun line, elastic from 1 node to the allocation's 4; srun keeps
    the healthy nodes' tasks when a node fails or an agent gives up."""
    proc = slurm("0")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    options, train = launch_of(launched(tmp_path, proc)["argv"], launcher=[])
    assert options["nnodes"] == "1:4"
    assert options["rdzv_endpoint"] == "node-a:29442"  # 29400 + the job id (mod 1000)
    assert "job 42: rendezvous at node-a:29442 (store: agent), 1:4 nodes" in out
    assert options["rdzv_id"] == "42"
    assert "is_host" not in conf_of(options)  # the agent on node-a serves the store
    shared = tmp_path / "shared"
    assert train == ["--data-dir", f"{shared}/data", "--checkpoint-dir", f"{shared}/checkpoints",
                     "--logdir", f"{shared}/runs", "--epochs", "3"]
    assert (shared / "checkpoints").is_dir()
    assert slurm_calls(tmp_path) == []
    srun = (tmp_path / "srun").read_text().split()
    assert {"--no-kill", "--kill-on-bad-exit=0", "--wait=0"} <= set(srun), srun


def test_sbatch_minimum_of_nodes(slurm, tmp_path):
    proc = slurm("0", MIN_NODES="3")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert launch_of(launched(tmp_path, proc)["argv"], launcher=[])[0]["nnodes"] == "3:4"


@pytest.mark.parametrize(("env", "named"), [
    ({"MIN_NODES": "5"}, "MIN_NODES"), ({"MIN_NODES": "0"}, "MIN_NODES"),
    ({"MIN_NODES": "two"}, "MIN_NODES"), ({"RDZV_STORE": "external"}, "RDZV_ENDPOINT"),
])
def test_sbatch_refuses_what_cannot_run_in_one_line(slurm, tmp_path, env, named):
    proc = slurm("0", **env)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2, out
    assert len(out.splitlines()) == 1 and out.startswith("jobs/slurm.sbatch: "), out
    assert named in out
    assert not (tmp_path / "rec").exists()


@pytest.mark.parametrize("store", ["external", "agent"])
def test_sbatch_honours_the_endpoint_it_is_given(slurm, tmp_path, store):
    """RDZV_ENDPOINT as the user gives it: an `elastic-mnist rendezvous` outside the job (no
    agent serves a store), or another node's agent."""
    proc = slurm("0", RDZV_STORE=store, RDZV_ENDPOINT="store.internal:29400")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    options, _ = launch_of(launched(tmp_path, proc)["argv"], launcher=[])
    assert options["rdzv_endpoint"] == "store.internal:29400"
    assert options["nnodes"] == "1:4"
    assert conf_of(options).get("is_host") == ("false" if store == "external" else None)
    assert f"rendezvous at store.internal:29400 (store: {store})" in out


@pytest.mark.parametrize(("env", "endpoint"), [
    ({}, "node-a:29442"),
    ({"RDZV_STORE": "external", "RDZV_ENDPOINT": "store.internal:29400"}, "store.internal:29400"),
], ids=["agent", "external"])
def test_a_node_joins_the_running_job_from_the_shared_folder(slurm, tmp_path, env, endpoint):
    """jobs/slurm_join.sbatch JOBID, in a one-node job of its own: the job's rendezvous, sizes,
    node.sh variables and training arguments, as the job wrote them into the shared folder; it
    never serves the store."""
    proc = slurm("wait", MAX_RESTARTS="5", **env)  # the job runs while the node joins
    try:
        job_options, job_train = launch_of(launched(tmp_path, proc)["argv"], launcher=[])
        (tmp_path / "rec").unlink()
        joiner = slurm("0", job_id="77", script=SBATCH_JOIN, args=("42",),
                       SLURM_JOB_NUM_NODES="1", SLURM_JOB_NODELIST="node-e", NPROC_PER_NODE="",
                       MAX_RESTARTS="")
        out, _ = joiner.communicate(timeout=30)
    finally:
        kill_tree(proc.pid)
    assert joiner.returncode == 0, out
    assert f"job 77: joining job 42 at {endpoint}" in out
    record = launched(tmp_path, joiner)
    options, train = launch_of(record["argv"], launcher=[])
    assert train == job_train
    assert options["rdzv_endpoint"] == endpoint and options["rdzv_id"] == "42"
    assert {**options, "rdzv_conf": ""} == {**job_options, "rdzv_conf": ""}  # 1:4, 8, 5, ...
    assert conf_of(options) == {**MEASURED_CONF, "is_host": "false"}


@pytest.mark.parametrize("args", [(), ("x",), ("43",), ("42", "--epochs", "9")])
def test_a_joiner_without_a_job_to_join_says_so_in_one_line(slurm, tmp_path, args):
    proc = slurm("0", script=SBATCH_JOIN, args=args)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2, out
    assert len(out.splitlines()) == 1 and out.startswith("jobs/slurm_join.sbatch: "), out


def test_a_job_that_ended_leaves_nothing_to_join_and_a_pending_one_is_not_joined(slurm,
                                                                                 tmp_path):
    """The job's end removes what it wrote for joiners; a job waiting in the queue (requeued)
    has an endpoint no longer: its joiner says so in one line, not after JOIN_TIMEOUT."""
    proc = slurm("0")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert not list((tmp_path / "shared" / "jobs").iterdir())
    (tmp_path / "shared" / "jobs" / "42.env").write_text("RUN_ID=42\n")  # a requeued job's
    (tmp_path / "shared" / "jobs" / "42.args").write_text("")
    joiner = slurm("0", job_id="77", script=SBATCH_JOIN, args=("42",), FAKE_SQUEUE_STATE="PENDING")
    out, _ = joiner.communicate(timeout=30)
    assert joiner.returncode == 2, out
    assert out == ("jobs/slurm_join.sbatch: job 42 is not running (PENDING): nothing to join; its "
                   "next start asks for every node again\n")


def test_a_stop_reaches_the_nodes_that_joined(slurm, tmp_path):
    """SIGTERM before the time limit: the job's steps and every joiner's batch shell (its
    torchrun) are told, so that every rank stops at one agreed step with a checkpoint."""
    proc = slurm("wait")
    try:
        launched(tmp_path, proc)
        (tmp_path / "rec").unlink()
        joiner = slurm("0", job_id="77", script=SBATCH_JOIN, args=("42",),
                       SLURM_JOB_NUM_NODES="1", SLURM_JOB_NODELIST="node-e")
        assert joiner.wait(timeout=30) == 0, joiner.communicate()[0]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        kill_tree(proc.pid)
    assert slurm_calls(tmp_path) == ["scancel --signal=TERM 42", "scancel --batch --signal=TERM 77",
                                     "scontrol requeue 42"], out


def test_a_job_that_trained_to_the_end_after_losing_a_node_ends_well(slurm, tmp_path):
    """srun's status is an error where a node's task was lost on the way; the run's own record
    says that training finished, and the job ends 0 (dependencies on it, afterok, go on)."""
    run_dir = tmp_path / "shared" / "runs" / "42"
    run_dir.mkdir(parents=True)
    (run_dir / "events.jsonl").write_text('{"event": "start", "step": 0}\n'
                                          '{"event": "finish", "step": 300}\n')
    proc = slurm("1")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "job 42: training finished; a node's task ended with an error on the way" in out


def test_sbatch_gives_jobs_that_share_a_first_node_their_own_rendezvous_ports(slurm, tmp_path):
    """Two jobs whose first nodes are this machine: ports derived from their ids, and one that is
    taken here (by another job's store, say) is passed over."""
    endpoints = []
    with socket.create_server(("0.0.0.0", 29400 + 1043 % 1000)):  # taken: 29443
        for job_id in ("1042", "1043"):
            (tmp_path / "rec").unlink(missing_ok=True)
            proc = slurm("0", job_id=job_id)
            out, _ = proc.communicate(timeout=30)
            assert proc.returncode == 0, out
            endpoints.append(launch_of(launched(tmp_path, proc)["argv"], launcher=[])[0]
                             ["rdzv_endpoint"])
    assert endpoints == ["node-a:29442", "node-a:29444"]


def test_sbatch_stops_the_workers_gracefully_and_requeues(slurm, tmp_path):
    proc = slurm("wait")
    try:
        launched(tmp_path, proc)
        proc.send_signal(signal.SIGTERM)  # what --signal=B:TERM@120 sends
        out, _ = proc.communicate(timeout=30)
    finally:
        kill_tree(proc.pid)
    # torchrun got SIGTERM (not srun's SIGKILL), and the job went back into the queue.
    assert json.loads((tmp_path / "rec").read_text())["signal"] == "SIGTERM", out
    assert slurm_calls(tmp_path) == ["scancel --signal=TERM 42", "scontrol requeue 42"], out
    assert proc.returncode == 1  # the step's status


def test_sbatch_does_not_requeue_a_failure(slurm, tmp_path):
    proc = slurm("1")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 1, out
    assert slurm_calls(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# jobs/kubernetes/pytorchjob.yaml


def manifests() -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(MANIFEST.read_text())}


def pytorch_container(job: dict) -> dict:
    containers = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "pytorch")


def test_pytorchjob_is_elastic_with_a_shared_volume():
    docs = manifests()
    assert sorted(docs) == ["Deployment", "PersistentVolumeClaim", "PyTorchJob", "Service"]
    job = docs["PyTorchJob"]
    assert job["apiVersion"] == "kubeflow.org/v1"
    policy = job["spec"]["elasticPolicy"]
    assert {k: policy[k] for k in ("minReplicas", "maxReplicas", "rdzvBackend", "maxRestarts")} \
        == {"minReplicas": 1, "maxReplicas": 4, "rdzvBackend": "elastic-mnist", "maxRestarts": 3}
    assert {c["key"]: c["value"] for c in policy["rdzvConf"]} == {**MEASURED_CONF,
                                                                  "is_host": "false"}
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert policy["minReplicas"] <= worker["replicas"] <= policy["maxReplicas"]
    assert worker["restartPolicy"] == "OnFailure"
    # torchrun gives SIGTERM's checkpoint 30 s before it kills the workers: the pod must wait.
    assert worker["template"]["spec"]["terminationGracePeriodSeconds"] > 30

    container = pytorch_container(job)
    options, train = launch_of(container["command"] + container["args"],
                               launcher=["python", "-m", "torch.distributed.run"])
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    assert int(options["nproc_per_node"]) == int(job["spec"]["nprocPerNode"]) == gpus
    assert options["monitor_interval"] == "0.5"
    assert train == ["--data-dir", "/shared/data", "--checkpoint-dir", "/shared/ckpt",
                     "--logdir", "/shared/runs"]
    assert {"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"} in container["env"]

    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in worker["template"]["spec"]["volumes"]}
    shared = next(name for name, path in mounts.items() if path == "/shared")
    claim = docs["PersistentVolumeClaim"]
    assert volumes[shared]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


def test_pytorchjob_matches_node_sh():
    """The manifest and node.sh (with the store outside every node) launch with the same
    measured rendezvous settings."""
    options, _ = planned(NNODES="1:4", RDZV_ENDPOINT="h:29400", RDZV_STORE="external")
    policy = manifests()["PyTorchJob"]["spec"]["elasticPolicy"]
    assert {c["key"]: c["value"] for c in policy["rdzvConf"]} == conf_of(options)
    container_options, _ = launch_of(pytorch_container(manifests()["PyTorchJob"])["command"],
                                     launcher=["python", "-m", "torch.distributed.run"])
    assert container_options["monitor_interval"] == options["monitor_interval"]


def operator_env(job: dict) -> dict[str, str]:
    """The PET_* variables the training operator v1.9 gives each worker pod of ``job``, as its
    pkg/controller.v1/pytorch/elastic.go and envvar.go build them."""
    policy, spec = job["spec"]["elasticPolicy"], job["spec"]
    host = policy.get("rdzvHost", f"{job['metadata']['name']}-worker-0")
    port = policy.get("rdzvPort") or next(
        p["containerPort"] for p in pytorch_container(job).get("ports", ())
        if p["name"] == "pytorchjob-port")
    return {"PET_RDZV_ENDPOINT": f"{host}:{port}",
            "PET_RDZV_BACKEND": policy.get("rdzvBackend", "c10d"),
            "PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}",
            "PET_MAX_RESTARTS": str(policy["maxRestarts"]),
            "PET_NPROC_PER_NODE": spec["nprocPerNode"],
            "PET_RDZV_CONF": ",".join(f"{c['key']}={c['value']}" for c in policy["rdzvConf"]),
            **({"PET_RDZV_ID": policy["rdzvId"]} if "rdzvId" in policy else {})}


def test_pytorchjob_workers_meet_at_the_store_outside_them(monkeypatch):
    """What torchrun makes of the container's command line and the operator's PET_* variables:
    every agent at the store's Service, none serving it, and `elastic-mnist train` parsing its
    arguments."""
    from torch.distributed.run import get_args_parser

    job = manifests()["PyTorchJob"]
    for name, value in operator_env(job).items():
        monkeypatch.setenv(name, value)  # torchrun reads them as it builds its parser
    container = pytorch_container(job)
    assert container["command"][:3] == ["python", "-m", "torch.distributed.run"]
    args = get_args_parser().parse_args(container["command"][3:] + container["args"])
    service = manifests()["Service"]
    assert args.rdzv_endpoint == f"{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    assert args.rdzv_backend == "elastic-mnist" and args.nnodes == "1:4"
    # A job of its own at a store that serves many: not torchrun's "none", which a finished job
    # would have closed for every later one.
    assert args.rdzv_id == job["spec"]["elasticPolicy"]["rdzvId"] != "none"
    assert dict(item.split("=", 1) for item in args.rdzv_conf.split(","))["is_host"] == "false"
    assert args.nproc_per_node == "8" and args.monitor_interval == 0.5 and args.max_restarts == 3
    assert args.module and args.training_script == "elastic_mnist"
    train = build_parser().parse_args(args.training_script_args)
    assert (train.command, train.checkpoint_dir) == ("train", "/shared/ckpt")


def store_deployment() -> tuple[dict, dict]:
    """The store's Deployment and its one container."""
    deployment = manifests()["Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return deployment, container


def test_the_store_runs_once_where_its_service_sends_the_agents():
    deployment, container = store_deployment()
    service, job = manifests()["Service"], manifests()["PyTorchJob"]
    assert deployment["apiVersion"] == "apps/v1" and service["apiVersion"] == "v1"
    # One store, never two at once (a rolling update would run the new beside the old).
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    worker_labels = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"].get(
        "metadata", {}).get("labels", {})
    assert not service["spec"]["selector"].items() <= worker_labels.items()

    # The command is our CLI's: the store on every interface of its pod, at its port.
    assert container["command"][:3] == ["python", "-m", "elastic_mnist"]
    args = build_parser().parse_args(container["command"][3:] + container.get("args", []))
    assert (args.command, args.host) == ("rendezvous", "0.0.0.0")
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"rendezvous": args.port}
    (service_port,) = service["spec"]["ports"]
    assert service_port["targetPort"] in (args.port, *ports)
    assert container["readinessProbe"]["tcpSocket"]["port"] in (args.port, *ports)
    assert "nvidia.com/gpu" not in str(container.get("resources"))

    # The PyTorchJob's agents are sent to the Service.
    policy = job["spec"]["elasticPolicy"]
    assert (policy["rdzvHost"], policy["rdzvPort"]) == (service["metadata"]["name"],
                                                        service_port["port"])


@pytest.mark.parametrize("command", [
    ["python", "-m", "elastic_mnist", "rendezvous", "--hots", "0.0.0.0"],
    ["python", "-m", "elastic_mnist", "rendezvous", "--port", "twenty"],
    ["python", "-m", "elastic_mnist", "rendevous"],
])
def test_a_wrong_flag_in_the_store_command_fails_the_parse(command):
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(command[3:])
    assert caught.value.code == 2


_JSON_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool}


def _has_type(value: object, kind: str) -> bool:
    if kind in ("integer", "number"):  # a YAML true is a bool, never a number
        numeric = int if kind == "integer" else (int, float)
        return isinstance(value, numeric) and not isinstance(value, bool)
    return isinstance(value, _JSON_TYPES[kind])


def schema_errors(value: object, schema: dict, path: str = "") -> list[str]:
    """Where ``value`` breaks the structural OpenAPI v3 ``schema`` of a CRD, strictly: a key that
    the schema does not declare is an error, as with `kubectl apply --validate=strict`."""
    if schema.get("x-kubernetes-int-or-string"):
        kinds = ["integer", "string"]
    elif "anyOf" in schema:
        kinds = [branch["type"] for branch in schema["anyOf"]]
    else:
        kinds = [schema["type"]] if "type" in schema else []
    if kinds and not any(_has_type(value, kind) for kind in kinds):
        return [f"{path or '.'}: {value!r} is not {' or '.join(kinds)}"]
    errors = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, str) and "pattern" in schema and not re.search(schema["pattern"], value):
        errors.append(f"{path}: {value!r} does not match {schema['pattern']}")
    if isinstance(value, dict):
        errors += [f"{path}.{key}: required" for key in schema.get("required", ())
                   if key not in value]
        known, extra = schema.get("properties", {}), schema.get("additionalProperties")
        for key, item in value.items():
            if key in known:
                errors += schema_errors(item, known[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                errors += schema_errors(item, extra, f"{path}.{key}")
            elif not (extra is True or schema.get("x-kubernetes-preserve-unknown-fields")):
                errors.append(f"{path}.{key}: unknown field")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += schema_errors(item, schema["items"], f"{path}[{i}]")
    return errors


@pytest.fixture(scope="module")
def crd_schema() -> dict:
    if not CRD.is_file():
        pytest.skip(f"the PyTorchJob CRD is not at {CRD}")
    crd = yaml.safe_load(CRD.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])
    # The API server checks an object's own metadata as ObjectMeta, which the CRD leaves as a bare
    # object; the pod template's metadata in the same CRD is ObjectMeta's schema.
    replica = schema["properties"]["spec"]["properties"]["pytorchReplicaSpecs"]
    template = replica["additionalProperties"]["properties"]["template"]
    schema["properties"]["metadata"] = template["properties"]["metadata"]
    return schema


def test_pytorchjob_validates_strictly_against_the_crd(crd_schema):
    assert schema_errors(manifests()["PyTorchJob"], crd_schema) == []


def test_the_store_pod_validates_strictly_against_the_pod_template_schema(crd_schema):
    """The store's pod template is a core/v1 PodTemplateSpec, whose schema the CRD carries for
    the workers' pods."""
    replica = crd_schema["properties"]["spec"]["properties"]["pytorchReplicaSpecs"]
    template = replica["additionalProperties"]["properties"]["template"]
    deployment, _ = store_deployment()
    assert schema_errors(deployment["spec"]["template"], template) == []
    misspelt = copy.deepcopy(deployment["spec"]["template"])
    misspelt["spec"]["containers"][0]["readinessprobe"] = {}
    assert schema_errors(misspelt, template) == [
        ".spec.containers[0].readinessprobe: unknown field"]


def _misspell(job):
    policy = job["spec"]["elasticPolicy"]
    policy["maxReplica"] = policy.pop("maxReplicas")


def _unknown_container_field(job):
    pytorch_container(job)["volumeMount"] = pytorch_container(job).pop("volumeMounts")


def _quoted_number(job):
    job["spec"]["elasticPolicy"]["minReplicas"] = "1"


def _unquoted_conf_value(job):
    job["spec"]["elasticPolicy"]["rdzvConf"][0]["value"] = 600


def _nameless_container(job):
    del pytorch_container(job)["name"]


@pytest.mark.parametrize(("mutate", "where"), [
    (_misspell, ".spec.elasticPolicy.maxReplica: unknown field"),
    (_unknown_container_field, ".containers[0].volumeMount: unknown field"),
    (_quoted_number, ".spec.elasticPolicy.minReplicas: '1' is not integer"),
    (_unquoted_conf_value, ".spec.elasticPolicy.rdzvConf[0].value: 600 is not string"),
    (_nameless_container, ".containers[0].name: required"),
], ids=lambda x: getattr(x, "__name__", "")[1:] or None)
def test_crd_validation_catches_mistakes(crd_schema, mutate, where):
    job = copy.deepcopy(manifests()["PyTorchJob"])
    mutate(job)
    errors = schema_errors(job, crd_schema)
    assert len(errors) == 1 and errors[0].endswith(where), errors


def test_schema_validator_keywords():
    schema = {"type": "object", "required": ["mode"], "properties": {
        "mode": {"type": "string", "enum": ["a", "b"]},
        "size": {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"},
                                                               {"type": "string"}]},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        "flag": {"type": "boolean"}, "count": {"type": "integer"}}}
    good = {"mode": "a", "size": "1Gi", "labels": {"x": "y"}, "free": {"any": [1]},
            "flag": True, "count": 2}
    assert schema_errors(good, schema) == []
    assert schema_errors({**good, "size": 3}, schema) == []
    assert schema_errors({**good, "mode": "c"}, schema) == [".mode: 'c' is not one of ['a', 'b']"]
    assert schema_errors({**good, "size": 1.5}, schema) == [".size: 1.5 is not integer or string"]
    assert schema_errors({**good, "labels": {"x": 1}}, schema) == [".labels.x: 1 is not string"]
    assert schema_errors({**good, "count": True}, schema) == [".count: True is not integer"]
    assert schema_errors({"size": 1}, schema) == [".mode: required"]


# ---------------------------------------------------------------------------------------------
# elastic_mnist/rendezvous.py

SERVE = ("import logging, sys; logging.basicConfig(level=logging.INFO, format='%(message)s'); "
         "from elastic_mnist.rendezvous import serve; sys.exit(serve('127.0.0.1', 0))")


@pytest.fixture
def store_process():
    """`serve` in a process of its own on a port the OS picks; yields (process, port)."""
    proc = subprocess.Popen([sys.executable, "-c", SERVE], cwd=REPO, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        found = re.match(r"rendezvous store listening on 127\.0\.0\.1:(\d+) \(127\.0\.0\.1\); "
                         r"127\.0\.0\.1 is this machine alone: ", line)
        if not found:
            kill_tree(proc.pid)
            pytest.fail(line + proc.stdout.read())
        yield proc, int(found.group(1))
    finally:
        kill_tree(proc.pid)


def test_rendezvous_store_serves_agents_and_stops_on_sigterm(store_process):
    from torch.distributed import TCPStore

    proc, port = store_process
    first = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    second = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    first.set("torch.rendezvous.job/state", "round 1")
    assert second.get("torch.rendezvous.job/state") == b"round 1"
    assert first.add("joined", 1) == 1 and second.add("joined", 1) == 2
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0
    assert "stopping" in proc.stdout.read()


def test_rendezvous_port_in_use_is_one_clear_line(store_process):
    _, port = store_process
    with pytest.raises(RendezvousError) as caught:
        serve("127.0.0.1", port)
    assert str(caught.value).startswith(f"port {port} is already in use")
    assert "\n" not in str(caught.value)


def test_rendezvous_refuses_a_port_that_is_no_port():
    with pytest.raises(RendezvousError, match="port 70000 is not a TCP port"):
        serve("127.0.0.1", 70000)


def test_rendezvous_refuses_a_host_that_does_not_resolve_in_one_line():
    with pytest.raises(RendezvousError) as caught:
        serve("no-such-host.invalid", 0)
    assert str(caught.value).startswith("--host no-such-host.invalid does not resolve on this ")
    assert "\n" not in str(caught.value)


def test_rendezvous_arguments():
    """By default the store answers at this machine's host name, which the other machines reach
    (not localhost, this machine alone)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert vars(parser.parse_args([])) == {"host": socket.gethostname(), "port": DEFAULT_PORT}
    assert vars(parser.parse_args(["--host", "store.internal", "--port", "0"])) == \
        {"host": "store.internal", "port": 0}


def test_rendezvous_help_prints_every_default(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["rendezvous", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert f"(default: this machine's host name, {socket.gethostname()})" in shown
    assert f"(default: {DEFAULT_PORT}, torchrun's)" in shown


@pytest.mark.parametrize(("host", "says"), [
    ("store.internal", ("agents: RDZV_STORE=external RDZV_ENDPOINT=store.internal:29400 "
                        "(jobs/node.sh), or torchrun --rdzv_endpoint=store.internal:29400 "
                        "--rdzv_conf=is_host=false")),
    ("fd00::1", "RDZV_ENDPOINT=[fd00::1]:29400 "),
    ("0.0.0.0", f"RDZV_ENDPOINT=<this machine's name or address, e.g. {socket.gethostname()}>:"),
    ("localhost", ("localhost is this machine alone: agents on other machines cannot reach it; "
                   "for them pass --host with this machine's name or address")),
    ("::1", "::1 is this machine alone"),
])
def test_rendezvous_start_up_line_tells_what_the_agents_need(host, says):
    assert says in agents_line(host, 29400)
