"""The engines the executor starts are the plan's: how many, which module, and the model name, context length and
seed each one serves with. One embedded engine is started from a plan and asked what it serves."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator

import httpx
import pytest

from miles_runner.config.compose import compose
from miles_runner.executors.controller_service import controller_process
from miles_runner.executors.local import Deployment, LocalExecutor
from miles_runner.plan.compile import compile_design, compile_plan
from miles_runner.plan.model import Plan
from miles_runner.procs.ports import free_port_block
from miles_runner.procs.process import ProcessStartError

pytestmark = pytest.mark.integration

SERVED_NAME = "tiny-served"
CONTEXT = 40
SEED = 77


def plan_of(*overrides: str) -> Plan:
    return compile_plan(compose(["+recipe=tiny_lora_agentic", "session=off", *overrides]))


def engine_processes(plan: Plan, run_dir) -> list:
    """The engine processes the executor starts for the plan (not started here)."""
    executor = LocalExecutor(plan, run_dir)
    return [executor.engine_process(engine) for engine in plan.engines]


def asleep(launch):
    """Injected fault: the component's command sleeps instead of serving."""
    return dataclasses.replace(launch, argv=["python", "-c", "import time; time.sleep(120)"])


@pytest.mark.parametrize("rollout_gpus", [1, 3])
def test_a_disaggregated_plan_starts_one_engine_per_rollout_gpu(tmp_path, rollout_gpus):
    plan = plan_of(
        "topology=disaggregated",
        "cluster.cpu_devices_per_node=4",
        "topology.actor_num_gpus_per_node=1",
        f"topology.rollout_num_gpus={rollout_gpus}",
        f"engine.base_port={free_port_block(3)}",
    )
    processes = engine_processes(plan, tmp_path)
    assert [p.name for p in processes] == [f"engine{i}" for i in range(rollout_gpus)]
    assert len({p.health_url for p in processes}) == rollout_gpus  # each on a port of its own


def test_engine_kind_selects_the_module_the_executor_starts(tmp_path):
    embedded = engine_processes(plan_of(), tmp_path)[0]
    sglang = engine_processes(compile_design(compose(["cluster=gpu_1x", "engine=sglang"])), tmp_path)[0]
    assert embedded.argv[:3] == [sys.executable, "-m", "miles_runner.embedded_engine"]
    assert sglang.argv[:3] == [sys.executable, "-m", "sglang.launch_server"]


def test_an_engine_not_healthy_within_engine_startup_timeout_s_fails_the_start_naming_it(tmp_path):
    plan = plan_of("engine.startup_timeout_s=1.5", f"engine.base_port={free_port_block(1)}")
    plan = dataclasses.replace(
        plan, engines=[dataclasses.replace(plan.engines[0], launch=asleep(plan.engines[0].launch))]
    )
    executor = LocalExecutor(plan, tmp_path)
    with pytest.raises(ProcessStartError, match=r"engine0 was not healthy at .* within 1\.5 s"):
        executor.start()
    assert executor.group.processes == ()


def test_a_service_not_healthy_within_executor_health_timeout_s_fails_naming_it(tmp_path):
    plan = compile_plan(
        compose(["+recipe=tiny_multi_lora", "executor.health_timeout_s=1.5", f"adapters.api_port={free_port_block(1)}"])
    )
    plan = dataclasses.replace(
        plan, multi_lora=dataclasses.replace(plan.multi_lora, launch=asleep(plan.multi_lora.launch))
    )
    controller = controller_process(plan, tmp_path)
    with pytest.raises(ProcessStartError, match=r"multi_lora_controller was not healthy at .* within 1\.5 s"):
        controller.start().wait_healthy()
    assert not controller.alive


# ---- one engine started from a plan ----


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[Plan, Deployment]]:
    plan = plan_of(
        f"model.name={SERVED_NAME}",
        f"model.max_context_len={CONTEXT}",
        f"run.seed={SEED}",
        f"engine.base_port={free_port_block(1)}",
    )
    with LocalExecutor(plan, tmp_path_factory.mktemp("served"), startup_timeout_s=180) as deployment:
        yield plan, deployment


def engine_url(served) -> str:
    return served[1].engine_urls[0]


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url, json=body, timeout=60, trust_env=False)


@pytest.mark.timeout(240)
def test_the_engine_serves_the_base_model_under_model_name(served):
    url = engine_url(served)
    [base] = [card for card in httpx.get(f"{url}/v1/models", timeout=10).json()["data"] if card["parent"] is None]
    assert (base["id"], base["root"]) == (SERVED_NAME, SERVED_NAME)
    assert httpx.get(f"{url}/model_info", timeout=10).json()["served_model_name"] == SERVED_NAME
    assert httpx.get(f"{url}/v1/models/{SERVED_NAME}", timeout=10).status_code == 200


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model", [SERVED_NAME, "any-other-name"])
def test_a_chat_is_served_whatever_model_it_names_and_the_reply_echoes_it(served, model):
    # As SGLang: `model` is not checked against the served name (only its ':adapter' suffix is read).
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    reply = post(f"{engine_url(served)}/v1/chat/completions", body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == model


@pytest.mark.timeout(240)
def test_the_engine_serves_with_the_plans_context_length(served):
    url = engine_url(served)
    assert httpx.get(f"{url}/server_info", timeout=10).json()["context_length"] == CONTEXT
    [base] = [card for card in httpx.get(f"{url}/v1/models", timeout=10).json()["data"] if card["parent"] is None]
    assert base["max_model_len"] == CONTEXT


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("prompt_len", "max_new_tokens", "refusal"),
    [
        (CONTEXT, 1, "longer than the model's context length"),
        (CONTEXT - 10, 11, f"maximum context length of {CONTEXT} tokens"),
        (CONTEXT - 10, 10, None),
    ],
)
def test_a_request_beyond_the_context_length_is_refused_with_400(served, prompt_len, max_new_tokens, refusal):
    body = {"input_ids": [5] * prompt_len, "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}
    reply = post(f"{engine_url(served)}/generate", body)
    if refusal:
        assert reply.status_code == 400 and refusal in reply.text, reply.text
    else:
        assert reply.status_code == 200, reply.text
        assert prompt_len + reply.json()["meta_info"]["completion_tokens"] <= CONTEXT


@pytest.mark.timeout(240)
def test_the_engine_seeds_its_sampling_with_run_seed(served):
    assert httpx.get(f"{engine_url(served)}/server_info", timeout=10).json()["random_seed"] == SEED
