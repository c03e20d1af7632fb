"""A survivors' process group, built apart and then made the default one: read against torch
2.14.1.

Its one job: build a new group's backend without registering it (a creation given up on changes
nothing in this process), make it the default group as ``init_process_group`` would, without
connecting again, and abort the default group's collectives (NCCL). It reaches torch 2.14.1's
internals (``ProcessGroupNCCL.Options._timeout``, ``distributed_c10d._abort_process_group``, a
backend registered to hand a built one over, ``bound_device_id``); tests/test_membership.py
fails when torch changes them.
"""

from __future__ import annotations

import datetime
import functools

import torch
import torch.distributed as dist


def connect_group(device: torch.device, store: dist.Store, rank: int, world_size: int,
                  timeout: datetime.timedelta) -> dist.Backend:
    """The backend of a new group, connected to its members (the wait that a member lost or
    frozen holds up), and registered nowhere: building it changes nothing in this process."""
    backend = _new_backend(device.type, store, rank, world_size, timeout)
    if device.type == "cuda":
        backend.eager_connect_single_device(device)  # as init_process_group with device_id
    return backend


def _new_backend(device_type: str, store: dist.Store, rank: int, world_size: int,
                 timeout: datetime.timedelta) -> dist.Backend:
    """A group's backend as ``init_process_group`` builds it for ``device_type``."""
    if device_type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout  # as init_process_group sets it
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


_BUILT = "elastic_mnist_built"
"""torch's name, per device type, of a backend that :func:`install_group` hands over."""
_handed_over: list[dist.Backend] = []


def _hand_over(device_type: str, store: dist.Store, rank: int, size: int,
               timeout: datetime.timedelta) -> dist.Backend:
    """The backend ``install_group`` hands over; for any later group made with the default
    group's backend name (``dist.new_group()`` without a backend), a new one of its own."""
    if _handed_over:
        return _handed_over.pop()
    return _new_backend(device_type, store, rank, size, timeout)


def install_group(backend: dist.Backend, device: torch.device, store: dist.Store, rank: int,
                  world_size: int, timeout: datetime.timedelta) -> None:
    """Makes ``backend`` (see :func:`connect_group`) this process's default group, as
    ``init_process_group`` would have, without connecting again: torch takes it from a backend
    registered for the purpose (``Backend.register_backend``), whose creator hands it over.
    Called by the training thread only.

    No ``device_id`` goes to ``init_process_group``: with one, torch's
    ``_new_process_group_helper`` connects the backend again
    (``eager_connect_single_device``); the group is bound to the device here instead, as it
    would have been (``bound_device_id``: later groups split from it)."""
    name = f"{_BUILT}_{device.type}"
    if not hasattr(dist.Backend, name.upper()):
        dist.Backend.register_backend(name, functools.partial(_hand_over, device.type),
                                      devices=[device.type])
    _handed_over[:] = [backend]
    try:
        dist.init_process_group(backend=name, store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
    finally:  # a failed init keeps no connected backend for a later group to take
        _handed_over.clear()
    if device.type == "cuda":
        dist.group.WORLD.bound_device_id = device


def abort_default_group() -> None:
    """Aborts the collectives in flight of this process's default group (NCCL can; gloo
    cannot)."""
    dist.distributed_c10d._abort_process_group()
