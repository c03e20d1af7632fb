"""What survivors can rely on, shown with gloo under real torchrun agents (tests/test_multinode.py).

Two workers, one per agent. Rank 1 stops itself (SIGSTOP) after a barrier, as a frozen node
would. Rank 0 starts an all-reduce, aborts the backend, waits a second with a timeout of its
own, then waits for good; it prints one JSON line of what it saw and exits 0:

- ``completed_after_abort``: whether the backend's abort ended the collective (gloo: no);
- ``wait_timeout_s``: when ``Work.wait(timeout)`` gave up on it (the wait's own timeout);
- ``returned_s``: when the collective itself failed (the group's timeout, ``GROUP_TIMEOUT_S``).
"""

import datetime
import json
import os
import signal
import time

import torch
import torch.distributed as dist

group_timeout = float(os.environ.get("GROUP_TIMEOUT_S", "3"))
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=group_timeout))
dist.barrier()
if dist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGSTOP)
    os._exit(0)

start = time.monotonic()
work = dist.all_reduce(torch.ones(1), async_op=True)
dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).abort()
time.sleep(0.5)
seen = {"completed_after_abort": work.is_completed()}
try:
    work.wait(datetime.timedelta(seconds=1))
except RuntimeError:
    seen["wait_timeout_s"] = time.monotonic() - start
try:
    work.wait()
except RuntimeError:
    seen["returned_s"] = time.monotonic() - start
print(json.dumps(seen), flush=True)
os._exit(0)  # gloo's threads still hold the group: no interpreter shutdown around them
