"""Request limits: the plan's engine.max_n and engine.max_batch_size reach the embedded
engine's command line, and a request beyond either is refused before any of its outputs is built."""

from __future__ import annotations

import pytest

from miles_runner.config.compose import compose
from miles_runner.embedded_engine.protocol import ChatCompletionRequest, GenerateReqInput
from miles_runner.plan.compile import compile_design, compile_plan

pytestmark = pytest.mark.reliability

IDS = [5, 6, 7]


@pytest.fixture(scope="module")
def plan_engine():
    """An engine built (in-process, not served) from the argv a plan with small limits renders for it."""
    from miles_runner.embedded_engine.args import parse_args
    from miles_runner.embedded_engine.engine import EmbeddedEngine

    overrides = ["+recipe=tiny_lora_agentic", "session=off", "rollout.n_samples_per_prompt=2", "engine.base_port=30010"]
    plan = compile_plan(compose([*overrides, "engine.max_n=2", "engine.max_batch_size=3"]))
    argv = plan.engines[0].launch.argv
    assert argv[:3] == ["python", "-m", "miles_runner.embedded_engine"]
    return EmbeddedEngine(parse_args(argv[3:]))


def _generate(n: int, prompts: int = 1) -> GenerateReqInput:
    ids = [IDS] * prompts if prompts > 1 else IDS
    return GenerateReqInput(input_ids=ids, sampling_params={"n": n, "max_new_tokens": 1})


def test_the_plans_engine_limits_reach_the_engine(plan_engine):
    requests, _ = plan_engine.build_generate_requests(_generate(n=2))  # at the limits: served
    assert len(requests) == 2
    with pytest.raises(ValueError, match=r"n \(3\).*engine\.max_n"):
        plan_engine.build_generate_requests(_generate(n=3))
    with pytest.raises(ValueError, match=r"4 outputs.*engine\.max_batch_size"):
        plan_engine.build_generate_requests(_generate(n=2, prompts=2))
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], n=3)
    from miles_runner.embedded_engine.openai_chat import build_chat_requests

    with pytest.raises(ValueError, match=r"engine\.max_n"):
        build_chat_requests(plan_engine, chat)


def test_an_sglang_plan_claims_no_limit_and_refuses_setting_one():
    from miles_runner.core.errors import PlanError
    from miles_runner.plan.summary import engines_line

    sglang = compile_design(compose(["cluster=gpu_1x", "engine=sglang"]))
    assert not {"--max-n", "--max-batch-size"} & set(sglang.engines[0].launch.argv)  # SGLang has no such flags
    assert "no per-request n or batch limit" in engines_line(sglang)
    assert "at most n 256 and 4096 outputs" in engines_line(compile_plan(compose([])))
    with pytest.raises(PlanError, match="sglang-engine-has-no-request-limits"):
        compile_design(compose(["cluster=gpu_1x", "engine=sglang", "engine.max_n=8"]))


def test_a_rollout_group_above_a_limit_is_refused_at_plan_time():
    from miles_runner.core.errors import PlanError

    with pytest.raises(PlanError, match=r"engine\.max_batch_size"):
        compile_plan(compose(["rollout.n_samples_per_prompt=8", "engine.max_batch_size=4"]))
