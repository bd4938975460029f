"""The run folder's record of what was planned: plan.yaml, the resolved config.yaml and provenance.json, and of the
ports chosen at start (ports.json)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import platform
import subprocess
import sys
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from miles_runner.config.compose import ComposedConfig
from miles_runner.core.faults import active_fault_switches
from miles_runner.core.sglang_protocol import SGLANG_VERSION
from miles_runner.plan.model import PORTS_FILE, Plan, plan_from_dict, plan_to_dict, plan_with_ports

TRACKED_PACKAGES = (
    "miles-runner",
    "hydra-core",
    "omegaconf",
    "torch",
    "transformers",
    "peft",
    "ray",
    "sglang",
    "sglang-router",
    "megatron-core",
    "wandb",
    "fastapi",
    "uvicorn",
    "httpx",
    "aiohttp",
)


def new_run_dir(root: str | Path = "outputs") -> Path:
    """outputs/YYYY-MM-DD/HH-MM-SS (Hydra's layout), with a suffix if two runs start in the same second."""
    now = dt.datetime.now()
    base = Path(root) / now.strftime("%Y-%m-%d") / now.strftime("%H-%M-%S")
    candidate, n = base, 1
    while candidate.exists():
        candidate, n = base.with_name(f"{base.name}-{n}"), n + 1
    candidate.mkdir(parents=True)
    return candidate


def write_run_record(run_dir: Path, composed: ComposedConfig, plan: Plan, argv: list[str]) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    plan_path = run_dir / "plan.yaml"
    plan_path.write_text(yaml.safe_dump(plan_to_dict(plan), sort_keys=False))
    (run_dir / "config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(composed.config), sort_keys=False))
    (run_dir / "provenance.json").write_text(json.dumps(provenance_record(composed, argv), indent=2))
    return plan_path


def read_plan(path: str | Path) -> Plan:
    return plan_from_dict(yaml.safe_load(Path(path).read_text()))


def read_started_plan(path: str | Path) -> Plan:
    """A plan.yaml with the ports chosen at start (the ports.json beside it) filled in: the plan as it runs, for
    what starts after the executor (the multi-LoRA controller reads the engines' URLs from it)."""
    return plan_with_ports(read_plan(path), read_ports(Path(path).parent))


def write_ports(run_dir: Path, ports: Mapping[str, int], *, add: bool = False) -> None:
    """Record the ports chosen at start (`add`: to those recorded by this start so far)."""
    recorded = {**(read_ports(run_dir) if add else {}), **ports}
    if recorded:
        (run_dir / PORTS_FILE).write_text(json.dumps(dict(sorted(recorded.items())), indent=1) + "\n")


def read_ports(run_dir: Path) -> dict[str, int]:
    path = Path(run_dir) / PORTS_FILE
    return {name: int(port) for name, port in json.loads(path.read_text()).items()} if path.exists() else {}


def provenance_record(composed: ComposedConfig, argv: list[str]) -> dict[str, Any]:
    p = composed.provenance
    return {
        "created": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "argv": argv,
        "recipe": composed.recipe,
        "overrides": composed.overrides,
        "config_searchpath": list(composed.searchpath),
        "choices": {g: {"option": p.choices[g], "from": str(o)} for g, o in sorted(p.choice_origins.items())},
        "git": git_state(),
        "fault_switches": active_fault_switches(),  # set only by fault-injection tests
        # The SGLang protocol the runner speaks (the gpu extra's pin); plan.yaml says whether the engines are the
        # stock release or the sglang-miles fork (engines[].build).
        "sglang_protocol_version": SGLANG_VERSION,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": package_versions(),
    }


def git_state(where: str | Path | None = None) -> dict[str, Any]:
    """The git checkout holding `where` (default: the working directory): its top folder, commit and whether it
    has uncommitted changes; all None outside a checkout or without git. An installed miles-runner is no
    checkout, so this records the user's experiment repository, if they run from one."""
    folder = Path.cwd() if where is None else Path(where)
    top = git_output(folder, "rev-parse", "--show-toplevel")
    commit = git_output(folder, "rev-parse", "--verify", "HEAD") if top else None
    dirty = git_output(folder, "status", "--porcelain") if commit else None
    return {"repo": top, "commit": commit, "dirty": bool(dirty) if dirty is not None else None}


def git_output(folder: Path, *args: str) -> str | None:
    """`git ARGS` run in `folder`: its stripped output, or None when git is missing, fails or hangs."""
    try:
        done = subprocess.run(["git", *args], cwd=folder, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in TRACKED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions
