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

.PHONY: install run plan test test-fast lint layers sglang-spec bench clean

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

run: $(STAMP)
	$(BIN)/miles-run +recipe=tiny_lora_agentic $(ARGS)

plan: $(STAMP)
	$(BIN)/miles-run +recipe=tiny_lora_agentic --plan $(ARGS)

test: layers sglang-spec
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-fast: layers sglang-spec
	$(BIN)/python -m pytest -q -m "not slow and not slurm" $(PYTEST_ARGS)

lint: layers
	$(BIN)/ruff check .

# The package's layers and no import circles (import-linter contracts in pyproject.toml, docs/ARCHITECTURE.md).
layers: $(STAMP)
	$(BIN)/lint-imports --no-cache

bench: $(STAMP)
	$(BIN)/python -m bench.run_all

clean:
	rm -rf outputs multirun .pytest_cache
