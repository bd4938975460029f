# Every target installs what it needs first (idempotent: the stamp changes only when pyproject.toml does).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export WANDB_MODE ?= offline
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install run plan test test-fast lint bench clean

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

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not slurm" $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python -m bench.run_all

clean:
	rm -rf outputs multirun .pytest_cache
