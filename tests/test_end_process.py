"""A worker ends through ``end_process``: its exit code, its logs and its output all survive."""

from __future__ import annotations

import sys

import pytest
from launch import REPO, run

PROGRAM = """
import logging, sys
from elastic_mnist.distributed import end_process

logging.basicConfig(filename=sys.argv[1], level=logging.INFO)
logging.getLogger("job").info("the last log line")
print("the last output line")  # block-buffered: stdout is a pipe
end_process(3)
"""


def test_end_process_keeps_the_code_the_log_and_the_output(tmp_path):
    log = tmp_path / "job.log"
    done = run([sys.executable, "-c", PROGRAM, str(log)])
    assert done.returncode == 3
    assert done.stdout == "the last output line\n"
    assert log.read_text() == "INFO:job:the last log line\n"


@pytest.mark.long
def test_exit_race_script_runs_both_ways():
    done = run([sys.executable, str(REPO / "scripts" / "exit_race.py"), "--launches", "1",
                "--nproc", "2", "--load", "0"])
    assert done.returncode == 0, done.stdout
    lines = done.stdout.splitlines()
    assert lines[0].startswith("finalize: ") and lines[1] == "end_process: 0 of 1 launches aborted"
