import pytest
from session_records import plan_and_complete, play_turn

from miles_runner.session import tree as tree_module
from miles_runner.session.errors import TreeFullError, TruncatedGenerationError
from miles_runner.session.tree import TreeTrajectory

USER_1 = {"role": "user", "content": "What is 3 plus 4?"}
USER_2 = {"role": "user", "content": "Thank you!"}
OTHER = {"role": "user", "content": "Something else"}


def answer(text):
    return {"role": "assistant", "content": text}


def test_the_first_turn_is_a_root_and_the_next_attaches_to_it(tito):
    state = TreeTrajectory()
    play_turn(state, tito, [USER_1], "7")
    play_turn(state, tito, [USER_1, answer("7"), USER_2], "Yes")
    assert [(n.node_id, n.parent) for n in state.nodes] == [(0, None), (1, 0)]
    assert state.nodes[1].token_ids[: len(state.nodes[0].token_ids)] == state.nodes[0].token_ids


def test_concurrent_turns_on_one_parent_become_siblings(tito):
    state = TreeTrajectory()
    play_turn(state, tito, [USER_1], "7")
    messages = [USER_1, answer("7"), USER_2]
    first = plan_and_complete(state, tito, messages, "a")
    second = plan_and_complete(state, tito, messages, "b")
    assert state.commit(*first, 0) and state.commit(*second, 0)
    assert state.nodes[0].children == [1, 2]


def test_identical_siblings_tie_to_the_later_one(tito):
    state = TreeTrajectory()
    play_turn(state, tito, [USER_1], "7")
    play_turn(state, tito, [USER_1], "7")
    assert state.find_attach_point(tito_messages([USER_1, answer("7"), USER_2])) == 1


def test_a_deep_divergence_branches_at_the_deepest_match(tito):
    state = TreeTrajectory()
    play_turn(state, tito, [USER_1], "7")
    play_turn(state, tito, [USER_1, answer("7"), USER_2], "Yes")
    play_turn(state, tito, [USER_1, answer("7"), OTHER], "Ok")
    assert [n.parent for n in state.nodes] == [None, 0, 0]


def test_a_different_first_message_starts_a_new_root(tito):
    state = TreeTrajectory()
    play_turn(state, tito, [USER_1], "7")
    play_turn(state, tito, [OTHER], "Ok")
    assert [n.parent for n in state.nodes] == [None, None]


def test_extending_a_truncated_node_is_a_conflict(tito):
    state = TreeTrajectory()
    play_turn(state, tito, [USER_1], "7 8 9", finish_reason="length")
    with pytest.raises(TruncatedGenerationError, match="node 0"):
        plan_and_complete(state, tito, [USER_1, answer("7 8 9"), USER_2], "x")


def test_retrying_a_truncated_node_is_allowed(tito):
    state = TreeTrajectory()
    play_turn(state, tito, [USER_1], "7 8 9", finish_reason="length")
    play_turn(state, tito, [USER_1], "7")
    assert [n.parent for n in state.nodes] == [None, None]


def test_describe_lists_nodes_and_root_to_leaf_paths(tito):
    state = TreeTrajectory()
    play_turn(state, tito, [USER_1], "7")
    play_turn(state, tito, [USER_1, answer("7"), USER_2], "Yes")
    play_turn(state, tito, [USER_1, answer("7"), OTHER], "Ok")
    tree = state.describe()
    assert [node["parent"] for node in tree["nodes"]] == [None, 0, 0]
    assert tree["leaves"] == [{"node_id": 1, "path_node_ids": [0, 1]}, {"node_id": 2, "path_node_ids": [0, 2]}]


def test_a_full_tree_refuses_new_turns(tito, monkeypatch):
    monkeypatch.setattr(tree_module, "MAX_NODES", 1)
    state = TreeTrajectory()
    play_turn(state, tito, [USER_1], "7")
    with pytest.raises(TreeFullError, match="1 nodes"):
        plan_and_complete(state, tito, [USER_1], "8")


def tito_messages(messages):
    from miles_runner.session.messages import normalize_messages

    return normalize_messages(messages)
