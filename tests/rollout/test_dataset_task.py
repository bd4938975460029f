"""The jsonl data-set task and the math reward, for real data sets on GPU clusters."""

import json

import pytest

from miles_runner.plugins.lookup import get_reward, make_task
from miles_runner.plugins.tasks import Prompt, toy_task_names


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_jsonl_prompts_come_from_the_file_in_order_and_wrap(tmp_path):
    data = write_rows(tmp_path / "p.jsonl", [{"prompt": "1+1?", "label": 2}, {"prompt": "2+2?", "label": "4"}])
    task = make_task("jsonl", seed=0, data=data)
    prompts = [task.prompt(i) for i in range(3)]
    assert [p.messages[0]["content"] for p in prompts] == ["1+1?", "2+2?", "1+1?"]
    assert prompts[0].label == "2"


def test_jsonl_accepts_chat_messages(tmp_path):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "3+4?"}]
    task = make_task("jsonl", 0, write_rows(tmp_path / "p.jsonl", [{"prompt": messages, "label": "7"}]))
    assert task.prompt(0).messages == messages


def test_jsonl_without_a_file_is_a_clear_error():
    with pytest.raises(ValueError, match=r"rollout\.data"):
        make_task("jsonl", 0, "").prompt(0)


def test_jsonl_lines_without_a_label_are_named(tmp_path):
    task = make_task("jsonl", 0, write_rows(tmp_path / "p.jsonl", [{"prompt": "x", "label": "1"}, {"prompt": "y"}]))
    with pytest.raises(ValueError, match=r"bad lines: \[1\]"):
        task.prompt(0)


def test_format_pretraining_skips_tasks_that_need_data():
    assert "jsonl" not in toy_task_names() and "count" in toy_task_names()


@pytest.mark.parametrize(
    ("reply", "label", "reward"),
    [("so \\boxed{42}.", "42", 1.0), ("the answer is 1,234", "1234", 1.0), ("7 then 8", "7", 0.0), ("none", "3", 0.0)],
)
def test_math_reward_reads_the_boxed_or_last_number(reply, label, reward):
    assert get_reward("math")(Prompt(0, [], label), [reply]) == reward
