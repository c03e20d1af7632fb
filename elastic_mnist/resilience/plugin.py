"""The ``torchrun.handlers`` entry point (pyproject.toml), alone in a module that imports
nothing.

torch loads every out-of-tree rendezvous handler as ``torch.distributed.elastic.rendezvous``
is first imported. Were the entry point agents.py's own, a process that imports agents.py
first (a script, a test, ``python -c``) would start that import from agents.py's own imports,
and torch would find agents.py half made: a warning with a traceback ("partially initialized
module"), and no backend registered in that process. Here agents.py is imported only when
torchrun makes a handler.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters


def backend() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """What torch registers as ``--rdzv_backend=elastic-mnist``: torch calls it with no
    arguments, as it registers it."""
    return create_handler


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """An agent's handler (agents.py :func:`~elastic_mnist.resilience.agents.create_handler`)."""
    from elastic_mnist.resilience import agents

    return agents.create_handler(params)
