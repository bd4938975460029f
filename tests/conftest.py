"""Test-wide environment: everything stays on loopback and offline, and built tiny models are cached once in
the checkout (`.cache/`, as `make` sets it) instead of in the user's cache folder."""

import os
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MILES_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache"))
