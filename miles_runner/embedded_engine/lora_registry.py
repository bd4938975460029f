"""Which LoRA adapters are loaded, and the checks (with SGLang's messages) before one is used or loaded.

Names follow SGLang: a request selects an adapter by ``lora_name`` (the ``lora_path`` request field holds
the *name*). The messages below are SGLang's own, since clients match on them:
- unknown name in a request: ``The following requested LoRA adapters are not loaded: X\\nLoaded adapters: ...``
- duplicate load: ``LoRA with name X already exists. Loaded LoRAs: ...``
- unknown unload: ``LoRA with name X does not exist. Loaded LoRAs: ...``

Tensors for ``/load_lora_adapter_from_tensors`` use :func:`tensor_wire.serialize_lora_tensors`.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from miles_runner.embedded_engine.args import ServerArgs
from miles_runner.sglang_client.tensor_wire import serialize_lora_tensors

__all__ = ["LoRARef", "LoRARegistry", "check_adapter_name", "read_adapter_config", "serialize_lora_tensors"]

TENSOR_SOURCE = "__tensor__"  # SGLang's lora_path for adapters that arrived as tensors


@dataclass(frozen=True)
class LoRARef:
    lora_name: str
    lora_path: str
    pinned: bool = False


def read_adapter_config(path: str) -> dict:
    config_file = Path(path) / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"No adapter_config.json found in LoRA path {path}")
    try:
        config = json.loads(config_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"adapter_config.json in LoRA path {path} is not valid JSON: {exc}") from exc
    check_adapter_config(config, f"adapter_config.json in LoRA path {path}")
    return config


def check_adapter_config(config: object, source: str) -> None:
    """The fields the registry and peft read, with the types they need (a wrong one would fail deep inside peft)."""
    if not isinstance(config, dict):
        raise ValueError(f"{source} must be a JSON object, got {type(config).__name__}")
    rank = config.get("r", 8)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{source}: r must be a positive integer, got {rank!r}")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise ValueError(f"{source}: lora_alpha must be a number, got {alpha!r}")
    for key in ("target_modules", "target_parameters"):
        value = config.get(key)
        strings = isinstance(value, list) and all(isinstance(item, str) for item in value)
        if value is not None and not isinstance(value, str) and not strings:
            raise ValueError(f"{source}: {key} must be a string or a list of strings, got {value!r}")


def check_adapter_name(name: str) -> None:
    """An adapter name becomes a key of peft's module dicts, which refuse '' and '.', and the suffix of a request's
    ``model: "base:adapter"``."""
    if not name or "." in name or ":" in name or not name.isprintable() or name != name.strip():
        raise ValueError(
            f"lora_name {name!r} is not a valid adapter name: use a non-empty name without '.', ':', spaces at "
            "either end or control characters"
        )


class LoRARegistry:
    def __init__(self, args: ServerArgs) -> None:
        self.enabled = args.enable_lora
        self.max_lora_rank = args.max_lora_rank
        self.target_modules = (
            None
            if not args.lora_target_modules or "all" in args.lora_target_modules
            else (set(args.lora_target_modules))
        )
        self.max_loaded_loras = args.max_loaded_loras
        self._registry: OrderedDict[str, LoRARef] = OrderedDict()

    def loaded_adapters(self) -> dict[str, str]:
        return {name: ref.lora_path for name, ref in self._registry.items()}

    def refs(self) -> list[LoRARef]:
        return list(self._registry.values())

    def resolve(self, names: list[str | None]) -> None:
        """Raise SGLang's ``ValueError`` for any requested adapter that is not loaded."""
        for name in names:
            if name is None:
                continue
            if not self.enabled:
                raise ValueError(
                    f"LoRA adapter '{name}' was requested, but LoRA is not enabled. "
                    "Please launch the server with --enable-lora."
                )
            if name not in self._registry:
                raise ValueError(
                    f"The following requested LoRA adapters are not loaded: {name}\n"
                    f"Loaded adapters: {self._registry.keys()}."
                )
            self._registry.move_to_end(name)

    def check_new(self, name: str, adapter_config: dict) -> None:
        """Refuse a load that SGLang would refuse (duplicate name, rank or targets beyond the limits)."""
        if not self.enabled:
            raise ValueError("LoRA is not enabled. Please launch the server with --enable-lora.")
        check_adapter_name(name)
        check_adapter_config(adapter_config, "config_dict")
        if name in self._registry:
            raise ValueError(f"LoRA with name {name} already exists. Loaded LoRAs: {self._registry.keys()}")
        if self.max_loaded_loras is not None and len(self._registry) >= self.max_loaded_loras:
            raise ValueError(f"Cannot load LoRA {name}: --max-loaded-loras ({self.max_loaded_loras}) reached.")
        rank = int(adapter_config.get("r", 0))
        if self.max_lora_rank is not None and rank > self.max_lora_rank:
            raise ValueError(f"LoRA adapter {name} has rank {rank}, above --max-lora-rank {self.max_lora_rank}.")
        targets = _target_names(adapter_config)
        if self.target_modules is not None and not targets <= self.target_modules:
            extra = sorted(targets - self.target_modules)
            raise ValueError(f"LoRA adapter {name} targets {extra}, outside --lora-target-modules.")

    def register(self, ref: LoRARef) -> None:
        self._registry[ref.lora_name] = ref

    def unregister(self, name: str) -> LoRARef:
        if name not in self._registry:
            raise ValueError(f"LoRA with name {name} does not exist. Loaded LoRAs: {self._registry.keys()}")
        return self._registry.pop(name)


def _target_names(adapter_config: dict) -> set[str]:
    modules = adapter_config.get("target_modules") or []
    if isinstance(modules, str):  # a regex in peft; cannot be checked name by name
        return set()
    parameters = adapter_config.get("target_parameters") or []
    return {m.rsplit(".", 1)[-1] for m in modules} | {p.rsplit(".", 1)[-1] for p in parameters}
