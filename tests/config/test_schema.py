"""The typed config: unknown keys and wrong types are errors naming the full key path, with suggestions."""

import pytest

from miles_runner.config.compose import compose
from miles_runner.config.loader import SchemaError, load_dataclass
from miles_runner.config.schema import CHOICES, RENAMED_KEYS, MilesConfig, defaults_tree
from miles_runner.core.errors import PlanError


def problems_of(overrides: list[str]) -> list:
    with pytest.raises(PlanError) as info:
        compose(overrides)
    return info.value.problems


def test_defaults_tree_loads_into_the_schema():
    cfg = load_dataclass(MilesConfig, defaults_tree(), CHOICES)
    assert cfg == MilesConfig()


def test_command_line_typo_names_the_key_and_suggests_the_near_miss():
    [problem] = problems_of(["trainer.parallel.tpp=2"])
    assert problem.rule == "unknown-key"
    assert problem.settings == [("trainer.parallel.tpp", "command line")]
    assert "did you mean 'trainer.parallel.tp'?" in problem.reason


def test_group_name_typo_suggests_the_group():
    [problem] = problems_of(["sesion=v1"])
    assert "did you mean 'session'?" in problem.reason


def test_unknown_group_option_lists_the_options():
    [problem] = problems_of(["session=v3"])
    assert problem.rule == "unknown-option"
    assert "off, v1, v2" in problem.reason


def test_unknown_recipe_suggests_the_nearest_recipe():
    [problem] = problems_of(["+recipe=glm52_lora"])
    assert problem.fix == "+recipe=glm52_lora_agentic"


def test_appended_unknown_key_is_rejected_with_its_full_path():
    [problem] = problems_of(["+trainer.paralel.tp=2"])
    assert problem.settings[0][0] == "trainer.paralel"
    assert "did you mean 'parallel'?" in problem.reason
    assert problem.settings[0][1] == "command line"


def test_wrong_type_names_the_full_path_and_the_expected_type():
    [problem] = problems_of(["trainer.parallel.tp=eight"])
    assert problem.settings == [("trainer.parallel.tp", "command line")]
    assert "expected int" in problem.reason


def test_invalid_choice_in_an_enum_field_suggests_a_valid_one():
    [problem] = problems_of(["weight_sync.pause_generation_mode=in-place"])
    assert "did you mean 'in_place'?" in problem.reason
    assert problem.fix == "weight_sync.pause_generation_mode=in_place"


def test_all_schema_problems_are_reported_at_once():
    problems = problems_of(["+foo=1", "trainer.parallel.tp=x", "rollout.temperature=hot"])
    assert {p.settings[0][0] for p in problems} == {"foo", "trainer.parallel.tp", "rollout.temperature"}


def test_unknown_key_inside_a_list_item_is_reported_with_its_index():
    with pytest.raises(SchemaError) as info:
        load_dataclass(MilesConfig, {"adapters": {"runs": [{"name": "a"}, {"nmae": "b"}]}}, CHOICES)
    [issue] = info.value.issues
    assert issue.path == "adapters.runs[1].nmae"
    assert issue.hint == "did you mean 'name'?"


def test_bool_field_rejects_a_string():
    with pytest.raises(SchemaError, match=r"run\.resume: expected bool"):
        load_dataclass(MilesConfig, {"run": {"resume": "yes"}}, CHOICES)


def test_comma_string_becomes_a_list_for_list_fields():
    cfg = compose(["adapters.target_modules='q_proj,v_proj'"]).config
    assert cfg.adapters.target_modules == ["q_proj", "v_proj"]


def test_unquoted_comma_value_explains_list_string_and_sweep():
    [problem] = problems_of(["adapters.target_modules=q_proj,v_proj"])
    assert "use key=[value1,value2]" in problem.reason and "--multirun" in problem.reason


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("rollout.driver", "rollout.schedule"),
        ("cluster.cpu_slots_per_node", "cluster.cpu_devices_per_node"),
        ("lora.mode", "trainer.lora_mode"),
    ],
)
def test_a_renamed_key_on_the_command_line_names_the_new_key_with_the_value(old, new):
    [problem] = problems_of([f"{old}=async"])
    assert problem.rule == "unknown-key"
    assert problem.settings == [(old, "command line")]
    assert f"renamed: did you mean '{new}'?" in problem.reason
    assert problem.fix == f"{new}=async"


def test_a_renamed_key_appended_or_in_a_file_names_the_new_key():
    [problem] = problems_of(["+rollout.driver=async"])
    assert problem.settings[0][0] == "rollout.driver"
    assert problem.fix == "rename it to rollout.schedule"


def test_an_old_section_holding_a_renamed_key_is_reported_at_the_old_key():
    with pytest.raises(SchemaError) as info:
        load_dataclass(MilesConfig, {"lora": {"mode": "raw"}}, CHOICES, RENAMED_KEYS)
    [issue] = info.value.issues
    assert issue.path == "lora.mode"
    assert issue.hint == "renamed: did you mean 'trainer.lora_mode'?"
