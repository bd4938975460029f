"""Rewards are pure functions of the prompt and the assistant's replies."""

from miles_runner.plugins.rewards import exact_match, guess_number
from miles_runner.plugins.tasks import Prompt

PROMPT = Prompt(0, [{"role": "user", "content": "q"}], "12", {"max_turns": 3})


def test_exact_match_reads_the_first_number_of_the_last_reply():
    assert exact_match(PROMPT, ["The answer is 12, not 13."]) == 1.0
    assert exact_match(PROMPT, ["13 or 12"]) == 0.0


def test_exact_match_without_a_number_is_zero():
    assert exact_match(PROMPT, ["twelve"]) == 0.0
    assert exact_match(PROMPT, []) == 0.0


def test_guess_number_rewards_earlier_hits_more():
    assert guess_number(PROMPT, ["12"]) == 1.0
    assert guess_number(PROMPT, ["3", "20", "12"]) == 0.6


def test_guess_number_without_a_hit_in_the_turn_limit_is_zero():
    assert guess_number(PROMPT, ["3", "20", "11"]) == 0.0
    assert guess_number(PROMPT, ["3", "20", "11", "12"]) == 0.0
