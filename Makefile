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

.PHONY: install run plan test test-fast lint layers bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and explicitly: the CPU build of 2.13.0 is served locally; a range would pull CUDA.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/miles-run +recipe=tiny_lora_agentic $(ARGS)

plan: $(STAMP)
	$(BIN)/miles-run +recipe=tiny_lora_agentic --plan $(ARGS)

test: layers
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-fast: layers
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
