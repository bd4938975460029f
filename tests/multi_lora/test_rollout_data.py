"""Each adapter samples its own prompts: from its own data file when its task reads one
(docs/system.md §4.6: a data source per adapter, and `resolve_num_step` from the data set's length)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from miles_runner.multi_lora.cache import AdaptersCache, in_process
from miles_runner.multi_lora.registry import RegistrySnapshot
from miles_runner.rollout.multi_lora import MultiLoRARollout

from .helpers import run


def prompt_file(path: Path, labels: list[str]) -> str:
    path.write_text("".join(json.dumps({"prompt": f"What is {x}?", "label": x}) + "\n" for x in labels))
    return str(path)


def rollout() -> MultiLoRARollout:
    # Prompts and data sizes need no engine: no context is given (nothing here generates).
    return MultiLoRARollout(None, AdaptersCache(in_process(RegistrySnapshot), ttl_s=0.0), seed=0)  # type: ignore[arg-type]


def test_adapters_on_the_jsonl_task_read_their_own_data_files(tmp_path):
    a = run("a", 0, task="jsonl", data=prompt_file(tmp_path / "a.jsonl", ["1", "2", "3"]))
    b = run("b", 1, task="jsonl", data=prompt_file(tmp_path / "b.jsonl", ["7", "8"]))
    r = rollout()
    assert [r.next_prompt(a, i).label for i in range(4)] == ["1", "2", "3", "1"]  # an epoch, then again
    assert [r.next_prompt(b, i).label for i in range(3)] == ["7", "8", "7"]


def test_an_adapters_epoch_is_its_data_files_length_and_a_generated_task_has_none(tmp_path):
    r = rollout()
    assert r.dataset_rows(run("a", 0, task="jsonl", data=prompt_file(tmp_path / "a.jsonl", ["1", "2", "3"]))) == 3
    assert r.dataset_rows(run("c", 2, task="count")) is None


def test_an_adapter_registered_over_the_api_may_name_a_bundled_prompt_set():
    from miles_runner.multi_lora.config import resolve_adapter_config

    from .helpers import LIMITS, defaults

    limits = dataclasses.replace(LIMITS, tasks=("jsonl",))
    config = resolve_adapter_config("l", {"task": "jsonl", "data": "bundled:letters.jsonl"}, defaults(), limits)
    assert Path(config.data).is_absolute() and Path(config.data).is_file()
    r = rollout()
    assert r.dataset_rows(run("l", 0, task="jsonl", data=config.data)) == 256
