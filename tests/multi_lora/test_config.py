"""Checks at registration (docs/system.md §4.3 resolve_adapter_config)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from miles_runner.core.adapters import AdapterSpec
from miles_runner.multi_lora.config import (
    AdapterRunConfig,
    plan_overrides,
    resolve_adapter_config,
)

from .helpers import LIMITS, TARGETS, defaults


def resolve(name: str = "a", limits=LIMITS, **overrides):
    return resolve_adapter_config(name, overrides, defaults("/runs/r1"), limits)


def rejection(**overrides) -> str:
    with pytest.raises(ValueError) as caught:
        resolve(**overrides)
    return str(caught.value)


def test_unset_keys_take_the_run_defaults():
    resolved = resolve(rank=4)
    assert (resolved.rank, resolved.alpha, resolved.rollout_batch_size, resolved.task) == (4, 16.0, 4, "arith")
    assert resolved.target_modules == TARGETS


def test_save_folder_defaults_under_the_save_root():
    assert resolve("math").save == "/runs/r1/adapters/math"


def test_adapter_global_batch_size_is_groups_times_samples():
    assert resolve(rollout_batch_size=4, n_samples_per_prompt=2).adapter_global_batch_size == 8


def test_an_unsafe_name_is_rejected():
    with pytest.raises(ValueError, match="path separators"):
        resolve("../etc")


def test_rank_above_the_engines_max_rank_is_rejected():
    assert "exceeds the engines' max LoRA rank 8" in rejection(rank=16)


def test_target_modules_the_engines_do_not_serve_are_rejected():
    assert "['gate_proj'] are not served" in rejection(target_modules=["q_proj", "gate_proj"])


def test_a_batch_over_the_per_adapter_cap_is_rejected():
    assert "exceeds the cap 64" in rejection(rollout_batch_size=32, n_samples_per_prompt=4)


def test_an_undefined_dp_split_is_rejected():
    limits = replace(LIMITS, dp_size=8)
    with pytest.raises(ValueError, match="must divide one another"):
        resolve(limits=limits, n_samples_per_prompt=6, rollout_batch_size=2)


def test_rollout_batch_size_must_be_a_multiple_of_the_dp_split():
    limits = replace(LIMITS, dp_size=8)
    with pytest.raises(ValueError, match="multiple of 2 groups"):
        resolve(limits=limits, n_samples_per_prompt=4, rollout_batch_size=3)


def test_an_unknown_task_or_reward_is_rejected():
    message = rejection(task="chess", reward="elo")
    assert "unknown task 'chess'" in message and "unknown reward 'elo'" in message


def test_unknown_config_keys_are_rejected():
    assert "unknown adapter config keys ['rnk']" in rejection(rnk=8)


@pytest.mark.parametrize(
    "key,value",
    [("rank", 0), ("rank", True), ("rollout_batch_size", 1.5), ("alpha", -1), ("num_step", 0), ("lr", "fast")],
)
def test_bad_numbers_are_rejected(key, value):
    assert f"{key} must be" in rejection(**{key: value})


def test_missing_data_is_rejected():
    assert "'/no/such/data.jsonl' is not a readable file" in rejection(data="/no/such/data.jsonl")


@pytest.mark.reliability
@pytest.mark.parametrize("key,value", [("lr", math.nan), ("alpha", math.inf), ("lr", -math.inf), ("alpha", math.nan)])
def test_nan_and_infinite_numbers_are_rejected_naming_the_field(key, value):
    assert f"{key} must be a finite number > 0, got {value!r}" in rejection(**{key: value})


@pytest.mark.reliability
@pytest.mark.parametrize("save", ["/etc/miles", "../../elsewhere", "..", ".", "/runs/r1", "/runs/r1/adapters", "a\0b"])
def test_a_save_folder_outside_the_runs_adapters_folder_is_rejected(save):
    assert "save must name a folder inside /runs/r1/adapters" in rejection(save=save)


def test_a_relative_save_folder_is_taken_from_the_runs_adapters_folder():
    assert resolve(save="tenant-2").save == "/runs/r1/adapters/tenant-2"
    assert resolve(save="/runs/r1/adapters/x/../y").save == "/runs/r1/adapters/y"


@pytest.mark.reliability
def test_data_outside_the_data_folders_gets_the_answer_of_a_missing_file(tmp_path):
    """The answer must not tell an API caller whether a path exists on the controller's host."""
    outside = tmp_path / "prompts.jsonl"
    outside.write_text('{"prompt": "1", "label": "1"}\n')
    answers = [rejection(data=str(path)) for path in (outside, tmp_path / "missing.jsonl", "/etc")]
    assert (
        len(
            {
                answer.replace(str(path), "PATH")
                for answer, path in zip(answers, (outside, tmp_path / "missing.jsonl", "/etc"), strict=True)
            }
        )
        == 1
    )
    assert "is not a readable file under the controller's data folders" in answers[0]


def test_data_inside_a_data_root_or_bundled_is_accepted(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1", "label": "1"}\n')
    rooted = replace(defaults("/runs/r1"), data_roots=(str(tmp_path),))
    assert resolve_adapter_config("a", {"data": str(prompts)}, rooted, LIMITS).data == str(prompts)
    assert resolve(data="bundled:letters.jsonl").data.endswith("letters.jsonl")


def test_every_problem_is_reported_at_once():
    message = rejection(rank=64, task="chess", target_modules=["mlp"])
    assert "rank 64" in message and "'chess'" in message and "['mlp']" in message


def test_a_plan_adapter_registers_with_its_own_values():
    adapter = AdapterSpec(
        name="rev",
        lora_name="__miles_slot_1",
        rank=4,
        alpha=8.0,
        dropout=0.0,
        target_modules=["q_proj"],
        task="reverse",
        reward="exact_match",
        lr=2e-3,
        rollout_batch_size=2,
        n_samples_per_prompt=4,
        num_step=3,
    )
    resolved = resolve("rev", **plan_overrides(adapter))
    assert resolved == AdapterRunConfig(
        task="reverse",
        reward="exact_match",
        rank=4,
        alpha=8.0,
        target_modules=("q_proj",),
        lr=2e-3,
        rollout_batch_size=2,
        n_samples_per_prompt=4,
        save="/runs/r1/adapters/rev",
        num_step=3,
        data="",
    )
