"""Multi-turn sessions through the session server to the embedded engine: TITO, LoRA on every turn,
incremental R3 against a full-R3 oracle, v1 rollback and v2 branching."""

import itertools

import httpx
import pytest
from servers import STOP_TOKEN_IDS, chat, get_session, new_session, openai_client

from miles_runner.session.codec import decode_samples
from miles_runner.session.config import read_num_layers
from miles_runner.sglang_client.routed_experts import decode_routed_experts

pytestmark = pytest.mark.integration

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


def user(turn: int) -> dict:
    return {"role": "user", "content": f"What is {turn} plus 4?"}


def play_with_openai(server, turns: int) -> str:
    session_id = new_session(server)
    client = openai_client(server, session_id)
    messages = [SYSTEM]
    for turn in range(turns):
        messages.append(user(turn))
        reply = client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=16,
            temperature=0,
            extra_body={"stop_token_ids": STOP_TOKEN_IDS},
        )
        assert reply.choices[0].finish_reason == "stop"
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    return session_id


def generate(engine_url: str, input_ids: list[int], max_new_tokens: int, lora_path: str | None) -> dict:
    payload = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
        "return_logprob": True,
        "return_routed_experts": True,
        "lora_path": lora_path,
    }
    response = httpx.post(f"{engine_url}/generate", json=payload, timeout=120)
    response.raise_for_status()
    return response.json()


def output_ids(result: dict) -> list[int]:
    return [entry[1] for entry in result["meta_info"]["output_token_logprobs"]]


@pytest.fixture(scope="module")
def ten_turns(lora_server):
    session_id = play_with_openai(lora_server, turns=10)
    session = get_session(lora_server, session_id)
    samples = httpx.post(f"{lora_server.url}/sessions/{session_id}/samples", json={}).content
    return session, decode_samples(samples)


def test_ten_openai_turns_make_ten_chained_records(ten_turns):
    session, _ = ten_turns
    records = session["records"]
    assert len(records) == 10
    for previous, current in itertools.pairwise(records):
        previous_ids = previous["request"]["input_ids"] + output_ids(previous["response"]["choices"][0])
        assert current["request"]["input_ids"][: len(previous_ids)] == previous_ids


def test_every_turn_carries_the_adapter(ten_turns):
    session, _ = ten_turns
    assert {record["request"]["lora_path"] for record in session["records"]} == {"miles_lora"}


def test_every_turn_was_generated_by_the_adapter_not_the_base_model(ten_turns, engine_url):
    session, _ = ten_turns
    differs_from_base = []
    for record in session["records"]:
        prompt, completion = record["request"]["input_ids"], output_ids(record["response"]["choices"][0])
        assert output_ids(generate(engine_url, prompt, len(completion), "miles_lora"))[: len(completion)] == completion
        differs_from_base.append(output_ids(generate(engine_url, prompt, len(completion), None)) != completion)
    assert any(differs_from_base)


def test_incremental_r3_patches_are_contiguous_slices_of_a_full_r3_oracle(ten_turns, engine_url, tiny_model_dir):
    session, reply = ten_turns
    final_ids = session["metadata"]["accumulated_token_ids"]
    oracle = generate(engine_url, final_ids[:-1], 1, "miles_lora")
    assert output_ids(oracle) == [final_ids[-1]]  # the oracle reproduces the trajectory's last token
    num_layers = read_num_layers(tiny_model_dir)
    full = decode_routed_experts(oracle["meta_info"]["routed_experts"], len(final_ids) - 1, num_layers)
    covered = 0
    for record in session["records"]:
        choice = record["response"]["choices"][0]
        start = record["request"]["routed_experts_start_len"]
        end = len(record["request"]["input_ids"]) + len(choice["meta_info"]["output_token_logprobs"]) - 1
        assert start == covered
        patch = decode_routed_experts(choice["meta_info"]["routed_experts"], end - start, num_layers)
        assert patch.tobytes() == full[start:end].tobytes()
        covered = end
    assert covered == len(final_ids) - 1
    assert reply.samples[0].rollout_routed_experts.tobytes() == full.tobytes()


def test_the_sample_covers_the_whole_session(ten_turns):
    session, reply = ten_turns
    [sample] = reply.samples
    assert sample.tokens == session["metadata"]["accumulated_token_ids"]
    assert len(sample.loss_mask) == sample.response_length == len(sample.rollout_log_probs)
    assert sum(sample.loss_mask) == sum(
        len(r["response"]["choices"][0]["meta_info"]["output_token_logprobs"]) for r in session["records"]
    )


def test_a_retry_rolls_back_one_turn_and_its_r3_offset(lora_server):
    session_id = new_session(lora_server)
    first = chat(lora_server, session_id, [user(0)]).json()["choices"][0]["message"]["content"]
    turn_two = [user(0), {"role": "assistant", "content": first}, user(1)]
    chat(lora_server, session_id, turn_two)
    checkpoint_one = len(get_session(lora_server, session_id)["records"][0]["request"]["input_ids"])
    assert chat(lora_server, session_id, turn_two, temperature=1.0).status_code == 200
    records = get_session(lora_server, session_id)["records"]
    assert len(records) == 2
    first_len = checkpoint_one + len(records[0]["response"]["choices"][0]["meta_info"]["output_token_logprobs"])
    assert records[1]["request"]["routed_experts_start_len"] == first_len - 1


def test_a_two_turn_rollback_is_400_and_leaves_the_session_unchanged(lora_server):
    session_id = new_session(lora_server)
    first = chat(lora_server, session_id, [user(0)]).json()["choices"][0]["message"]["content"]
    chat(lora_server, session_id, [user(0), {"role": "assistant", "content": first}, user(1)])
    before = get_session(lora_server, session_id)
    reply = chat(lora_server, session_id, [user(5)])
    assert reply.status_code == 400
    assert "discard 2 generated turns" in reply.json()["error"]
    assert get_session(lora_server, session_id) == before


def test_v2_concurrent_turns_on_one_parent_become_siblings(tree_server):
    import concurrent.futures

    session_id = new_session(tree_server)
    first = chat(tree_server, session_id, [user(0)]).json()["choices"][0]["message"]["content"]
    branch = [user(0), {"role": "assistant", "content": first}]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(lambda n: chat(tree_server, session_id, [*branch, user(n)]), [1, 2]))
    assert [reply.status_code for reply in replies] == [200, 200]
    tree = get_session(tree_server, session_id)["metadata"]["tree"]
    assert [node["parent"] for node in tree["nodes"]] == [None, 0, 0]
    assert [leaf["path_node_ids"] for leaf in tree["leaves"]] == [[0, 1], [0, 2]]


def test_v2_branches_under_different_parents_are_all_sampled(tree_server):
    session_id = new_session(tree_server)
    first = chat(tree_server, session_id, [user(0)]).json()["choices"][0]["message"]["content"]
    two = [user(0), {"role": "assistant", "content": first}, user(1)]
    second = chat(tree_server, session_id, two).json()["choices"][0]["message"]["content"]
    chat(tree_server, session_id, [*two, {"role": "assistant", "content": second}, user(2)])
    chat(tree_server, session_id, [user(0), {"role": "assistant", "content": first}, user(3)])
    chat(tree_server, session_id, [*two, {"role": "assistant", "content": second}, user(4)])
    reply = decode_samples(httpx.post(f"{tree_server.url}/sessions/{session_id}/samples", json={}).content)
    # Node 4 is a later sibling of node 2 (both under node 1), so node 2 counts as a retry and is dropped;
    # node 3 is node 0's latest child and stays. Longest path first.
    assert [sample.metadata["leaf"]["node_id"] for sample in reply.samples] == [4, 3]


def test_v2_a_retry_is_a_sibling_and_only_the_latest_is_sampled(tree_server):
    session_id = new_session(tree_server)
    chat(tree_server, session_id, [user(0)])
    chat(tree_server, session_id, [user(0)], temperature=1.0)
    reply = decode_samples(
        httpx.post(f"{tree_server.url}/sessions/{session_id}/samples", json={"metadata": {"reward": 2.0}}).content
    )
    assert [sample.metadata["leaf"]["node_id"] for sample in reply.samples] == [1]
    assert reply.samples[0].reward == 2.0


def test_v2_extending_a_truncated_turn_is_409(tree_server):
    session_id = new_session(tree_server)
    reply = chat(tree_server, session_id, [user(0)], max_tokens=1, stop_token_ids=[]).json()
    assert reply["choices"][0]["finish_reason"] == "length"
    content = reply["choices"][0]["message"]["content"]
    extended = chat(tree_server, session_id, [user(0), {"role": "assistant", "content": content}, user(1)])
    assert extended.status_code == 409


def test_v2_incremental_r3_of_each_leaf_matches_its_full_r3_oracle(tree_server, engine_url, tiny_model_dir):
    session_id = new_session(tree_server)
    first = chat(tree_server, session_id, [user(0)]).json()["choices"][0]["message"]["content"]
    branch = [user(0), {"role": "assistant", "content": first}]
    chat(tree_server, session_id, [*branch, user(1)])
    chat(tree_server, session_id, [*branch, user(2)])
    reply = decode_samples(httpx.post(f"{tree_server.url}/sessions/{session_id}/samples", json={}).content)
    num_layers = read_num_layers(tiny_model_dir)
    for sample in reply.samples:
        oracle = generate(engine_url, sample.tokens[:-1], 1, "miles_lora")
        assert output_ids(oracle) == [sample.tokens[-1]]
        full = decode_routed_experts(oracle["meta_info"]["routed_experts"], len(sample.tokens) - 1, num_layers)
        assert sample.rollout_routed_experts.tobytes() == full.tobytes()
