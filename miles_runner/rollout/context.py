"""What a rollout needs, resolved once from the plan: the engines, tokenizer, task, reward and agent."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_runner.plan.model import Plan
from miles_runner.plugins.agents import AgentFn
from miles_runner.plugins.lookup import get_agent, get_reward, make_task
from miles_runner.plugins.rewards import RewardFn
from miles_runner.plugins.tasks import Task
from miles_runner.session.config import read_num_layers
from miles_runner.session.tito import TitoTokenizer
from miles_runner.sglang_client.engine_pool import EnginePool


@dataclass
class RolloutContext:
    plan: Plan
    engines: EnginePool  # the engines a prompt group is pinned to, one group per engine (sglang_client/engine_pool.py)
    tokenizer: Any  # a TitoTokenizer: one chat rendering for single-turn and session rollouts
    task: Task
    reward: RewardFn
    agent: AgentFn | None
    session_url: str | None
    lora_name: str | None  # the adapter every request is generated with (None: the base model)
    # Routing replay (R3): the decoder layers of the model's routing rows; None when no routing is asked for.
    routed_experts_layers: int | None = None
    api_key: str | None = field(default=None, repr=False)  # the run's key: the session server requires it

    @classmethod
    def from_plan(
        cls, plan: Plan, engines: EnginePool, session_url: str | None, *, api_key: str | None = None
    ) -> RolloutContext:
        rollout = plan.rollout
        agentic = plan.session is not None
        lora = plan.adapters[0].lora_name if plan.capabilities.lora_rollout_enabled and plan.adapters else None
        return cls(
            plan=plan,
            engines=engines,
            tokenizer=TitoTokenizer.from_model_path(plan.model_path),
            task=make_task(rollout.task, plan.seed, rollout.data),
            reward=get_reward(rollout.reward),
            agent=get_agent(rollout.agent) if agentic else None,
            session_url=session_url,
            lora_name=lora,
            routed_experts_layers=read_num_layers(Path(plan.model_path)) if rollout.routing_replay else None,
            api_key=api_key,
        )

    def sampling_params(self) -> dict[str, Any]:
        r = self.plan.rollout
        return {"max_new_tokens": r.max_response_len, "temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k}


def rollout_engines(plan: Plan, engine_urls: Sequence[str], *, api_key: str | None = None) -> EnginePool:
    """The engines a run's rollouts go to: those the router lists as healthy when the plan has a router (so a
    restarted, re-registered engine is seen), else the deployment's engines; never the router itself, which drops R3."""
    router = plan.router.launch.url if plan.router else None
    return EnginePool.for_deployment(router, engine_urls, api_key=api_key)
