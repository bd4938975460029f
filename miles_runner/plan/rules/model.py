"""The `model.*` description matches the checkpoint the engines and the trainer will load."""

from __future__ import annotations

from collections.abc import Iterator

from miles_runner.config.provenance import format_value
from miles_runner.config.schema import MilesConfig
from miles_runner.plan.derive import Derived, parse_tiny_model
from miles_runner.plan.model_shape import checkpoint_config, shape_mismatches
from miles_runner.plan.rules.base import Finding, rule


@rule("model-matches-checkpoint")
def model_matches_checkpoint(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    tiny = parse_tiny_model(cfg.model.path)
    config = checkpoint_config(d.model_path, tiny[0] if tiny else None)
    if config is None:  # not on this machine: the executor checks it once the model is there
        return
    for name, _, actual in shape_mismatches(cfg.model, config):
        yield Finding(
            (f"model.{name}", "model.path"),
            f"The checkpoint's config has {actual} for model.{name}; the plan would size and check one model "
            "and run another.",
            f"model.{name}={format_value(actual)}",
        )


@rule("served-model-name-has-no-colon")
def served_model_name_has_no_colon(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if ":" in cfg.model.name:
        yield Finding(
            ("model.name",),
            "The engines serve the base model under model.name (--served-model-name); SGLang refuses a colon "
            "there at launch, reserving it for the 'model:adapter' syntax of LoRA requests.",
            f"model.name={cfg.model.name.replace(':', '-')}",
        )
