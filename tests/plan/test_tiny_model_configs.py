"""The model groups of the embedded tiny models describe the folders the factory actually builds."""

import json

import pytest
import yaml

from miles_runner.config.compose import CONF_DIR
from miles_runner.models.tiny_model import ensure_tiny_model


@pytest.mark.parametrize(("option", "name"), [("tiny_moe", "tiny-moe"), ("tiny_dense", "tiny-dense")])
def test_tiny_model_group_matches_the_built_config(option, name):
    declared = yaml.safe_load((CONF_DIR / "model" / f"{option}.yaml").read_text())
    built = json.loads((ensure_tiny_model(name) / "config.json").read_text())
    assert declared["num_layers"] == built["num_hidden_layers"]
    assert declared["hidden_size"] == built["hidden_size"]
    assert declared["num_attention_heads"] == built["num_attention_heads"]
    assert declared["vocab_size"] == built["vocab_size"]
    assert declared["num_experts"] == (built.get("num_local_experts") or built.get("num_experts") or 0)
    assert declared["moe_topk"] == (built.get("num_experts_per_tok", 0) if declared["num_experts"] else 0)
