# elastic-mnist: every target creates .venv first when it is missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# make train: where the data, checkpoints and TensorBoard logs go, and what else to pass.
DATA_DIR       ?= data
CHECKPOINT_DIR ?= checkpoints
LOGDIR         ?= runs
TRAIN_ARGS     ?=
PORT           ?= 6006
CHAOS_ARGS     ?=
CHURN_ARGS     ?=
PARTITIONS_ARGS ?=
STRAGGLERS_ARGS ?=
SCALE_ARGS     ?=

.PHONY: install train test test-long test-fast test-torch211 tensorboard chaos chaos32 churn partitions stragglers scale \
	recovery-soak lint clean bench slurm-check help

install: $(STAMP)  ## create .venv (torch, this package, test tools): every target does it first

# pip byte-compiles what it installs one file at a time (torch is most of 2 minutes' install);
# compileall does it on every core. Only an optimisation: a file it cannot compile (torch ships
# one for Python 3.12 only) is compiled, or not, when imported, so its status is not ours.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --no-compile -c constraints.txt -e '.[test,dev]'
	$(BIN)/python -m compileall -q -j 0 $(VENV)/lib > /dev/null || true
	touch $(STAMP)

# Ctrl-C: jobs/local.sh stops the workers at one step with a checkpoint, and rank 0 says how to
# resume, in one line. exec (no shell between make and the script, which SIGINT would kill) and
# INTERRUPT_STATUS=0 keep make's own error line out: make then ends by the SIGINT it got itself.
train: $(STAMP)  ## train here: a worker per GPU, or 2 on CPU (TRAIN_ARGS="--epochs 5")
	PATH=$(abspath $(BIN)):$$PATH INTERRUPT_STATUS=0 \
		RESUME_COMMAND='$(subst ','\'',make train $(MAKEOVERRIDES))' \
		exec jobs/local.sh --data-dir $(DATA_DIR) --synthetic-fallback \
		--checkpoint-dir $(CHECKPOINT_DIR) --logdir $(LOGDIR) $(TRAIN_ARGS)

# The suite in TEST_WORKERS processes (pytest-xdist): most multi-process tests spend much of
# their time waiting (for a deadline, a rendezvous, a signal's effect), so two share two cores
# well. Each test goes to the process that runs low, the slow first (tests/conftest.py); each
# shared run is launched once for all of them (tests/shared_runs.py).
# The project's own modules are compiled first: where PYTHONDONTWRITEBYTECODE is set, each of
# the suite's few hundred processes would compile them again.
TEST_WORKERS ?= 2
COMPILE_OURS := $(BIN)/python -m compileall -q -j 0 elastic_mnist scripts tests > /dev/null
test: $(STAMP)  ## the whole suite but its long runs (make test-long), in TEST_WORKERS (2) processes
	$(COMPILE_OURS)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m "not long"

# The suite's long end-to-end runs, marked `long`: the measuring harnesses (bench.py's CPU
# contenders, scale.py, the GPU check's dry run, exit_race.py), the 5 epochs to 97 % on real
# digits, nodes joining under our rendezvous as a worker dies, what survivors rely on from
# torchrun and gloo, a wrapper that hides the agent. About two minutes on 2 cores:
# make test keeps its 8 minutes without them, and CI runs them after it (.ci/run).
test-long: $(STAMP)  ## the suite's long end-to-end runs (CI runs them after make test)
	$(COMPILE_OURS)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m long

test-fast: $(STAMP)  ## the suite without the tests marked slow (torchrun launches, cuts of seconds)
	$(COMPILE_OURS)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m "not slow"

# make test-torch211: the oldest torch of pyproject.toml's range, the one a GPU machine may bring
# (torch 2.11.0, torchvision 0.26.0, Python 3.12), in a venv of its own, .venv-torch211 (5 GB, a
# minute to download): the tests of one node in it, that is the fast ones, a two-worker training
# launch under torchrun, and scripts/gpu_check.sh's dry run. Not part of `make test`.
PYTHON312 ?= $(or $(lastword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12)),python3.12)
VENV211   := .venv-torch211
STAMP211  := $(VENV211)/.installed
$(STAMP211): pyproject.toml
	@$(PYTHON312) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null || \
		{ echo "make test-torch211: no Python 3.12 at PYTHON312=$(PYTHON312); name one" >&2; \
		exit 2; }
	test -x $(VENV211)/bin/python || $(PYTHON312) -m venv $(VENV211)
	$(VENV211)/bin/pip install --quiet --no-compile -e '.[test]' torch==2.11.0 torchvision==0.26.0
	touch $(STAMP211)

test-torch211: $(STAMP211)  ## the one-node tests on torch 2.11 and Python 3.12 (.venv-torch211)
	$(VENV211)/bin/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadgroup \
		-m "not slow" tests/
	$(VENV211)/bin/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) \
		tests/test_train.py::test_two_workers_train_checkpoint_log_and_resume \
		tests/test_gpu_check.py::test_gpu_check_dry_run_leaves_its_files

# make tensorboard listens on localhost (the logs hold command lines and paths); HOST=0.0.0.0
# opens it to the network. Taken from make's command line only, never from a shell's own HOST.
HOST = localhost
tensorboard: $(STAMP)  ## TensorBoard on runs/ at localhost:6006 (LOGDIR=, PORT=, HOST=)
	$(BIN)/tensorboard --logdir $(LOGDIR) --port $(PORT) --host $(HOST)

# Simulated nodes on loopback, one fault of each kind at random steps (CHAOS_ARGS="--seed 3
# --faults 9" for others).
chaos: $(STAMP)  ## simulated nodes on loopback, a fault of each kind, a verdict
	$(BIN)/python scripts/chaos.py $(CHAOS_ARGS)

# The card's shape on this machine: 4 nodes of 8 workers with the job's default batch flags (every
# rank has samples in every step, checked), a node killed and one joining (about 4 minutes on 2
# cores). The README's multi-node torchrun line, with jobs/node.sh's rendezvous timing, instead of
# jobs/node.sh: make chaos32 CHAOS_ARGS="--launch torchrun";
# CHAOS_ARGS="--readme-section chaos32" writes its timings into docs/launching.md.
chaos32: $(STAMP)  ## the card's shape, 4 nodes × 8 workers: a node lost, one joining
	$(BIN)/python scripts/chaos.py --nodes 4 --start-nodes 4 --nproc-per-node 8 --store agent \
		--schedule 10:kill-node:3,40:join --global-batch-size 0 --steps 200 --no-reference \
		$(CHAOS_ARGS)

# 3 nodes of 2 workers under a fault every 20-30 s for about ten minutes (a node killed, the lost
# one back, a worker killed, a node preempted, a worker frozen): the seconds each costs the healthy
# nodes, whether any healthy process restarted, and the effective training time (about 13 minutes
# in all with the fault-free calibration). CHURN_ARGS="--readme-section churn --plot docs/churn.png"
# writes the table and the plot into docs/recovery.md.
churn: $(STAMP)  ## 3 nodes × 2 workers, a fault every 20-30 s for 10 minutes
	$(BIN)/python scripts/churn.py $(CHURN_ARGS)

# Machines that fail by the network (root only): 3 nodes of 2 workers, each a host of its own (a
# network namespace with a control and a data link), one case a run: a node SIGKILLed, its links
# cut for 60 s and 5 s, its data link, its control link, one way of its data link, the store, a
# flapping node, a slowed link; what each cost the healthy nodes, against issue 42's targets
# (about 17 minutes on 2 cores). PARTITIONS_ARGS="--cases cut-5" runs one;
# PARTITIONS_ARGS="--readme-section partitions" writes the table into docs/recovery.md.
partitions: $(STAMP)  ## 3 nodes × 2 workers, each a host of its own: links cut, slowed, healed
	$(BIN)/python scripts/partitions.py $(PARTITIONS_ARGS)

# One node of 3 × 2 slowed 1.5x, 2x and 4x (each node a cgroup's third of the cores, node 2's
# quota cut to 1/k; without cgroups a time share by SIGSTOP and SIGCONT; and its data link slowed
# by tc tbf where hosts of their own can be had): the job's throughput
# without mitigation, with --balance, and the ideal, a pair of runs a slowdown; the seconds to
# detection and exactly-once (about 11 minutes on 2 cores). Writes docs/stragglers.png;
# STRAGGLERS_ARGS="--factors 2 --no-tbf" runs one pair (2 to 4 minutes).
stragglers: $(STAMP)  ## 3 nodes × 2 workers, one slowed: what --balance wins back
	$(BIN)/python scripts/stragglers.py --plot docs/stragglers.png $(STRAGGLERS_ARGS)

# The card's shape's node loss again and again: 4 nodes of 8 workers, a node SIGKILLed, REPEATS
# times (about 2 minutes each on 2 cores); each run recovered in process, or the phase of the
# recovery that failed and why. SOAK=kill-torchrun REPEATS=1 is a 2 × 2 smoke of it.
SOAK    ?= kill-32
REPEATS ?= 10
# The coordination store's traffic, simulated for 8 to 8,000 ranks without training (docs/recovery.md,
# "Coordination at scale"). SCALE_ARGS="--readme-section scale --json bench/scale.json" writes it.
scale: $(STAMP)  ## the coordination store's traffic, simulated for 8 to 8,000 ranks
	$(BIN)/python scripts/scale.py $(SCALE_ARGS)

recovery-soak: $(STAMP)  ## the card's shape's node loss, REPEATS (10) times
	$(BIN)/python scripts/recovery.py --soak $(SOAK) --repeats $(REPEATS)

# make bench: every contender on this machine (scripts/bench.py), then docs/performance.md's table
# (BENCH_ARGS="--real-data DIR" adds the real digits' rows).
BENCH_ARGS ?=
bench: $(STAMP)  ## every contender on this machine, then docs/performance.md's table
	$(BIN)/python scripts/bench.py $(BENCH_ARGS)
	$(BIN)/python scripts/bench.py --update-readme

# jobs/slurm.sbatch on a one-node SLURM cluster started here (slurm-wlm and munge installed with
# apt when missing): submitted, preempted, requeued, resumed at the step it stopped, finished;
# prints the timings (about a minute). SLURM_CHECK_ARGS="--steps 1000 --preempt-after 500".
SLURM_CHECK_ARGS ?=
slurm-check: $(STAMP)  ## jobs/slurm.sbatch on a one-node SLURM here: preempted, requeued
	scripts/slurm_local.sh $(BIN)/python scripts/slurm_check.py $(SLURM_CHECK_ARGS)

lint: $(STAMP)  ## ruff over elastic_mnist, scripts and tests
	$(BIN)/ruff check elastic_mnist scripts tests

clean:  ## remove .venv, .venv-torch211 and the build's leftovers
	rm -rf $(VENV) $(VENV211) build *.egg-info

# make help: every target in one line, from the `## ` comment on its rule's line.
help:  ## this list
	@echo 'make TARGET [VAR=value ...]; `make` alone is `make install`. Targets:'
	@sed -n 's/^\([a-z0-9-]*\):.*## \(.*\)$$/\1|\2/p' $(firstword $(MAKEFILE_LIST)) | \
		awk -F'|' '{ printf "  %-15s %s\n", $$1, $$2 }'
