"""A worker under torchrun with ``--rdzv_backend=elastic-mnist`` (tests/test_agents.py): prints one
JSON line of the launcher's variables and ours as it got them, waits until the file named by
``GO_FILE`` exists (when set), prints when it ended (time.time()) and exits at once. It imports
no torch: its agent's time to exit is measured from its end, not from the seconds a process
that imported torch takes to start and to tear itself down."""

import json
import os
import time

NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR",
         "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "TORCH_ELASTIC_WORKER_IDENTICAL",
         "ELASTIC_MNIST_RDZV", "ELASTIC_MNIST_RDZV_ID", "ELASTIC_MNIST_AGENT",
         "ELASTIC_MNIST_ROUND", "ELASTIC_MNIST_KEEP_ALIVE", "ELASTIC_MNIST_JOIN")

seen = {name: os.environ.get(name) for name in NAMES}
print(json.dumps({"rendezvous_env": True, **seen}), flush=True)
go = os.environ.get("GO_FILE")
while go and not os.path.exists(go):
    time.sleep(0.02)
print(json.dumps({"worker_ended": time.time()}), flush=True)
os._exit(0)
