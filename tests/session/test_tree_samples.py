from session_records import play_turn

from miles_runner.session.samples import AssemblyOptions
from miles_runner.session.tree import TreeTrajectory
from miles_runner.session.tree_samples import build_leaf_samples, drop_retries, postprocess

OPTIONS = AssemblyOptions(max_trim_tokens=0, use_addition_r3=False, num_layers=2)
USER_1 = {"role": "user", "content": "What is 3 plus 4?"}
USER_2 = {"role": "user", "content": "Thank you!"}
OTHER = {"role": "user", "content": "Something else"}


def answer(text):
    return {"role": "assistant", "content": text}


def leaves_of(state, tito):
    leaves, _ = build_leaf_samples(state, OPTIONS, tito.decode)
    return leaves


def test_a_retried_leaf_is_dropped_in_favour_of_the_later_sibling(tito):
    state = TreeTrajectory()
    play_turn(state, tito, [USER_1], "7")
    play_turn(state, tito, [USER_1], "8")
    kept = drop_retries(leaves_of(state, tito))
    assert [item.leaf.node_id for item in kept] == [1]


def test_branches_are_kept_longest_path_first(tito):
    state = TreeTrajectory()
    play_turn(state, tito, [USER_1], "7")
    play_turn(state, tito, [USER_1, answer("7"), USER_2], "Yes")
    play_turn(state, tito, [USER_1, answer("7"), USER_2, answer("Yes"), OTHER], "Ok")
    play_turn(state, tito, [USER_1, answer("7"), OTHER], "Sure")
    kept = drop_retries(leaves_of(state, tito))
    assert [item.leaf.node_id for item in kept] == [2, 3]


def test_a_shared_prefix_trains_only_in_the_earliest_leaf(tito):
    state = TreeTrajectory()
    play_turn(state, tito, [USER_1], "7")
    play_turn(state, tito, [USER_1, answer("7"), USER_2], "Yes")
    play_turn(state, tito, [USER_1, answer("7"), OTHER], "Sure")
    first, second = sorted(leaves_of(state, tito), key=lambda item: item.leaf.node_id)
    postprocess([first, second], {})
    root_span = len(state.nodes[0].token_ids) - state.nodes[0].completion_span[0]
    assert first.sample.loss_mask[:root_span] == [1] * root_span
    assert second.sample.loss_mask[:root_span] == [0] * root_span
    assert second.sample.loss_mask[-1] == 1


def test_agent_metadata_reaches_samples_but_cannot_overwrite_server_keys(tito):
    state = TreeTrajectory()
    play_turn(state, tito, [USER_1], "7")
    [sample] = postprocess(leaves_of(state, tito), {"reward": 1.5, "leaf": "forged", "task": "t1"})
    assert sample.reward == 1.5
    assert sample.metadata["task"] == "t1"
    assert sample.metadata["leaf"]["node_id"] == 0


def test_an_empty_tree_has_no_records(tito):
    assert build_leaf_samples(TreeTrajectory(), OPTIONS, tito.decode) == ([], "no_records")
