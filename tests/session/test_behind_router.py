"""The session server behind the real sglang-router (0.3.2) with two embedded engines: every session stays on
one engine, both engines serve sessions, and records keep logprobs, output ids and incremental R3 that match a
direct request to the engine that served them.

The engines are told apart by `--weight-version`: every result reports the version of the engine that
generated it, so which engine served a turn is read from the engine's own answer.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from servers import ADAPTER_NAME, chat, get_session, make_test_adapter, new_session

from miles_runner.procs.ports import free_port
from miles_runner.procs.process import ProcessGroup
from miles_runner.session.codec import decode_samples
from miles_runner.session.config import read_num_layers
from miles_runner.session.server import build_parser, config_from_args
from miles_runner.sglang_client.routed_experts import decode_routed_experts
from miles_runner.sglang_client.router import STICKY_POLICY
from miles_testkit.launch import embedded_engine_argv, engine_process, start_router
from miles_testkit.servers import ThreadedServer

pytestmark = pytest.mark.integration

ENGINE_LABELS = ("engine-a", "engine-b")
SESSIONS = 6
TURNS = 3


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """engine label -> URL: two embedded engines with R3 on and the test adapter as `miles_lora`."""
    adapter = make_test_adapter(tiny_model_dir, tmp_path_factory.mktemp("adapter"))
    logs = tmp_path_factory.mktemp("engines")
    ports = {label: free_port() for label in ENGINE_LABELS}
    with ProcessGroup() as group:
        processes = [
            group.adopt(
                engine_process(
                    engine_argv(tiny_model_dir, adapter, port, label),
                    port=port,
                    log_path=logs / f"{label}.log",
                    timeout_s=300,
                ).start()
            )
            for label, port in ports.items()
        ]
        for process in processes:  # started together, so their start-ups overlap
            process.wait_healthy()
        yield {label: f"http://127.0.0.1:{port}" for label, port in ports.items()}


def engine_argv(model_dir: Path, adapter: Path, port: int, label: str) -> list[str]:
    return embedded_engine_argv(
        model_dir,
        port,
        "--weight-version",
        label,
        "--enable-return-routed-experts",
        "--enable-lora",
        "--lora-paths",
        f"{ADAPTER_NAME}={adapter}",
    )


@pytest.fixture(scope="module")
def router_url(engines: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("router") / "router.log"
    process = start_router(list(engines.values()), port=port, log_path=log, policy=STICKY_POLICY)
    yield f"http://127.0.0.1:{port}"
    process.stop()


@pytest.fixture(scope="module")
def server(router_url, start_session_server):
    """As a run starts it behind a router: v1, the adapter on every turn, incremental R3 (in_place pause)."""
    return start_session_server(
        router_url, behind_router=True, lora_name=ADAPTER_NAME, return_routed_experts=True, use_addition_r3=True
    )


def user(session: int, turn: int) -> dict:
    return {"role": "user", "content": f"Session {session}: what is {turn} plus {session}?"}


def play(server, session: int) -> str:
    session_id = new_session(server)
    messages: list[dict] = []
    for turn in range(TURNS):
        messages.append(user(session, turn))
        reply = chat(server, session_id, messages)
        assert reply.status_code == 200, reply.text
        messages.append({"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"]})
    return session_id


@pytest.fixture(scope="module")
def sessions(server) -> list[tuple[dict, object]]:
    """Every session's GET /sessions view and its /samples reply; the sessions stay open until all are played,
    so each new one is pinned while the others still hold their engine."""
    ids = [play(server, s) for s in range(SESSIONS)]
    collected = []
    for session_id in ids:
        view = get_session(server, session_id)
        reply = httpx.post(f"{server.url}/sessions/{session_id}/samples", json={}, timeout=60, trust_env=False)
        assert reply.status_code == 200, reply.text
        collected.append((view, decode_samples(reply.content)))
    return collected


def served_by(view: dict) -> set[str]:
    return {record["response"]["choices"][0]["meta_info"]["weight_version"] for record in view["records"]}


def meta(record: dict) -> dict:
    return record["response"]["choices"][0]["meta_info"]


def test_every_turn_of_a_session_is_served_by_one_engine_and_both_engines_serve_sessions(sessions):
    engines_per_session = [served_by(view) for view, _ in sessions]
    assert all(len(engines) == 1 for engines in engines_per_session), engines_per_session
    assert set().union(*engines_per_session) == set(ENGINE_LABELS)
    assert all(len(view["records"]) == TURNS for view, _ in sessions)


def test_every_record_carries_logprobs_and_r3_rows_for_all_its_tokens(sessions, tiny_model_dir):
    num_layers = read_num_layers(tiny_model_dir)
    for view, _ in sessions:
        for record in view["records"]:
            info, prompt = meta(record), record["request"]["input_ids"]
            assert len(info["output_token_logprobs"]) == info["completion_tokens"] > 0
            assert record["request"]["lora_path"] == ADAPTER_NAME
            start = record["request"]["routed_experts_start_len"]
            rows = len(prompt) + info["completion_tokens"] - 1 - start
            assert decode_routed_experts(info["routed_experts"], rows, num_layers).shape[:2] == (rows, num_layers)


def test_samples_lose_no_token_logprob_or_routing_row(sessions):
    for view, reply in sessions:
        [sample] = reply.samples
        assert sample.tokens == view["metadata"]["accumulated_token_ids"]
        assert len(sample.rollout_log_probs) == len(sample.loss_mask) == sample.response_length
        assert sum(sample.loss_mask) == sum(meta(record)["completion_tokens"] for record in view["records"])
        assert len(sample.rollout_routed_experts) == len(sample.tokens) - 1


def test_incremental_r3_equals_a_direct_request_to_the_engine_that_served_the_session(
    sessions, engines, tiny_model_dir
):
    num_layers = read_num_layers(tiny_model_dir)
    for view, reply in sessions:
        [engine] = served_by(view)
        final_ids = view["metadata"]["accumulated_token_ids"]
        oracle = direct_generate(engines[engine], final_ids[:-1])
        assert [entry[1] for entry in oracle["meta_info"]["output_token_logprobs"]] == [final_ids[-1]]
        full = decode_routed_experts(oracle["meta_info"]["routed_experts"], len(final_ids) - 1, num_layers)
        assert reply.samples[0].rollout_routed_experts.tobytes() == full.tobytes()


def direct_generate(engine_url: str, input_ids: list[int]) -> dict:
    """One greedy token with the adapter and full R3, straight to the engine (the reference)."""
    payload = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_logprob": True,
        "return_routed_experts": True,
        "lora_path": ADAPTER_NAME,
    }
    response = httpx.post(f"{engine_url}/generate", json=payload, timeout=120, trust_env=False)
    response.raise_for_status()
    return response.json()


def test_the_router_drops_the_r3_request_fields_which_is_why_turns_bypass_it(router_url, engines, sessions):
    """Pins the router behaviour the design rests on (session/upstream.py): if a router version starts to
    carry R3 through /generate, this fails and the direct path can be reconsidered."""
    view, _ = sessions[0]
    prompt = view["records"][0]["request"]["input_ids"]
    payload = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 2, "temperature": 0},
        "return_logprob": True,
        "return_routed_experts": True,
    }
    through_router = httpx.post(f"{router_url}/generate", json=payload, timeout=120, trust_env=False).json()
    direct = httpx.post(f"{engines['engine-a']}/generate", json=payload, timeout=120, trust_env=False).json()
    assert "routed_experts" in direct["meta_info"]
    assert "routed_experts" not in through_router["meta_info"]


def test_other_session_paths_still_go_through_the_router(server, sessions):
    view, _ = sessions[0]
    reply = httpx.get(f"{server.url}/sessions/{view['session_id']}/v1/models", timeout=30, trust_env=False)
    assert reply.status_code == 200
    assert reply.json()["data"][0]["id"]


def test_a_deleted_session_releases_its_engine(server):
    session_id = play(server, SESSIONS)
    upstream = server.app.state.core.upstream
    assert upstream.pinned(session_id) is not None
    assert httpx.delete(f"{server.url}/sessions/{session_id}", trust_env=False).status_code == 204
    assert upstream.pinned(session_id) is None


def test_the_router_url_flag_puts_the_server_behind_that_router():
    args = ["--router-url", "http://127.0.0.1:1", "--model-path", "m", "--port", "7"]
    config = config_from_args(build_parser().parse_args(args))
    assert (config.engine_url, config.behind_router) == ("http://127.0.0.1:1", True)
    with pytest.raises(SystemExit):
        build_parser().parse_args([*args, "--engine-url", "http://127.0.0.1:2"])


def test_a_router_without_a_healthy_worker_gives_a_502_naming_it(start_session_server):
    """Fault injection: a stand-in for the router whose only worker is marked unhealthy."""
    fault = FastAPI()

    @fault.get("/workers")
    def workers() -> dict:
        return {"workers": [{"url": "http://127.0.0.1:1", "is_healthy": False}]}

    router = ThreadedServer(fault).start()
    try:
        server = start_session_server(router.url, behind_router=True)
        reply = chat(server, new_session(server), [user(0, 0)])
    finally:
        router.stop()
    assert reply.status_code == 502
    assert "lists no healthy worker" in reply.json()["error"]
