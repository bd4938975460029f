import pytest
from session_records import plan_and_complete, play_turn

from miles_runner.session.errors import MessageValidationError, TokenizationError
from miles_runner.session.linear import LinearTrajectory, check_checkpoint_prefix

USER_1 = {"role": "user", "content": "What is 3 plus 4?"}
USER_2 = {"role": "user", "content": "Thank you!"}
USER_3 = {"role": "user", "content": "Try again."}


def answer(text):
    return {"role": "assistant", "content": text}


def three_turns(tito) -> LinearTrajectory:
    state = LinearTrajectory()
    play_turn(state, tito, [USER_1], "7")
    play_turn(state, tito, [USER_1, answer("7"), USER_2], "Yes")
    play_turn(state, tito, [USER_1, answer("7"), USER_2, answer("Yes"), USER_3], "No")
    return state


def test_each_turn_builds_on_the_previous_checkpoint(tito):
    state = three_turns(tito)
    for previous, current in zip(state.checkpoints, state.checkpoints[1:], strict=False):
        assert current[: len(previous)] == previous
    assert all(len(r.prompt_ids) < len(c) for r, c in zip(state.records, state.checkpoints, strict=True))
    assert state.num_assistant == 3


def test_a_retry_of_the_last_turn_rolls_back_one_checkpoint(tito):
    state = three_turns(tito)
    plan = play_turn(state, tito, [USER_1, answer("7"), USER_2, answer("Yes"), USER_3], "Maybe")
    assert plan.base_index == 1
    assert state.num_assistant == 3
    assert len(state.records) == 3
    assert state.messages[-1] == answer("Maybe")


def test_a_divergent_user_message_rolls_back_one_checkpoint(tito):
    state = three_turns(tito)
    other = {"role": "user", "content": "Something else"}
    plan = play_turn(state, tito, [USER_1, answer("7"), USER_2, answer("Yes"), other], "Ok")
    assert plan.base_index == 1
    assert state.records[-1].prompt_ids[: len(state.checkpoints[1])] == state.checkpoints[1]


def test_a_rollback_of_two_turns_is_rejected_and_changes_nothing(tito):
    state = three_turns(tito)
    before = (list(state.checkpoints), list(state.records), list(state.messages))
    with pytest.raises(MessageValidationError, match="discard 2 generated turns"):
        plan_and_complete(state, tito, [USER_1, answer("7"), USER_2], "again")
    assert (state.checkpoints, state.records, state.messages) == before


def test_a_retry_of_the_first_turn_starts_from_an_empty_checkpoint(tito):
    state = LinearTrajectory()
    play_turn(state, tito, [USER_1], "7")
    plan = play_turn(state, tito, [USER_1], "8")
    assert plan.base_index == -1
    assert plan.checkpoint_ids == []
    assert len(state.records) == 1


def test_few_shot_assistant_messages_are_not_checkpoints(tito):
    state = LinearTrajectory()
    few_shot = [{"role": "user", "content": "1 + 1"}, answer("2"), USER_1]
    play_turn(state, tito, few_shot, "7")
    assert state.num_assistant == 1
    assert state.checkpoint_message_ends == [4]


def test_an_appended_assistant_message_is_rejected(tito):
    state = LinearTrajectory()
    play_turn(state, tito, [USER_1], "7")
    with pytest.raises(MessageValidationError, match="role 'assistant'"):
        plan_and_complete(state, tito, [USER_1, answer("7"), USER_2, answer("fake")], "x")


def test_a_turn_planned_before_another_commit_is_not_applied(tito):
    state = LinearTrajectory()
    play_turn(state, tito, [USER_1], "7")
    messages = [USER_1, answer("7"), USER_2]
    first = plan_and_complete(state, tito, messages, "a")
    second = plan_and_complete(state, tito, messages, "b")
    assert state.commit(*first, 0)
    assert not state.commit(*second, 0)
    assert state.messages[-1] == answer("a")
    assert len(state.records) == 2


def test_a_checkpoint_that_is_not_a_prefix_is_a_tokenization_error():
    with pytest.raises(TokenizationError, match="differ at token 1"):
        check_checkpoint_prefix([1, 2, 3], [1, 9, 3, 4], max_trim_tokens=0)


def test_trailing_differences_within_max_trim_tokens_are_allowed():
    check_checkpoint_prefix([1, 2, 3], [1, 2, 9, 4], max_trim_tokens=1)
