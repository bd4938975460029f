"""Every request body the project sends to an engine, checked against the pinned SGLang's own request
definitions (read from its wheel: miles_testkit/contract/sglang_spec.py). wire_check.py says how strict: a body
SGLang would refuse fails, and so does a field SGLang would silently drop.

The bodies are the real ones: each code path (the EngineClient contract, adapter syncs, rollouts, session turns,
the multi-LoRA controller) runs against the embedded engine through a RecordingProxy, a test instrument that
forwards every request unchanged and keeps what was sent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from pathlib import Path

import pytest

from miles_runner.config.compose import compose
from miles_runner.core.adapters import adapter_request_fields, rid_prefix
from miles_runner.core.errors import PlanError
from miles_runner.core.sglang_protocol import LORA_BROADCAST_ROUTE, MILES_FORK, STOCK
from miles_runner.plan.compile import compile_plan
from miles_runner.plan.model import Plan
from miles_runner.procs.ports import LOOPBACK, free_port
from miles_runner.rollout.agentic import SessionClients, play_episode
from miles_runner.rollout.context import RolloutContext
from miles_runner.rollout.single_turn import generate_group, generate_sample
from miles_runner.session.app import create_app as create_session_app
from miles_runner.session.config import SessionServerConfig
from miles_runner.sglang_client import client as client_module
from miles_runner.sglang_client.client import EngineClient
from miles_runner.sglang_client.engine_pool import EnginePool
from miles_runner.sglang_client.tensor_wire import serialize_lora_tensors, serialize_named_tensors
from miles_runner.sglang_client.weight_update_group import (
    broadcast_tensors,
    destroy_weight_update_group,
    init_weight_update_group,
)
from miles_runner.weight_sync.broadcast import BroadcastSync
from miles_runner.weight_sync.tensor_sync import TensorSync
from miles_testkit.contract import CONTRACT_ADAPTER, CONTRACT_CHECKS, ContractTarget, run_contract
from miles_testkit.contract import errors as contract_errors
from miles_testkit.contract.sglang_spec import IGNORED, REFUSED
from miles_testkit.contract.wire_check import SentRequest, check_request, check_requests
from miles_testkit.servers import RecordingProxy, ThreadedServer

from .test_contract import EMBEDDED_LONG_TOKENS

pytestmark = pytest.mark.integration

# The contract's malformed-request checks send bad bodies on purpose (the wire check flags them, rightly).
WELL_FORMED_CHECKS = [check for check in CONTRACT_CHECKS if check.__module__ != contract_errors.__name__]
DISAGGREGATED = ("topology=disaggregated", "topology.rollout_num_gpus=1", "topology.actor_num_gpus_per_node=1")
WIRE_GROUP = "wire_check_group"

# The routes each capture test below must see its code path use; together they are every route EngineClient
# calls (test_every_route_the_client_calls_is_captured_below).
CONTRACT_ROUTES = {
    "/generate",
    "/v1/chat/completions",
    "/abort_request",
    "/pause_generation",
    "/continue_generation",
    "/flush_cache",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/load_lora_adapter",
    "/unload_lora_adapter",
    "/load_lora_adapter_from_tensors",
    "/update_weights_from_disk",
    "/update_weights_from_tensor",
    "/update_weight_version",
    "/model_info",
    "/server_info",
    "/v1/models",
    "/health",
    "/health_generate",
}
TENSOR_SYNC_ROUTES = {
    "/pause_generation",
    "/flush_cache",
    "/unload_lora_adapter",
    "/load_lora_adapter_from_tensors",
    "/update_weight_version",
    "/continue_generation",
}
BROADCAST_ROUTES = {
    "/init_weights_update_group",
    LORA_BROADCAST_ROUTE,
    "/update_weights_from_distributed",
    "/destroy_weights_update_group",
}


def _plan(*overrides: str) -> Plan:
    return compile_plan(compose(list(overrides)))


def _adapter(path: Path) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    return json.loads((path / "adapter_config.json").read_text()), load_file(str(path / "adapter_model.safetensors"))


def _problems(spec, proxy: RecordingProxy, build: str) -> list[str]:
    return [str(problem) for problem in check_requests(spec, proxy.sent, build)]


# ---- the check itself --------------------------------------------------------------------------------------


def test_the_spec_maps_each_route_to_its_request_class(sglang_spec):
    routes = sglang_spec.routes
    assert (routes["/generate"].body.name, routes["/generate"].gate.name) == ("GenerateReqInput", "GenerateRequest")
    assert routes["/abort_request"].body.name == "AbortReq"
    assert routes["/v1/chat/completions"].body.name == "ChatCompletionRequest"
    tensors = routes["/load_lora_adapter_from_tensors"].body.fields["serialized_named_tensors"]
    assert tensors.required and tensors.kinds == {"array"}
    assert LORA_BROADCAST_ROUTE not in routes  # what core.sglang_protocol lists as fork-only


def test_sglang_drops_unknown_top_level_keys_and_its_generate_gate_refuses_unknown_sampling_keys(sglang_spec):
    routes = sglang_spec.routes
    assert routes["/abort_request"].body.unknown_keys == IGNORED
    assert routes["/v1/chat/completions"].body.unknown_keys == IGNORED
    assert routes["/generate"].gate_structs["SamplingParams"].unknown_keys == REFUSED


def test_the_old_lora_tensor_body_is_refused(sglang_spec):
    body = {"lora_name": "a", "config_dict": {"r": 8}, "serialized_tensors": "QUJD"}
    problems = check_request(sglang_spec, SentRequest("POST", "/load_lora_adapter_from_tensors", body))
    assert {(p.field, p.sglang_refuses) for p in problems} == {
        ("serialized_named_tensors", True),  # required and missing: a 400
        ("serialized_tensors", False),  # unknown: dropped
    }


def test_one_string_where_sglang_takes_a_list_per_rank_is_refused(sglang_spec):
    body = {"lora_name": "a", "config_dict": {"r": 8}, "serialized_named_tensors": "QUJD"}
    [problem] = check_request(sglang_spec, SentRequest("POST", "/load_lora_adapter_from_tensors", body))
    assert problem.field == "serialized_named_tensors" and problem.sglang_refuses
    assert "a JSON str" in problem.problem


def test_an_unknown_sampling_key_is_refused_by_the_generate_gate(sglang_spec):
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4, "top_kk": 5}}
    [problem] = check_request(sglang_spec, SentRequest("POST", "/generate", body))
    assert (problem.field, problem.sglang_refuses) == ("sampling_params.top_kk", True)


def test_an_unknown_top_level_field_is_reported_as_dropped(sglang_spec):
    body = {"input_ids": [1, 2], "return_routed_expert": True}
    [problem] = check_request(sglang_spec, SentRequest("POST", "/generate", body))
    assert (problem.field, problem.sglang_refuses) == ("return_routed_expert", False)


def test_the_push_probe_body_is_one_sglang_takes_whole(sglang_spec):
    from miles_runner.weight_sync.probe import probe_body

    assert check_request(sglang_spec, SentRequest("POST", "/generate", probe_body([5, 6, 7], "policy"))) == []


def test_a_pause_mode_outside_sglangs_literal_is_refused(sglang_spec):
    [problem] = check_request(sglang_spec, SentRequest("POST", "/pause_generation", {"mode": "inplace"}))
    assert problem.field == "mode" and problem.sglang_refuses


def test_a_route_that_requires_a_body_is_refused_without_one(sglang_spec):
    [problem] = check_request(sglang_spec, SentRequest("POST", "/continue_generation", None))
    assert problem.sglang_refuses and "requires one" in problem.problem


@pytest.mark.parametrize(
    "sent",
    [
        SentRequest("POST", "/abort_request", {"rid": "a::", "abort_all": False, "prefix": True}),
        SentRequest(
            "POST",
            LORA_BROADCAST_ROUTE,
            {
                "lora_name": "a",
                "config_dict": {},
                "names": [],
                "dtypes": [],
                "shapes": [],
                "group_name": "g",
                "upsert": True,
            },
        ),
    ],
    ids=["abort-prefix", "lora-broadcast"],
)
def test_fork_features_pass_only_on_the_fork_build(sglang_spec, sent):
    assert check_request(sglang_spec, sent, MILES_FORK) == []
    assert check_request(sglang_spec, sent, STOCK) != []


def test_a_field_the_fork_route_does_not_take_is_refused(sglang_spec):
    sent = SentRequest("POST", LORA_BROADCAST_ROUTE, {"lora_name": "a", "config_dict": {}, "adapter": "x"})
    assert [p.field for p in check_request(sglang_spec, sent, MILES_FORK)] == ["adapter"]


# ---- the project's own bodies ---------------------------------------------------------------------------------


def test_every_route_the_client_calls_is_captured_below():
    source = Path(client_module.__file__).read_text()
    called = set(re.findall(r'"(/[a-z_/0-9]+)"', source)) - {"/get_model_info", "/get_server_info"}  # 404 fallbacks
    assert called <= CONTRACT_ROUTES | TENSOR_SYNC_ROUTES | BROADCAST_ROUTES


async def test_every_engine_client_call_of_the_contract_speaks_sglang(
    recording_proxy, sglang_spec, tiny_moe_dir, contract_adapter
):
    async with EngineClient(recording_proxy.url, timeout_s=120) as client:
        target = ContractTarget(
            client,
            tiny_moe_dir,
            CONTRACT_ADAPTER,
            contract_adapter,
            lora_wire=serialize_lora_tensors,
            weights_wire=serialize_named_tensors,
            long_tokens=EMBEDDED_LONG_TOKENS,
        )
        summary = await run_contract(target, WELL_FORMED_CHECKS)
    assert summary["failed"] == 0, {name: r for name, r in summary["checks"].items() if not r["ok"]}
    assert set(recording_proxy.paths()) >= CONTRACT_ROUTES
    # The contract also checks the fork's prefix abort (the embedded engine serves as the fork by default).
    assert _problems(sglang_spec, recording_proxy, MILES_FORK) == []


async def test_colocated_tensor_sync_speaks_stock_sglang(recording_proxy, sglang_spec, contract_adapter):
    plan = _plan("engine.build=stock")  # colocated: a stock plan
    config, tensors = _adapter(contract_adapter)
    async with EngineClient(recording_proxy.url, timeout_s=120) as client:
        sync = TensorSync([client], plan, "wire_tensor_sync")
        try:
            await sync.push(tensors, config, version=1)
            await sync.push(tensors, config, version=2)  # the second push unloads first
        finally:
            await client.unload_lora_adapter("wire_tensor_sync")
            await client.update_weight_version("default")
    assert set(recording_proxy.paths()) >= TENSOR_SYNC_ROUTES
    body = next(r.body for r in recording_proxy.sent if r.path == "/load_lora_adapter_from_tensors")
    assert len(body["serialized_named_tensors"]) == plan.engines[0].tp_size  # one entry per TP rank
    assert _problems(sglang_spec, recording_proxy, plan.engines[0].build) == []


async def test_broadcast_sync_uses_only_the_fork_feature_its_plan_rule_guards(
    recording_proxy, sglang_spec, contract_adapter, tiny_moe_dir
):
    plan = _plan(*DISAGGREGATED)
    config, tensors = _adapter(contract_adapter)
    async with EngineClient(recording_proxy.url, timeout_s=120) as client:
        sync = BroadcastSync([client], plan, "wire_broadcast", timeout_s=30)
        try:
            await sync.push(tensors, config, version=1)
        finally:
            await sync.close()
            await client.unload_lora_adapter("wire_broadcast")
            await client.update_weight_version("default")
        await _broadcast_base_weights(client, tiny_moe_dir)
    assert set(recording_proxy.paths()) >= BROADCAST_ROUTES
    assert plan.engines[0].build == MILES_FORK
    assert _problems(sglang_spec, recording_proxy, MILES_FORK) == []
    stock = check_requests(sglang_spec, recording_proxy.sent, STOCK)
    assert {p.route for p in stock} == {LORA_BROADCAST_ROUTE}
    with pytest.raises(PlanError, match="stock-sglang-has-no-lora-broadcast"):
        _plan(*DISAGGREGATED, "engine.build=stock")


async def _broadcast_base_weights(client: EngineClient, model_dir: Path) -> None:
    """/update_weights_from_distributed of one base tensor, unchanged, over a group of its own."""
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as weights:
        norm = weights.get_tensor("model.norm.weight").contiguous()
    port = free_port()
    join_here = asyncio.to_thread(
        init_weight_update_group,
        backend="gloo",
        master_address=LOOPBACK,
        master_port=port,
        rank=0,
        world_size=2,
        group_name=WIRE_GROUP,
        timeout_s=30,
    )
    join_there = client.init_weights_update_group(LOOPBACK, port, 1, 2, group_name=WIRE_GROUP, backend="gloo")
    group, _ = await asyncio.gather(join_here, join_there)
    try:
        send = asyncio.to_thread(broadcast_tensors, [norm], group)
        update = client.update_weights_from_distributed(
            ["model.norm.weight"], ["float32"], [list(norm.shape)], group_name=WIRE_GROUP
        )
        await asyncio.gather(send, update)
    finally:
        await client.destroy_weights_update_group(WIRE_GROUP)
        destroy_weight_update_group(group)
        await client.update_weight_version("default")


async def test_single_turn_rollout_requests_speak_stock_sglang(recording_proxy, sglang_spec):
    plan = _plan("engine.build=stock", "rollout.routing_replay=true", "rollout.max_response_len=4")
    async with EnginePool.for_deployment(None, [recording_proxy.url], timeout_s=120) as workers:
        ctx = dataclasses.replace(RolloutContext.from_plan(plan, workers, None), lora_name=CONTRACT_ADAPTER)
        prompt, engine = ctx.task.prompt(0), await workers.pin("wire")
        await generate_sample(ctx, engine, prompt, {"rid": "wire-single", "lora_path": CONTRACT_ADAPTER})
        # A multi-LoRA request: the slot, a `name::` rid and the adapter version's cache namespace.
        await generate_sample(ctx, engine, prompt, adapter_request_fields("wire", CONTRACT_ADAPTER, 3))
        # A prompt group: one batch request, the prompt once per rid; a sample per rid, in rid order.
        group = await generate_group(ctx, engine, prompt, ["wire-g-s0", "wire-g-s1"], {"lora_path": CONTRACT_ADAPTER})
    assert recording_proxy.paths() == ["/generate"] * 3
    batch = recording_proxy.sent[-1].body
    prompt_ids = group[0].tokens[: -group[0].response_length]
    assert batch["rid"] == ["wire-g-s0", "wire-g-s1"] and batch["input_ids"] == [prompt_ids] * 2
    assert len(group) == 2 and all(len(s.rollout_log_probs) == s.response_length for s in group)
    assert _problems(sglang_spec, recording_proxy, STOCK) == []


async def test_session_turns_speak_stock_sglang(recording_proxy, sglang_spec, tiny_moe_dir):
    plan = _plan("+recipe=tiny_lora_agentic", "engine.build=stock")
    config = SessionServerConfig(
        engine_url=recording_proxy.url,
        model_path=str(tiny_moe_dir),
        lora_name=CONTRACT_ADAPTER,
        return_routed_experts=True,
        use_addition_r3=True,
    )
    session = ThreadedServer(create_session_app(config)).start()
    try:
        async with EngineClient(recording_proxy.url) as client, SessionClients(session.url) as clients:
            ctx = RolloutContext.from_plan(plan, client, session.url)
            for index in range(2):  # a wrong first answer gets a second turn (incremental R3 from its checkpoint)
                await play_episode(ctx, clients, ctx.task.prompt(index))
    finally:
        session.stop()
    assert recording_proxy.sent, "the session server sent nothing to the engine"
    assert _problems(sglang_spec, recording_proxy, STOCK) == []


async def test_multi_lora_controller_aborts_with_the_fork_prefix_field(recording_proxy, sglang_spec, tmp_path):
    from miles_runner.multi_lora.settings import settings_from_plan

    plan = _plan("+recipe=tiny_multi_lora")
    settings = settings_from_plan(plan, tmp_path)
    controller = dataclasses.replace(settings, engine_urls=(recording_proxy.url,)).build_controller()
    await controller.abort_adapter_requests("wire")
    [sent] = recording_proxy.sent
    assert (sent.path, sent.body["rid"], sent.body["prefix"]) == ("/abort_request", rid_prefix("wire"), True)
    assert check_request(sglang_spec, sent, plan.engines[0].build) == []
    assert [p.field for p in check_request(sglang_spec, sent, STOCK)] == ["prefix"]
    with pytest.raises(PlanError, match="stock-sglang-has-no-prefix-abort"):
        _plan("+recipe=tiny_multi_lora", "engine.build=stock")
