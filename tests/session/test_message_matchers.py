"""session.message_matcher: strict, loose_tool_call and role_content_only decide whether a replayed message is the
stored one (miles' message_matcher_hub), in v1 and v2; on a match the stored spelling is kept."""

import pytest
from servers import chat, get_session, new_session

from miles_runner.session.messages import (
    loose_tool_call_matches,
    matching_prefix_len,
    normalize_message,
    resolve_matcher,
    role_content_only_matches,
    strict_matches,
)

pytestmark = pytest.mark.integration


def assistant_calling(arguments, call_id: str = "call-A", **extra) -> dict:
    call = {"id": call_id, "type": "function", "function": {"name": "lookup", "arguments": arguments}}
    return normalize_message({"role": "assistant", "content": "", "tool_calls": [call], **extra})


STORED = assistant_calling('{"city":"Paris","units":"metric"}')
RESERIALISED = assistant_calling('{"units": "metric", "city": "Paris"}')  # the same call, spelled differently


def test_strict_rejects_reserialised_arguments_and_loose_accepts_them():
    assert not strict_matches(STORED, RESERIALISED)
    assert loose_tool_call_matches(STORED, RESERIALISED)


def test_loose_equates_json_numbers_but_not_types():
    assert loose_tool_call_matches(assistant_calling('{"n": 1}'), assistant_calling('{"n": 1.0}'))
    assert loose_tool_call_matches(assistant_calling('{"n": 1}'), assistant_calling({"n": 1}))
    assert not loose_tool_call_matches(assistant_calling('{"n": true}'), assistant_calling('{"n": 1}'))
    assert not loose_tool_call_matches(assistant_calling('{"n": "1"}'), assistant_calling('{"n": 1}'))


def test_loose_still_compares_ids_names_and_non_json_arguments():
    assert not loose_tool_call_matches(STORED, assistant_calling('{"units":"metric","city":"Paris"}', "call-B"))
    assert not loose_tool_call_matches(assistant_calling("not json"), assistant_calling("not  json"))
    duplicate_keys = assistant_calling('{"a": 1, "a": 1}')
    assert not loose_tool_call_matches(duplicate_keys, assistant_calling('{"a": 1}'))
    assert loose_tool_call_matches(assistant_calling(""), assistant_calling("{}"))  # no arguments: the empty object


def test_role_content_only_ignores_tool_calls_and_reasoning():
    other_call = assistant_calling("{}", "call-B", reasoning_content="thinking")
    assert role_content_only_matches(STORED, other_call)
    assert not loose_tool_call_matches(STORED, other_call)
    assert not role_content_only_matches(STORED, {**STORED, "content": "different"})


def test_strict_compares_only_what_a_template_reads():
    tool = normalize_message({"role": "tool", "content": "ok", "tool_call_id": "call-A"})
    assert strict_matches(tool, {**tool, "tool_call_id": "renamed", "name": "lookup"})
    assert not strict_matches(tool, {**tool, "content": "ok "})


def test_the_prefix_length_follows_the_matcher():
    stored = [normalize_message({"role": "user", "content": "q"}), STORED]
    replay = [stored[0], RESERIALISED]
    assert matching_prefix_len(stored, replay) == 1
    assert matching_prefix_len(stored, replay, resolve_matcher("loose_tool_call")) == 2


def test_an_unknown_matcher_is_refused():
    with pytest.raises(ValueError, match="must be one of"):
        resolve_matcher("package.module.matcher")


# ---- through the session server (embedded engine, tiny model) ----

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
QUESTION = {"role": "user", "content": "What is the weather?"}


def few_shot(arguments: str, call_id: str = "call-A") -> dict:
    call = {"id": call_id, "type": "function", "function": {"name": "lookup", "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


FEW_SHOT = few_shot('{"city":"Paris","units":"metric"}')
REPLAYED = few_shot('{"units": "metric", "city": "Paris"}')
OTHER_CALL = few_shot("{}", "call-Z")
RESULT = {"role": "tool", "content": "sunny", "tool_call_id": "call-A"}
NEXT = {"role": "user", "content": "Thank you!"}


def replay_once(server, replayed_few_shot: dict) -> tuple[str, dict]:
    """Turn 1 with a few-shot tool call; turn 2 replays the conversation with that call spelled differently."""
    session_id = new_session(server)
    first = [SYSTEM, QUESTION, FEW_SHOT, RESULT, NEXT]
    reply = chat(server, session_id, first)
    assert reply.status_code == 200, reply.text
    answer = {"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"]}
    second = chat(server, session_id, [SYSTEM, QUESTION, replayed_few_shot, RESULT, NEXT, answer, NEXT])
    assert second.status_code == 200, second.text
    return session_id, get_session(server, session_id)


@pytest.fixture(scope="module")
def v1_servers(engine_url, start_session_server):
    return {
        name: start_session_server(engine_url, message_matcher=name)
        for name in ("strict", "loose_tool_call", "role_content_only")
    }


@pytest.fixture(scope="module")
def v2_servers(engine_url, start_session_server):
    return {
        name: start_session_server(engine_url, version="v2", message_matcher=name)
        for name in ("strict", "loose_tool_call")
    }


@pytest.mark.parametrize(
    ("matcher", "replay", "kept"),
    [
        ("strict", REPLAYED, False),
        ("loose_tool_call", REPLAYED, True),
        ("loose_tool_call", OTHER_CALL, False),
        ("role_content_only", OTHER_CALL, True),
    ],
)
def test_v1_keeps_the_checkpoint_only_when_the_matcher_accepts_the_replay(v1_servers, matcher, replay, kept):
    server = v1_servers[matcher]
    session_id, session = replay_once(server, replay)
    records = session["records"]
    if kept:  # turn 2 extends turn 1's tokens
        assert len(records) == 2
        stored = records[0]["request"]["input_ids"]
        assert records[1]["request"]["input_ids"][: len(stored)] == stored
    else:  # the replay diverges at the few-shot call: turn 1 is rolled back and the conversation rendered afresh
        assert len(records) == 1
    state = server.app.state.core.sessions[session_id].state
    assert state.messages[2] == normalize_message(FEW_SHOT if kept else replay)  # the stored spelling is kept


@pytest.mark.parametrize(("matcher", "parent"), [("strict", None), ("loose_tool_call", 0)])
def test_v2_attaches_the_replay_under_the_stored_node_only_when_the_matcher_accepts_it(v2_servers, matcher, parent):
    server = v2_servers[matcher]
    session_id, session = replay_once(server, REPLAYED)
    nodes = session["metadata"]["tree"]["nodes"]
    assert [node["parent"] for node in nodes] == [None, parent]
    path = server.app.state.core.sessions[session_id].state.nodes[1].path_messages
    assert path[2] == normalize_message(FEW_SHOT if parent == 0 else REPLAYED)
