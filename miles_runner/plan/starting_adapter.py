"""`adapters.path`: a PEFT adapter folder the run starts from, checked against the plan before anything starts.

The trainer loads its weights into the adapter it builds from the plan and the engines load the folder at start,
so the folder must hold an adapter of the plan's shape, trained on the plan's base model.
"""

from __future__ import annotations

import json
from pathlib import Path

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


def starting_adapter_problems(path: str, *, rank: int, alpha: float, targets: list[str], base: str) -> list[str]:
    """What makes the folder at `path` unusable as this plan's starting adapter; [] when it fits."""
    folder = Path(path)
    if not (folder / CONFIG).is_file() or not (folder / WEIGHTS).is_file():
        return [f"{folder} is not a PEFT adapter folder (it needs {CONFIG} and {WEIGHTS})"]
    config = json.loads((folder / CONFIG).read_text())
    problems = []
    if config.get("r") != rank or float(config.get("lora_alpha", 0)) != float(alpha):
        problems.append(
            f"it has rank {config.get('r')} and alpha {config.get('lora_alpha')}; the plan {rank} and {alpha:g}"
        )
    if sorted(config.get("target_modules") or []) != sorted(targets):
        problems.append(f"it targets {sorted(config.get('target_modules') or [])}; the plan {sorted(targets)}")
    trained_on = config.get("base_model_name_or_path")
    if trained_on and Path(trained_on).resolve() != Path(base).resolve():
        problems.append(f"it was trained on {trained_on}; the plan's base is {base}")
    return problems
