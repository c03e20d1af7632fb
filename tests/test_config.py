import dataclasses

import pytest
from launch import cli_cmd, run

from elastic_mnist.cli import build_parser, main
from elastic_mnist.config import TrainConfig, field_docs, train_config_from_args
from elastic_mnist.errors import ConfigError

CONTRACT_FLAGS = ["--data-dir", "--dataset", "--no-download", "--epochs", "--max-steps",
                  "--global-batch-size", "--lr", "--seed", "--checkpoint-dir", "--logdir",
                  "--run-id", "--device", "--checkpoint-every", "--keep-last", "--audit-samples",
                  "--pg-timeout", "--grad-sync"]


def parse(*argv):
    return train_config_from_args(build_parser().parse_args(["train", *argv]))


def test_every_field_has_a_docstring():
    for section in dataclasses.fields(TrainConfig):
        cls = section.default_factory
        docs = field_docs(cls)
        assert set(docs) == {f.name for f in dataclasses.fields(cls)}, cls


def test_flags_map_onto_the_dataclasses():
    cfg = parse("--no-download", "--lr", "0.01", "--global-batch-size", "64", "--dataset",
                "synthetic", "--checkpoint-every", "5")
    assert cfg.data.download is False and cfg.data.dataset == "synthetic"
    assert cfg.optim.lr == 0.01 and cfg.optim.global_batch_size == 64
    assert cfg.checkpoint.checkpoint_every == 5
    assert parse().data.download is True


def test_help_documents_every_contract_flag_with_its_default():
    done = run(cli_cmd("train", "--help"))
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    for flag in CONTRACT_FLAGS:
        assert flag in text, flag
    assert "(default: 768)" in text and "(default: 'checkpoints')" in text


@pytest.mark.parametrize("argv, flag", [
    (["--epochs", "0"], "--epochs"),
    (["--global-batch-size", "-1"], "--global-batch-size"),
    (["--micro-batch-size", "1024"], "--micro-batch-size"),
    (["--max-steps", "-3"], "--max-steps"),
    (["--lr", "0"], "--lr"),
    (["--lr", "inf"], "--lr"),
    (["--weight-decay", "nan"], "--weight-decay"),
    (["--pg-timeout", "inf"], "--pg-timeout"),
    (["--global-batch-size", "24", "--micro-batch-size", "32"], "--micro-batch-size"),
])
def test_bad_values_are_config_errors(argv, flag):
    with pytest.raises(ConfigError, match=flag):
        parse(*argv).validate()


@pytest.mark.parametrize("argv", [
    ["train", "--epochs", "two"],
    ["train", "--dataset", "cifar"],
    ["train", "--bogus"],
    ["train", "--epochs", "0"],
    ["evaluate"],
    ["synth", "--out", "x", "--train", "0"],
])
def test_bad_flags_get_one_line_and_exit_2(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    try:
        status = main(argv)
    except SystemExit as e:
        status = e.code
    out = capsys.readouterr()
    assert status == 2, out
    assert not out.out and len(out.err.strip().splitlines()) == 1, out.err
    assert "error" in out.err


def test_a_bad_flag_is_one_line_from_the_real_program_too(tmp_path):
    done = run(cli_cmd("train", "--epochs", "two"), cwd=tmp_path)
    assert done.returncode == 2, done.stdout
    assert len(done.stdout.strip().splitlines()) == 1, done.stdout
    assert "error" in done.stdout


@pytest.mark.parametrize("global_batch, micro", [(768, 8), (128, 8), (24, 8), (100, 5), (7, 7), (96, 8)])
def test_the_micro_batch_follows_the_global_batch_unless_given(global_batch, micro):
    cfg = parse("--global-batch-size", str(global_batch))
    cfg.validate()
    assert cfg.optim.micro_batch_size == micro
    assert parse("--global-batch-size", "24", "--micro-batch-size", "8").optim.micro_batch_size == 8
    assert TrainConfig().optim.micro_batch_size == 8


def test_a_non_finite_float_flag_is_one_line_and_exit_2(tmp_path):
    done = run(cli_cmd("train", "--lr", "inf", "--max-steps", "2"), cwd=tmp_path)
    assert done.returncode == 2, done.stdout
    expected = "elastic-mnist train: error: --lr must be a finite number, got inf"
    assert done.stdout.strip() == expected
    assert not list(tmp_path.iterdir())  # nothing trained, nothing written
