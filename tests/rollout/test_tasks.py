"""Tasks: deterministic prompts from (seed, index), a resumable data cursor, the guess-number environment."""

import random

import pytest

from miles_runner.plugins.lookup import make_task
from miles_runner.plugins.tasks import GuessNumberTask, PromptStream, first_number, toy_task_names


@pytest.mark.parametrize("name", toy_task_names())
def test_prompt_depends_only_on_seed_and_index(name):
    assert make_task(name, seed=3).prompt(7) == make_task(name, seed=3).prompt(7)


@pytest.mark.parametrize("name", toy_task_names())
def test_different_seeds_give_different_prompt_sequences(name):
    first = [make_task(name, seed=1).prompt(i) for i in range(20)]
    second = [make_task(name, seed=2).prompt(i) for i in range(20)]
    assert first != second


def test_arith_label_is_the_sum_of_the_operands():
    prompt = make_task("arith", seed=0).prompt(0)
    a, b = (int(x) for x in prompt.messages[0]["content"].replace("?", "").split() if x.isdigit())
    assert prompt.label == str(a + b)


def test_stream_resumed_from_its_cursor_continues_the_same_sequence():
    straight = PromptStream(make_task("arith", seed=5))
    straight.next_batch(4)
    expected = straight.next_batch(3)
    first = PromptStream(make_task("arith", seed=5))
    first.next_batch(4)
    resumed = PromptStream(make_task("arith", seed=5))
    resumed.load_state_dict(first.state_dict())
    assert resumed.next_batch(3) == expected


def test_stream_refuses_a_cursor_from_another_seed():
    stream = PromptStream(make_task("arith", seed=1))
    with pytest.raises(ValueError, match="seed"):
        stream.load_state_dict({"cursor": 4, "seed": 2})


def test_guess_number_says_higher_then_lower_then_ends_on_a_hit():
    task = GuessNumberTask(seed=0)
    prompt = task.prompt(0)
    secret = int(prompt.label)
    assert task.feedback(prompt, [str(secret - 1)]) == "Higher."
    assert task.feedback(prompt, ["0", str(secret + 1)]) == "Lower."
    assert task.feedback(prompt, [str(secret)]) is None


def test_guess_number_ends_after_max_turns_and_asks_for_a_number():
    task = GuessNumberTask(seed=0)
    prompt = task.prompt(0)
    assert task.feedback(prompt, ["hello"]) == "Reply with a single number."
    assert task.feedback(prompt, ["0"] * task.max_turns) is None


@pytest.mark.parametrize("name", toy_task_names())
def test_random_reply_is_a_well_formed_number(name):
    task = make_task(name, seed=0)
    prompt = task.prompt(1)
    reply = task.random_reply(prompt, random.Random(0))
    assert first_number(reply) is not None and reply.strip().isdigit()
