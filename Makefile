# Every target installs what it needs first (idempotent: the stamp changes only when pyproject.toml does).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export WANDB_MODE ?= offline
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# Built tiny models: one cache in the checkout (git-ignored) that every test, run and CI job reuses; an
# installed miles-run defaults to ~/.cache/miles-runner.
export MILES_CACHE_DIR ?= $(CURDIR)/.cache

.PHONY: install run plan test test-fast tiny-models bytecode lint layers sglang-spec bridge-env bridge-test bench bench-peers clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and explicitly: the CPU build of 2.13.0 is served locally; a range would pull CUDA.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# The pinned SGLang's own request definitions (io_struct.py, http_server.py, openai/protocol.py), which the wire-format
# tests check every request body against: its wheel, downloaded without dependencies and only read (never installed
# or imported). One Linux wheel whatever the host: only its Python source is read. The pin is pyproject's gpu extra.
SGLANG_PIN := $(shell sed -n 's/.*"sglang==\([^"]*\)".*/\1/p' pyproject.toml)
SGLANG_SPEC := $(MILES_CACHE_DIR)/sglang-$(SGLANG_PIN)/.downloaded

$(SGLANG_SPEC): pyproject.toml | $(STAMP)
	$(BIN)/pip download -q --no-deps --only-binary=:all: --platform manylinux_2_34_x86_64 --python-version 3.11 \
		-d $(dir $@) sglang==$(SGLANG_PIN)
	touch $@

sglang-spec: $(SGLANG_SPEC)

# The Megatron-Bridge side environment (trainer lora_mode=bridge; tests/trainer/megatron/bridge): megatron-bridge
# 0.6.2 needs Python 3.12 (the main venv is 3.11), so it gets its own venv, used only by those tests. Its pins are
# pyproject's (megatron-bridge: the gpu extra; megatron-core: the python_version >= '3.12' dependency).
BRIDGE_VENV := .venv-bridge
BRIDGE_BIN := $(BRIDGE_VENV)/bin
BRIDGE_STAMP := $(BRIDGE_VENV)/.installed
BRIDGE_PY ?= python3.12
BRIDGE_PIN := $(shell sed -n 's/.*"megatron-bridge==\([^";]*\).*/\1/p' pyproject.toml)
BRIDGE_MCORE_PIN := $(shell sed -n "s/.*\"megatron-core==\([^\";]*\); python_version >= '3.12'.*/\1/p" pyproject.toml)

$(BRIDGE_STAMP): pyproject.toml Makefile
	# PYENV_VERSION picks pyenv's 3.12 where python3.12 is a pyenv shim; elsewhere it is ignored.
	test -x $(BRIDGE_BIN)/python || PYENV_VERSION=3.12 $(BRIDGE_PY) -m venv $(BRIDGE_VENV)
	$(BRIDGE_BIN)/pip install -q --upgrade pip
	# torch 2.9.1 is a CUDA build (PyPI serves no CPU build for 3.12; the local CPU wheel is 3.11 only): it runs on
	# CPU but brings ~3 GB of nvidia wheels. It is the oldest that works here: megatron-core imports triton, and
	# torch <= 2.7's triton (<= 3.3) raises at import without a GPU driver; torch 2.8 has no CPU grouped_mm, which
	# transformers' Qwen3-MoE experts (the HF reference) call on CPU.
	$(BRIDGE_BIN)/pip install -q torch==2.9.1
	# megatron-bridge without its dependencies (a plain install compiles fast-hadamard-transform and pulls Transformer
	# Engine, flashinfer, megatron-core[dev], ...): exactly what its import and LoRA need, transformers within its
	# range (<= 5.12.1), the test runner, and this project (no deps: it imports only torch, numpy and the above).
	$(BRIDGE_BIN)/pip install -q megatron-core==$(BRIDGE_MCORE_PIN) transformers==5.12.1 peft safetensors omegaconf \
		einops six pybase64 pytest pytest-timeout
	$(BRIDGE_BIN)/pip install -q --no-deps megatron-bridge==$(BRIDGE_PIN)
	$(BRIDGE_BIN)/pip install -q --no-deps -e .
	touch $@

bridge-env: $(BRIDGE_STAMP)

# The tiny models are built by the main venv first (the cache is shared; its transformers sets the weights).
bridge-test: bridge-env tiny-models
	$(BRIDGE_BIN)/python -m pytest -q tests/trainer/megatron/bridge $(BRIDGE_PYTEST_ARGS)

run: $(STAMP)
	$(BIN)/miles-run +recipe=tiny_lora_agentic $(ARGS)

plan: $(STAMP)
	$(BIN)/miles-run +recipe=tiny_lora_agentic --plan $(ARGS)

# pytest rewrites the asserts of every test module it imports, in every worker, and keeps the result only where it
# may write bytecode: with PYTHONDONTWRITEBYTECODE set (as on CI machines) each run re-rewrote all ~530 modules, 8 of
# a worker's 23 s of start-up. Cleared for the test run only (the rewritten files go to tests' __pycache__, ignored).
PYTEST := PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest

# The Megatron-Bridge tests run in their side environment (a main-venv pytest skips them), alongside the main suite,
# at nice 10 so that they take what the workers leave; their output is printed once the main suite ends.
# Three workers on 2 cores: a test that waits (a server's start or stop, a timeout it proves, the Slurm scheduler)
# leaves its core to the other two. Interleaved, one tree, one evening: 7:49-8:36 over five runs with three (median
# 8:18) against 8:24 and 9:55 with two (nine earlier runs of two: 8:58-12:56, median 10:14), and 7:39 in one run with
# four, following the machine's drifting speed (README, Development). With two, a quarter of the cores sat idle in the
# last 3 minutes, where the short tests that wait run; with three, 3.5-4% over the whole run (four: 1.7%, and 2 GiB
# more memory). Each test gets less of a core: the default recipe's learning proof, the slowest, took 90-101 s over
# the five runs with three against 60 and 80 s in the two with two (126 s with four), under its 900 s timeout.
# (Two days earlier, when the suite took ~1,300 busy core-seconds against ~900 now, three workers were slower:
# 11:48-13:15 against 9:06-10:10 for the main suite, the longest tests 40-80% slower.) --durations: every run prints
# its 15 slowest tests (where the suite's time goes). The components, drivers and worker ranks the tests start fork
# from a warm start server per worker (tests/conftest.py, tests/drivers.py). Each test file stays on one worker
# (--dist loadfile), so a module's shared run or server starts once and the local Slurm cluster (tests/slurm, one
# file) has one owner; the Slurm file and then files with slow tests go first (tests/conftest.py;
# --no-loadscope-reorder keeps that order).
# TEST_WORKERS=0: one process.
TEST_WORKERS ?= 3
test: layers sglang-spec bridge-env tiny-models bytecode
	bridge_log=$$(mktemp); nice -n 10 $(MAKE) --no-print-directory bridge-test > $$bridge_log 2>&1 & bridge=$$!; \
	$(PYTEST) -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 \
		--ignore=tests/trainer/megatron/bridge $(PYTEST_ARGS); main=$$?; \
	wait $$bridge; bridge_rc=$$?; echo "--- the Megatron-Bridge tests (run alongside the main suite):"; \
	cat $$bridge_log; rm -f $$bridge_log; test $$main = 0 && test $$bridge_rc = 0

# The tiny models the tests run (the main venv's transformers sets their weights), built once before the workers
# start: a build inside a test counts against its timeout, and workers that each need one would build it side by side
# (a fresh clone's first run-tests waited minutes for one another's format pre-training). Cached: a no-op once built.
tiny-models: $(STAMP)
	$(BIN)/python -c "from miles_runner.models.format_pretrain import ensure_format_pretrained as f; \
		from miles_runner.models.tiny_model import ensure_tiny_model as t; t('tiny-dense'); f('tiny-moe')"

# Bytecode of the project's own modules, which every test process, run, engine and server imports: written once here
# (only what changed since) because nothing else writes it where PYTHONDONTWRITEBYTECODE is set, as on CI machines.
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q -j 0 miles_runner hydra_plugins miles_testkit bench tests > /dev/null

# The inner loop (under 2 minutes on 2 cores: 52 s; 1:17, and 2:24 on slower days): the unit tests, no servers,
# processes or training runs, spread over one worker per core. Hydra composition is most of it: the workers share
# their composed configs (tests/compiled.py).
test-fast: layers sglang-spec bytecode
	$(PYTEST) -q -n auto -m "not slow and not slurm and not integration" $(PYTEST_ARGS)

lint: layers
	$(BIN)/ruff check .

# The package's layers and no import circles (import-linter contracts in pyproject.toml, docs/ARCHITECTURE.md).
layers: $(STAMP)
	$(BIN)/lint-imports --no-cache

bench: $(STAMP)
	$(BIN)/python -m bench.run_all

# miles-run against TRL's GRPOTrainer + peft on the same work (bench/peers, BENCHMARKS.md). TRL is never a dependency
# of the project: it lives in a side venv of its own, with these pins (versions that work together), torch first and
# explicitly as for the main venv, and this project without dependencies (the TRL side calls its task and reward).
PEERS_VENV := .venv-peers
PEERS_BIN := $(PEERS_VENV)/bin
PEERS_STAMP := $(PEERS_VENV)/.installed
PEERS_PY ?= python3.11
PEERS_PINS := trl==1.16.0 peft==0.21.2 transformers==5.24.0 accelerate==1.15.0 datasets==5.2.0

$(PEERS_STAMP): pyproject.toml Makefile
	test -x $(PEERS_BIN)/python || PYENV_VERSION=3.11 $(PEERS_PY) -m venv $(PEERS_VENV)
	$(PEERS_BIN)/pip install -q --upgrade pip
	$(PEERS_BIN)/pip install -q torch==2.13.0
	$(PEERS_BIN)/pip install -q $(PEERS_PINS)
	$(PEERS_BIN)/pip install -q --no-deps -e .
	touch $@

# Quick check, leaving BENCHMARKS.md alone: PEERS_ARGS="--runs 1 --steps 3 --out /tmp/peers.md --results /tmp/peers"
bench-peers: $(PEERS_STAMP) $(STAMP)
	$(BIN)/python -m bench.peers.run $(PEERS_ARGS)

clean:
	rm -rf outputs multirun .pytest_cache
