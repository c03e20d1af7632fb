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

.PHONY: install train test test-fast tensorboard chaos lint clean bench

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -e '.[test,dev]'
	touch $(STAMP)

train: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH jobs/local.sh --data-dir $(DATA_DIR) --synthetic-fallback \
		--checkpoint-dir $(CHECKPOINT_DIR) --logdir $(LOGDIR) $(TRAIN_ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

tensorboard: $(STAMP)
	$(BIN)/tensorboard --logdir $(LOGDIR) --port $(PORT) --bind_all

# Simulated nodes on loopback, random faults (CHAOS_ARGS="--seed 3 --faults 8" for others).
chaos: $(STAMP)
	$(BIN)/python scripts/chaos.py $(CHAOS_ARGS)

# make bench: every contender on this machine (scripts/bench.py), then the README's table
# (BENCH_ARGS="--real-data DIR" adds the real digits' rows).
BENCH_ARGS ?=
bench: $(STAMP)
	$(BIN)/python scripts/bench.py $(BENCH_ARGS)
	$(BIN)/python scripts/bench.py --update-readme

lint: $(STAMP)
	$(BIN)/ruff check elastic_mnist scripts tests

clean:
	rm -rf $(VENV) build *.egg-info
