"""The job learns real handwriting: the real digits' 8,000/2,000 split, default flags, 5 epochs.

The default global batch (768, sized so that the card's 32 ranks and the 24 left after a node's
loss all have work) makes an epoch of 8,000 digits 11 steps: 55 steps in all."""

import json

import pytest
from launch import cli_cmd, run


@pytest.mark.slow
@pytest.mark.long
def test_reaches_97_percent_on_real_digits_in_5_epochs(real_split, tmp_path):
    done = run(cli_cmd("train", "--device", "cpu", "--data-dir", str(real_split), "--no-download",
                       "--epochs", "5",
                       "--checkpoint-dir", str(tmp_path / "ckpt"), "--logdir",
                       str(tmp_path / "runs")), timeout=600)
    assert done.returncode == 0, done.stdout
    result = run(cli_cmd("evaluate", "--device", "cpu", "--checkpoint-dir", str(tmp_path / "ckpt"),
                         "--json"))
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["dataset"] == "mnist" and report["test_samples"] == 2000
    assert report["accuracy"] >= 0.97, report
