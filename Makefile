# Every target installs what it needs first (idempotent: the stamp changes only when pyproject.toml does).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export WANDB_MODE ?= offline
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# Built tiny models (and the SGLang wheel below): the checkout's git-ignored .cache/, which is also where miles-run
# run from this checkout keeps them by itself (miles_runner/core/paths.py), so every test, run, CI job and the README's
# .venv/bin/miles-run commands reuse one build. A MILES_CACHE_DIR set in the environment wins in both.
export MILES_CACHE_DIR ?= $(CURDIR)/.cache

.PHONY: install run plan test test-fast tiny-models bytecode check lint layers sglang-spec bridge-env bridge-test bench bench-peers clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and explicitly: the CPU build of 2.13.0 is served locally; a range would pull CUDA.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# The pinned SGLang's wheel (pyproject's gpu extra), downloaded without dependencies and only read, never installed:
# the wire-format tests check every request body against its own request definitions.
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
HYDRA_PIN := $(shell sed -n 's/.*"hydra-core==\([^"]*\)".*/\1/p' pyproject.toml)

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
	# range (<= 5.12.1), the test runner, and this project (no deps: it imports only torch, numpy and the above, and
	# hydra-core, which reading a plan needs when this environment hosts a run's trainer: trainer.python).
	$(BRIDGE_BIN)/pip install -q megatron-core==$(BRIDGE_MCORE_PIN) transformers==5.12.1 peft safetensors omegaconf \
		einops six pybase64 pytest pytest-timeout hydra-core==$(HYDRA_PIN)
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

# pytest keeps its assert-rewritten test modules only where it may write bytecode: with PYTHONDONTWRITEBYTECODE set
# (as on CI machines) every worker would rewrite them all again. Cleared for the test run only (git-ignored caches).
PYTEST := PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest

# Three workers on 2 cores: a test that waits (a server, a timeout it proves, the Slurm scheduler) leaves its core to
# the others. Files stay on one worker (shared servers start once; the Slurm file has one owner), the Slurm file and
# slow files first (tests/conftest.py). The Bridge tests run alongside at nice 10. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 3
test: check sglang-spec bridge-env tiny-models bytecode
	bridge_log=$$(mktemp); nice -n 10 $(MAKE) --no-print-directory bridge-test > $$bridge_log 2>&1 & bridge=$$!; \
	$(PYTEST) -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 \
		--ignore=tests/trainer/megatron/bridge $(PYTEST_ARGS); main=$$?; \
	wait $$bridge; bridge_rc=$$?; echo "--- the Megatron-Bridge tests (run alongside the main suite):"; \
	cat $$bridge_log; rm -f $$bridge_log; test $$main = 0 && test $$bridge_rc = 0

# The tiny models the tests run, built once before the workers start: a build inside a test counts against its
# timeout, and workers would otherwise build them side by side. Cached: a no-op once built.
tiny-models: $(STAMP)
	$(BIN)/python -c "from miles_runner.models.format_pretrain import ensure_format_pretrained as f; \
		from miles_runner.models.tiny_model import ensure_tiny_model as t; t('tiny-dense'); f('tiny-glm5'); f('tiny-moe')"

# Bytecode of the project's own modules, which every test process, run, engine and server imports: written once here
# (only what changed since) because nothing else writes it where PYTHONDONTWRITEBYTECODE is set, as on CI machines.
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q -j 0 miles_runner hydra_plugins miles_testkit bench tests > /dev/null

# The inner loop: the unit tests only (no servers, processes or training runs), one worker per core. Hydra
# composition is most of it, so the workers share their composed configs (tests/compiled.py).
test-fast: check sglang-spec bytecode
	$(PYTEST) -q -n auto -m "not slow and not slurm and not integration" $(PYTEST_ARGS)

# What every test run checks first, statically: lint, formatting, types (pyproject's [tool.mypy]: strict on core,
# config and plan) and the layers. .pre-commit-config.yaml runs the same commands.
check: layers
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

lint: check

# The package's layers and no import circles (import-linter contracts in pyproject.toml, docs/ARCHITECTURE.md).
layers: $(STAMP)
	$(BIN)/lint-imports --no-cache

bench: $(STAMP) bridge-env
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
