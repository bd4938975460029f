"""adapters.path: the starting adapter must have the plan's shape and come from the plan's base model."""

import json

import pytest

from miles_runner.config.compose import compose
from miles_runner.core.errors import PlanError
from miles_runner.plan.compile import compile_plan


def adapter_folder(tmp_path, **config):
    folder = tmp_path / "adapter"
    folder.mkdir()
    base = compile_plan(compose([])).model_path
    defaults = {
        "r": 8,
        "lora_alpha": 16.0,
        "target_modules": ["v_proj", "q_proj", "o_proj", "k_proj"],
        "base_model_name_or_path": base,
    }
    (folder / "adapter_config.json").write_text(json.dumps({**defaults, **config}))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    return folder


def reasons(overrides: list[str]) -> list[str]:
    with pytest.raises(PlanError) as error:
        compile_plan(compose(overrides))
    return [p.reason for p in error.value.problems if p.rule == "starting-adapter-fits-plan"]


def test_a_fitting_adapter_starts_the_trainer_and_the_engines(tmp_path):
    folder = adapter_folder(tmp_path)
    plan = compile_plan(compose([f"adapters.path={folder}"]))
    assert plan.adapters[0].init_path == str(folder)
    assert f"miles_lora={folder}" in plan.engines[0].launch.argv


@pytest.mark.parametrize(
    ("config", "said"),
    [
        ({"r": 16}, "rank 16"),
        ({"target_modules": ["q_proj"]}, "targets ['q_proj']"),
        ({"base_model_name_or_path": "/models/other"}, "trained on /models/other"),
    ],
)
def test_an_adapter_of_another_shape_or_base_is_refused(tmp_path, config, said):
    folder = adapter_folder(tmp_path, **config)
    [reason] = reasons([f"adapters.path={folder}"])
    assert said in reason
