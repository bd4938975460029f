"""What the session server exposes: only the routes an agent needs, never a key, the run's key on
every route but /health, and a 400 (not a 500) for a non-finite number or a control character."""

import httpx
import pytest
from servers import STOP_TOKEN_IDS, chat, new_session, openai_client, start_embedded_engine

from miles_testkit.servers import RecordingProxy

pytestmark = [pytest.mark.integration, pytest.mark.reliability]

USER = {"role": "user", "content": "What is 3 plus 4?"}
RUN_KEY = "run-key-7c1f"
# Engine routes an agent must not reach through a session (control, weights, adapters, unrecorded generation,
# the engine's configuration with its keys), each with the method SGLang serves it under.
NOT_PROXIED = [
    ("POST", "pause_generation"),
    ("POST", "continue_generation"),
    ("POST", "abort_request"),
    ("POST", "load_lora_adapter"),
    ("POST", "unload_lora_adapter"),
    ("POST", "update_weights_from_disk"),
    ("POST", "update_weight_version"),
    ("POST", "init_weights_update_group"),
    ("POST", "flush_cache"),
    ("POST", "generate"),
    ("POST", "v1/completions"),
    ("GET", "server_info"),
    ("GET", "get_server_info"),
]


@pytest.fixture(scope="module")
def recorded_engine(engine_url):
    """The shared engine behind a recording proxy: what the session server sent it."""
    with RecordingProxy(engine_url) as proxy:
        yield proxy


@pytest.mark.parametrize(("method", "path"), NOT_PROXIED)
def test_engine_control_routes_are_not_reachable_through_a_session(recorded_engine, start_session_server, method, path):
    server = start_session_server(recorded_engine.url, lora_name="miles_lora")
    session_id = new_session(server)
    recorded_engine.clear()
    reply = httpx.request(method, f"{server.url}/sessions/{session_id}/{path}", json={"lora_name": "x"})
    assert reply.status_code in (404, 405)
    assert "error" in reply.json()
    assert recorded_engine.paths() == []  # nothing reached the engine


def test_the_allow_listed_routes_reach_the_engine(recorded_engine, start_session_server):
    server = start_session_server(recorded_engine.url, lora_name="miles_lora")
    base = f"{server.url}/sessions/{new_session(server)}"
    assert httpx.get(f"{base}/v1/models/miles_lora").json()["id"] == "miles_lora"
    assert "weight_version" in httpx.get(f"{base}/model_info").json()
    assert httpx.get(f"{base}/get_model_info").status_code == 200


def test_a_query_string_cannot_choose_the_proxied_route(recorded_engine, start_session_server):
    server = start_session_server(recorded_engine.url)
    session_id = new_session(server)
    recorded_engine.clear()
    reply = httpx.get(f"{server.url}/sessions/{session_id}/model_info", params={"path": "/server_info"})
    assert reply.status_code == 200 and "weight_version" in reply.json()
    assert recorded_engine.paths() == ["/model_info"]


# As an agent's client sends them: percent-encoded dots, slashes and control characters.
ESCAPES = ["%2E%2E", "%2E%2E/server_info", "%2E%2E%2F%2E%2E%2Fserver_info", "a/%2E/%2E%2E/%2E%2E/x", "a%0Ab", "a%00b"]


@pytest.mark.parametrize("model", ESCAPES)
def test_a_model_id_cannot_leave_the_model_card_route(recorded_engine, start_session_server, model):
    server = start_session_server(recorded_engine.url)
    session_id = new_session(server)
    recorded_engine.clear()
    reply = httpx.get(f"{server.url}/sessions/{session_id}/v1/models/{model}")
    assert reply.status_code == 404, reply.text
    assert all(path.startswith("/v1/models/") for path in recorded_engine.paths()), recorded_engine.paths()


@pytest.mark.parametrize("path", ["a%0Ab", "v1/%0D%0Amodels", "%00"])
def test_a_control_character_in_a_session_path_is_a_4xx_not_a_500(lora_server, path):
    reply = httpx.get(f"{lora_server.url}/sessions/{new_session(lora_server)}/{path}")
    assert 400 <= reply.status_code < 500


@pytest.mark.parametrize(
    ("field", "literal"), [("temperature", "NaN"), ("top_p", "Infinity"), ("temperature", "1e999")]
)
def test_a_non_finite_number_is_a_400_naming_the_field(lora_server, field, literal):
    session_id = new_session(lora_server)
    raw = f'{{"model": "tiny", "messages": [{{"role": "user", "content": "hi"}}], "{field}": {literal}}}'
    url = f"{lora_server.url}/sessions/{session_id}/v1/chat/completions"
    reply = httpx.post(url, content=raw, headers={"content-type": "application/json"})
    assert reply.status_code == 400
    assert reply.json()["error"].startswith(f"{field} must be a finite number")
    assert chat(lora_server, session_id, [USER]).status_code == 200  # the server and the session are fine


def test_a_non_finite_number_in_a_message_or_the_samples_body_is_a_400(lora_server):
    session_id = new_session(lora_server)
    raw = '{"messages": [{"role": "user", "content": "hi", "weight": -Infinity}]}'
    reply = httpx.post(f"{lora_server.url}/sessions/{session_id}/v1/chat/completions", content=raw)
    assert (reply.status_code, reply.json()["error"][:20]) == (400, "messages[0].weight m")
    samples = httpx.post(f"{lora_server.url}/sessions/{session_id}/samples", content='{"metadata": {"r": NaN}}')
    assert (samples.status_code, samples.json()["error"][:11]) == (400, "metadata.r ")


# ---- the run's key ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed_engine_url(tiny_model_dir, tmp_path_factory):
    from servers import make_test_adapter

    adapter_dir = make_test_adapter(tiny_model_dir, tmp_path_factory.mktemp("keyed-adapter"))
    process, url = start_embedded_engine(
        tiny_model_dir, adapter_dir, tmp_path_factory.mktemp("keyed-engine"), api_key=RUN_KEY
    )
    yield url
    process.stop()


@pytest.fixture(scope="module")
def keyed_server(keyed_engine_url, start_session_server):
    return start_session_server(
        keyed_engine_url, lora_name="miles_lora", api_key=RUN_KEY, upstream_api_key=RUN_KEY, instance_id="k"
    )


def test_every_route_but_health_needs_the_run_key(keyed_server):
    auth = {"Authorization": f"Bearer {RUN_KEY}"}
    assert httpx.get(f"{keyed_server.url}/health").status_code == 200
    assert httpx.post(f"{keyed_server.url}/sessions").status_code == 401
    assert httpx.post(f"{keyed_server.url}/sessions", headers={"Authorization": "Bearer wrong"}).status_code == 401
    session_id = httpx.post(f"{keyed_server.url}/sessions", headers=auth).json()["session_id"]
    base = f"{keyed_server.url}/sessions/{session_id}"
    for method, path in [("GET", ""), ("GET", "/v1/models"), ("POST", "/samples"), ("POST", "/v1/chat/completions")]:
        assert httpx.request(method, f"{base}{path}", json={}).status_code == 401, path
    assert httpx.get(f"{keyed_server.url}/openapi.json").status_code == 401


def test_an_agent_with_the_key_plays_a_turn_through_a_keyed_engine(keyed_server):
    auth = {"Authorization": f"Bearer {RUN_KEY}"}
    session_id = httpx.post(f"{keyed_server.url}/sessions", headers=auth).json()["session_id"]
    client = openai_client(keyed_server, session_id).with_options(api_key=RUN_KEY)
    reply = client.chat.completions.create(
        model="tiny", messages=[USER], max_tokens=4, temperature=0, extra_body={"stop_token_ids": STOP_TOKEN_IDS}
    )
    assert reply.choices[0].message.content is not None
    assert len(httpx.get(f"{keyed_server.url}/sessions/{session_id}", headers=auth).json()["records"]) == 1


def test_no_response_of_the_session_server_carries_the_key(keyed_server):
    auth = {"Authorization": f"Bearer {RUN_KEY}"}
    session_id = httpx.post(f"{keyed_server.url}/sessions", headers=auth).json()["session_id"]
    base = f"{keyed_server.url}/sessions/{session_id}"
    replies = [httpx.get(f"{base}/{path}", headers=auth) for path in ("server_info", "get_server_info", "model_info")]
    replies += [
        httpx.get(f"{base}/v1/models", headers=auth),
        httpx.get(f"{keyed_server.url}/openapi.json", headers=auth),
    ]
    replies += [httpx.get(base, headers=auth), httpx.get(f"{keyed_server.url}/health")]
    assert [r.status_code for r in replies[:3]] == [404, 404, 200]
    for reply in replies:
        assert RUN_KEY not in reply.text, reply.url
    assert '"api_key"' not in replies[2].text + replies[3].text  # the engine's own replies, as proxied
