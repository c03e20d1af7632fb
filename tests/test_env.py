import pytest
from launch import clean_env, cli_cmd, run

from elastic_mnist.env import DistEnv
from elastic_mnist.errors import EnvError

GOOD = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "0", "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_RUN_ID": "job7",
        "MASTER_ADDR": "head", "MASTER_PORT": "29500"}


def test_no_launcher_means_one_process():
    env = DistEnv.from_environ({})
    assert (env.rank, env.world_size, env.launched, env.is_main) == (0, 1, False, True)


def test_reads_every_torchrun_variable():
    env = DistEnv.from_environ(GOOD)
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (1, 1, 4, 2)
    assert (env.restart_count, env.run_id, env.master_addr, env.master_port) == \
        (2, "job7", "head", 29500)
    assert env.launched and not env.is_main


def test_run_id_none_is_no_run_id():
    assert DistEnv.from_environ({**GOOD, "TORCHELASTIC_RUN_ID": "none"}).run_id is None


OURS = {"ELASTIC_MNIST_RDZV": "10.0.0.7:29400", "ELASTIC_MNIST_RDZV_ID": "job7",
        "ELASTIC_MNIST_AGENT": "3", "ELASTIC_MNIST_ROUND": "2", "ELASTIC_MNIST_KEEP_ALIVE": "1,4"}


def test_our_backend_tells_the_worker_its_rendezvous_without_its_agents_command_line():
    rdzv = DistEnv.from_environ({**GOOD, **OURS, "ELASTIC_MNIST_JOIN": "5"},
                                launcher_argv=["python", "-c", "not torchrun"]).rendezvous
    assert (rdzv.backend, rdzv.endpoint, rdzv.run_id, rdzv.agent, rdzv.round, rdzv.join) == \
        ("elastic-mnist", "10.0.0.7:29400", "job7", "3", 2, 5)
    assert (rdzv.keep_alive_interval_s, rdzv.keep_alive_max_attempt) == (1.0, 4)
    assert DistEnv.from_environ({**GOOD, **OURS}).rendezvous.join is None


@pytest.mark.parametrize("change, names", [({"ELASTIC_MNIST_RDZV": "nohost"}, "ELASTIC_MNIST_RDZV"),
                                           ({"ELASTIC_MNIST_KEEP_ALIVE": "1"}, "KEEP_ALIVE"),
                                           ({"ELASTIC_MNIST_ROUND": "-1"}, "ROUND")])
def test_a_rendezvous_no_agent_of_ours_writes_names_the_variable(change, names):
    with pytest.raises(EnvError, match=names):
        DistEnv.from_environ({**GOOD, **OURS, **change})


@pytest.mark.parametrize("change, names", [
    ({"WORLD_SIZE": None}, "WORLD_SIZE"),
    ({"RANK": None}, "RANK"),
    ({"RANK": "4"}, "RANK"),
    ({"RANK": "one"}, "RANK"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE"),
    ({"LOCAL_RANK": "2"}, "LOCAL_RANK"),
    ({"LOCAL_RANK": "-1"}, "LOCAL_RANK"),
    ({"MASTER_PORT": "http"}, "MASTER_PORT"),
    ({"LOCAL_WORLD_SIZE": "8"}, "LOCAL_WORLD_SIZE"),
])
def test_inconsistent_environment_names_the_variable(change, names):
    environ = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    with pytest.raises(EnvError, match=names):
        DistEnv.from_environ(environ)


@pytest.mark.parametrize("bad", [{"RANK": "0"}, {"RANK": "3", "WORLD_SIZE": "2"},
                                 {"RANK": "x", "WORLD_SIZE": "2"}])
def test_worker_rejects_bad_environment_with_one_line_and_exit_2(bad, tmp_path):
    done = run(cli_cmd("train", "--device", "cpu", "--dataset", "synthetic", "--data-dir",
                       str(tmp_path)), env=clean_env(**bad), cwd=tmp_path)
    assert done.returncode == 2, done.stdout
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and "RANK" in lines[0], done.stdout
    assert not (tmp_path / "MNIST").exists()  # no work started


def test_cuda_asked_for_without_gpu_is_a_clear_error(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    done = run(cli_cmd("train", "--device", "cuda", "--dataset", "synthetic",
                       "--data-dir", str(tmp_path)), cwd=tmp_path)
    assert done.returncode == 2
    assert done.stdout.strip().splitlines()[-1].endswith("no CUDA GPU is visible")
