"""A node that joins checks itself against the job's flags (state.py ``check_lockstep``)."""

from __future__ import annotations

import pytest

from elastic_mnist.config import TrainConfig
from elastic_mnist.errors import ConfigError
from elastic_mnist.state import LOCKSTEP, check_lockstep


def test_a_flag_the_jobs_version_did_not_have_is_its_default():
    """A joiner of a newer version joins a job whose description lacks a flag (``--balance``,
    added after the job started: a KeyError and a traceback before, make partitions' rank0-30
    met it): the job runs as that flag's default, so a joiner with the default joins, and one
    without is refused in one line."""
    assert ("run", "balance") in LOCKSTEP
    theirs = TrainConfig().to_dict()
    del theirs["run"]["balance"]
    check_lockstep(theirs, TrainConfig())
    cfg = TrainConfig()
    cfg.run.balance = True
    with pytest.raises(ConfigError, match="the job this node joins runs with --balance=False"):
        check_lockstep(theirs, cfg)
