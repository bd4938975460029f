"""What a rollout needs, resolved once from the plan: the engine client, tokenizer, task, reward and agent."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from miles_runner.engine.client import EngineClient
from miles_runner.plan.model import Plan
from miles_runner.plugins.agents import AgentFn
from miles_runner.plugins.lookup import get_agent, get_reward, make_task
from miles_runner.plugins.rewards import RewardFn
from miles_runner.plugins.tasks import Task
from miles_runner.session.tito import TitoTokenizer


@dataclass
class RolloutContext:
    plan: Plan
    client: EngineClient  # the router, else the only engine
    tokenizer: Any  # a TitoTokenizer: one chat rendering for single-turn and session rollouts
    task: Task
    reward: RewardFn
    agent: AgentFn | None
    session_url: str | None
    lora_name: str | None  # the adapter every request is generated with (None: the base model)

    @classmethod
    def from_plan(cls, plan: Plan, client: EngineClient, session_url: str | None) -> RolloutContext:
        rollout = plan.rollout
        agentic = plan.session is not None
        lora = plan.adapters[0].lora_name if plan.capabilities.lora_rollout_enabled and plan.adapters else None
        return cls(
            plan=plan,
            client=client,
            tokenizer=TitoTokenizer.from_model_path(plan.model_path),
            task=make_task(rollout.task, plan.seed, rollout.data),
            reward=get_reward(rollout.reward),
            agent=get_agent(rollout.agent) if agentic else None,
            session_url=session_url,
            lora_name=lora,
        )

    def sampling_params(self) -> dict[str, Any]:
        r = self.plan.rollout
        return {"max_new_tokens": r.max_response_len, "temperature": r.temperature, "top_p": r.top_p,
                "top_k": r.top_k}
