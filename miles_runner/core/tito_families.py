"""The TITO families (`session.tito_model`, miles' TITOTokenizer subclasses), as data that the plan rules and the
session server (session/tito.py, which adds each family's merge rule) both read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TitoFamily:
    name: str
    template_file: str | None = None  # under session/templates/; None: the model's own chat template
    pinned_kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs the family renders with
    required_tokens: tuple[str, ...] = ()  # special tokens the model's tokenizer must have
    append_assistant: bool = False  # an agent may append assistant messages after a generated turn
    max_trim_tokens: int = 0  # stored tokens the next prompt may drop at a turn boundary


NO_THINKING_CLEARED = {"clear_thinking": False}  # past reasoning stays in the render, so it is append-only

TITO_FAMILIES: dict[str, TitoFamily] = {
    family.name: family
    for family in (
        TitoFamily("default"),
        TitoFamily(
            "qwen3",
            template_file="qwen3_fixed.jinja",
            pinned_kwargs=NO_THINKING_CLEARED,
            required_tokens=("<|im_start|>", "<|im_end|>"),
            append_assistant=True,
        ),
        TitoFamily(
            "glm47",
            pinned_kwargs=NO_THINKING_CLEARED,
            required_tokens=("<|user|>", "<|observation|>", "<|assistant|>"),
            append_assistant=True,
            max_trim_tokens=1,
        ),
    )
}


def tito_family(name: str) -> TitoFamily:
    if name not in TITO_FAMILIES:
        raise ValueError(f"tito_model must be one of {sorted(TITO_FAMILIES)}, got {name!r}")
    return TITO_FAMILIES[name]
