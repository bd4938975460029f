"""Resolve the plug-in names a plan carries (``rollout.task``, ``rollout.reward``, ``rollout.agent``)."""

from __future__ import annotations

from miles_runner.plugins.agents import AGENTS, AgentFn
from miles_runner.plugins.rewards import REWARDS, RewardFn
from miles_runner.plugins.tasks import TASKS, Task


def make_task(name: str, seed: int, data: str = "") -> Task:
    return TASKS.get(name)(seed, data)


def get_reward(name: str) -> RewardFn:
    return REWARDS.get(name)


def get_agent(name: str) -> AgentFn:
    return AGENTS.get(name)


def registered() -> dict[str, list[str]]:
    """Every registered name by kind (for error messages and `--help`-style listings)."""
    return {"task": TASKS.names(), "reward": REWARDS.names(), "agent": AGENTS.names()}
