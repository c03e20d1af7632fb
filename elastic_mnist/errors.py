"""Bad input said in one line: the errors that are the user's to mend, and how they are reported.

Below both the command line (cli.py) and the worker's entry point (worker.py), which report them
alike; torch is not imported here.
"""

from __future__ import annotations

import sys

from elastic_mnist.config import ConfigError
from elastic_mnist.data.idx import DataError
from elastic_mnist.env import EnvError
from elastic_mnist.rendezvous import RendezvousError

EXIT_USAGE = 2
USER_ERRORS: tuple[type[Exception], ...] = (EnvError, ConfigError, DataError, RendezvousError)
"""Bad flags, data, environment or ports: one line and EXIT_USAGE, never a traceback."""


def report_user_error(command: str, error: Exception) -> int:
    """Bad input, said in one line on stderr; returns the exit code.

    One write of the whole line: ``print`` writes the newline apart, and the lines of workers
    that share torchrun's output could then run into each other.
    """
    sys.stderr.write(f"elastic-mnist {command}: error: {error}\n")
    sys.stderr.flush()
    return EXIT_USAGE
