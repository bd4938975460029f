"""The trainer's interpreter (`trainer.python`): what a hosted trainer runs, and Megatron-Bridge's Python."""

from __future__ import annotations

import functools
import subprocess
from collections.abc import Iterator
from pathlib import Path

from miles_runner.config.schema import MilesConfig
from miles_runner.plan.derive import Derived
from miles_runner.plan.rules.base import BACKEND, LORA_MODE, Finding, rule

NOT_BUILT = ("hosted-trainer-multi-node-not-built",)
PYTHON = "trainer.python"
BRIDGE_FIX = "trainer.python=.venv-bridge/bin/python"  # the side environment `make bridge-env` builds


@rule("hosted-trainer-multi-node-not-built")
def hosted_trainer_multi_node_not_built(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.trainer.python and cfg.cluster.nodes > 1:
        yield Finding(
            (PYTHON, "cluster.nodes"),
            "A trainer in an interpreter of its own runs its ranks on the driver's node only in this release.",
            "trainer.python=''",
        )


@rule("trainer-python-runs-bridge")
def trainer_python_runs_bridge(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    """Checked where the plan will run, a CPU cluster being this machine: a GPU plan compiled on a login node
    runs in the cluster's environment, which this machine cannot see."""
    if not cfg.cluster.cpu_only:
        return
    python = cfg.trainer.python
    if python and "/" in python and not Path(python).expanduser().is_file():
        build = " (`make bridge-env` builds Megatron-Bridge's)" if _bridge(cfg) else ""
        yield Finding(
            (PYTHON,), f"No interpreter at {python}{build}.", BRIDGE_FIX if _bridge(cfg) else "trainer.python=''"
        )
        return
    if _bridge(cfg) and not imports_bridge(python):
        where = python or "the driver's own Python"
        yield Finding(
            (PYTHON, LORA_MODE, BACKEND),
            f"Megatron-Bridge (megatron.bridge) cannot be imported by {where}; it needs Python 3.12 and an "
            "environment of its own (`make bridge-env`), which then hosts the trainer.",
            BRIDGE_FIX,
        )


def _bridge(cfg: MilesConfig) -> bool:
    return cfg.trainer.backend == "megatron" and cfg.trainer.lora_mode == "bridge"


@functools.cache
def imports_bridge(python: str) -> bool:
    """Whether `python` ("" = this interpreter) finds megatron.bridge, without importing it (seconds of CUDA
    probing): its spec only."""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('megatron.bridge') is None)"
    if not python:
        import importlib.util

        try:
            return importlib.util.find_spec("megatron.bridge") is not None
        except ModuleNotFoundError:  # no megatron package at all
            return False
    try:
        return subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
