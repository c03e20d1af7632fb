"""Resilience, beside the training package: who is in the job and how it goes on when that
changes.

- ``membership``: the ranks of the job's generation, its guarded collectives and its fault;
  ``faces``: what the loop (``NullMembership``, also the membership of a job that does not
  recover in process) and the membership's helpers (``Member``) see of it; ``recovery``: one
  change, from the fault to a new group; ``agreement``: the records the survivors agree on, and
  how; ``read_once``: a generation's identities, read once; ``connections``: the store
  connections every generation reuses; ``current``: the job's current generation, for the fence;
- ``torchrun_agents``: the glue to torchrun's agents (read against torch 2.14.1), handed to the
  membership as the one face it knows of the launcher;
- ``agents``: our own rendezvous backend for torchrun's agents (``--rdzv_backend=elastic-mnist``),
  with its ``agent_settings``, its ``agent_store``, each agent's ``keep_alive`` and its
  ``exit_barrier``; ``roster``: the records in the rendezvous store that its agents and the
  workers share;
- ``survivors_group``: a survivors' process group built apart and installed (torch 2.14.1);
- ``watchdog``: hangs told apart from slow steps; ``lease``: one live job per checkpoint folder
  (``lease_record``: what its file says);
- ``fence``: whether this process may still write, asked by every writer;
- ``preemption``: signals become an agreed stop; ``faults``: faults on demand, for tests.

Exit codes and the exceptions that cross rooms are in ``elastic_mnist.errors``. Nothing here is
imported by this file: importing the package costs nothing.
"""
