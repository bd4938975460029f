"""Configuration of one session server process: everything it needs, decided before it starts."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from miles_runner.core.tito_families import tito_family
from miles_runner.session.messages import resolve_matcher
from miles_runner.sglang_client.chat_as_generate import MODEL_DEFAULT_FIELDS

SessionVersion = Literal["v1", "v2"]


@dataclass(frozen=True)
class SessionServerConfig:
    # The (first) engine, or with `behind_router` the sglang-router whose workers serve the sessions (upstream.py).
    engine_url: str
    model_path: str
    version: SessionVersion = "v1"
    # Adapter name sent as `lora_path` on every turn (None: the base model serves the sessions).
    lora_name: str | None = None
    # Ask the engine for MoE routing (R3) on every turn and assemble it into samples.
    return_routed_experts: bool = False
    # Request only the routing rows after the checkpoint (derived from pause_generation_mode == in_place).
    use_addition_r3: bool = False
    max_trim_tokens: int = 0
    upstream_timeout_s: float = 600.0
    upstream_api_key: str | None = None
    # The run's key: every route but GET /health requires `Authorization: Bearer <api_key>` (None: open).
    api_key: str | None = None
    # Limits (plan: session.max_sessions, session.max_age_s): more open sessions is a 429; an older one is gone.
    max_sessions: int = 1024
    max_age_s: float = 3600.0
    host: str = "127.0.0.1"
    port: int = 0
    instance_id: str | None = None
    # Decoder layers of the served model (rows of the R3 tensor); read from config.json when None.
    num_layers: int | None = None
    behind_router: bool = False
    # Without a router: every engine the sessions are spread over (empty: `engine_url` alone).
    engine_urls: tuple[str, ...] = ()
    # The TITO family (tito.py): the chat template, its pinned kwargs and how a turn's suffix joins the stored ids.
    tito_model: str = "default"
    # Whether a replayed message is the stored one (messages.py): strict, loose_tool_call or role_content_only.
    message_matcher: str = "strict"

    def __post_init__(self) -> None:
        if self.version not in ("v1", "v2"):
            raise ValueError(f"session version must be v1 or v2, got {self.version!r}")
        resolve_matcher(self.message_matcher)
        family = tito_family(self.tito_model)
        if self.max_trim_tokens < family.max_trim_tokens:
            raise ValueError(
                f"tito_model {self.tito_model} drops up to {family.max_trim_tokens} stored token(s) at a turn "
                f"boundary; max_trim_tokens must be at least that, got {self.max_trim_tokens}"
            )
        if self.use_addition_r3 and not self.return_routed_experts:
            raise ValueError("use_addition_r3 needs return_routed_experts (incremental R3 without R3)")
        if self.max_trim_tokens < 0:
            raise ValueError(f"max_trim_tokens must be >= 0, got {self.max_trim_tokens}")
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {self.max_sessions}")
        if not 0 < self.max_age_s < math.inf:
            raise ValueError(f"max_age_s must be a positive number of seconds, got {self.max_age_s}")

    def resolved_num_layers(self) -> int:
        if self.num_layers is not None:
            return self.num_layers
        return read_num_layers(Path(self.model_path))


def read_sampling_defaults(model_dir: Path) -> dict[str, Any]:
    """The sampling values the model's generation_config.json sets, which SGLang's chat (under its default
    --sampling-defaults model) uses for the ones a request leaves unset."""
    path = model_dir / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    return {key: config[key] for key in MODEL_DEFAULT_FIELDS if config.get(key) is not None}


def read_num_layers(model_dir: Path) -> int:
    """`num_hidden_layers` of an HF model dir, looking inside `text_config` for multimodal configs."""
    config = json.loads((model_dir / "config.json").read_text())
    text_config = config.get("text_config") or config
    return int(text_config["num_hidden_layers"])


@dataclass(frozen=True)
class AdapterSlot:
    """The multi-LoRA adapter a session generates with (POST /sessions {"adapter": {...}}).

    Every turn is sent with `lora_path` = the slot, `rid` = "{name}::{uuid}" (so the controller can abort
    all of an adapter's requests by the "{name}::" prefix) and `extra_key` = "{name}:v{version}" (so cached
    prefixes are never shared across adapter versions).
    """

    name: str
    lora_name: str
    version: int

    def __post_init__(self) -> None:
        if not self.name or "::" in self.name:
            raise ValueError(f"adapter name must be non-empty and contain no '::', got {self.name!r}")
        if not self.lora_name:
            raise ValueError("adapter lora_name must be non-empty")
        if self.version < 0:
            raise ValueError(f"adapter version must be >= 0, got {self.version}")

    @classmethod
    def from_json(cls, value: object) -> AdapterSlot:
        if not isinstance(value, dict) or set(value) - {"name", "lora_name", "version"}:
            raise ValueError('adapter must be an object {"name", "lora_name", "version"}')
        name, lora_name, version = value.get("name"), value.get("lora_name"), value.get("version", 0)
        if not isinstance(name, str) or not isinstance(lora_name, str) or type(version) is not int:
            raise ValueError("adapter name and lora_name must be strings and version an integer")
        return cls(name, lora_name, version)
