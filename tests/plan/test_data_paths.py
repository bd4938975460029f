"""Prompt files in a plan are absolute (servers run in the run folder), and `bundled:NAME` names a prompt set
shipped with the package."""

from pathlib import Path

from miles_runner.config.compose import compose
from miles_runner.plan.compile import compile_plan
from miles_runner.plan.derive import resolve_data_path


def test_a_bundled_prompt_set_resolves_to_the_file_the_package_ships():
    path = Path(resolve_data_path("bundled:letters.jsonl"))
    assert path.is_file() and path.parent.name == "data" and path.parent.parent.name == "plugins"


def test_relative_paths_become_absolute_and_empty_stays_empty(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_data_path("prompts/train.jsonl") == str(tmp_path / "prompts" / "train.jsonl")
    assert resolve_data_path("/data/x.jsonl") == "/data/x.jsonl"
    assert resolve_data_path("") == ""


def test_the_plan_carries_each_adapters_resolved_data_file():
    plan = compile_plan(compose(["+recipe=tiny_multi_lora"]))
    [letters] = [a for a in plan.adapters if a.name == "letters"]
    assert letters.task == "jsonl" and Path(letters.data).is_absolute() and Path(letters.data).is_file()
