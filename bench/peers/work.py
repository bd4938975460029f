"""The work both sides do, defined once: miles-run gets it as command-line overrides of the default recipe, and
TRL gets it from the plan miles-run compiles from those overrides (``peer_work``), so the two cannot drift apart.

Stdlib only: the peers venv imports this module too.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

RECIPE = "tiny_lora_agentic"


@dataclass(frozen=True)
class Row:
    """One row of the comparison. ``overrides`` select it on top of the recipe; an empty list keeps the recipe's
    task, reward, turns and session server (the agentic row)."""

    name: str
    title: str
    overrides: tuple[str, ...] = ()


# count is count_retry's skill in one turn (plugins/tasks.py): the single-turn row of the recipe's task.
SINGLE_TURN = Row(
    "single_turn",
    "single turn (`session=off`)",
    ("session=off", "rollout.task=count", "rollout.reward=exact_match", "rollout.max_turns=1"),
)
AGENTIC = Row("agentic", "agentic (recipe's task through the session server)")
ROWS = {row.name: row for row in (SINGLE_TURN, AGENTIC)}


@dataclass(frozen=True)
class Work:
    """What one step is, and how many: 8 prompts x 8 samples, <= 8 new tokens, one optimizer step per batch."""

    prompts: int = 8
    samples: int = 8
    max_new_tokens: int = 8
    lora_rank: int = 8
    lora_alpha: int = 16
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    lr: float = 0.005  # the recipe's
    steps: int = 10
    seed: int = 0
    temperature: float = 1.0


def miles_overrides(work: Work, row: Row) -> list[str]:
    """miles-run's work overrides for `row` (ports, run folder and logging are the caller's)."""
    return [
        f"+recipe={RECIPE}",
        *row.overrides,
        f"rollout.rollout_batch_size={work.prompts}",
        f"rollout.n_samples_per_prompt={work.samples}",
        f"rollout.max_response_len={work.max_new_tokens}",
        f"rollout.temperature={work.temperature}",
        f"adapters.rank={work.lora_rank}",
        f"adapters.alpha={work.lora_alpha}",
        f"adapters.target_modules=[{','.join(work.targets)}]",
        f"optimizer.lr={work.lr}",
        "algorithm.global_batch_size=0",  # 0: one optimizer step per rollout
        f"algorithm.num_steps={work.steps}",
        f"run.seed={work.seed}",
    ]


@dataclass(frozen=True)
class PeerWork:
    """The work as TRL needs it, read off miles-run's compiled plan (the same model folder, task, reward, ...)."""

    row: str
    model_path: str
    task: str
    reward: str
    max_turns: int
    prompts: int
    samples: int
    max_new_tokens: int
    lora_rank: int
    lora_alpha: float
    targets: list[str]
    lr: float
    adam_betas: tuple[float, float]
    weight_decay: float
    clip_grad: float
    eps_clip: float
    eps_clip_high: float
    kl_coef: float
    steps: int
    seed: int
    temperature: float
    top_p: float
    std_normalized: bool  # advantages divided by the group's reward std (TRL: scale_rewards="group")
    per_token_loss: bool  # the loss is a mean over tokens (TRL: "dapo"), not over samples (TRL: "grpo")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> PeerWork:
        data = json.loads(text)
        return cls(**{**data, "adam_betas": tuple(data["adam_betas"])})


def peer_work(plan: Any, row: Row) -> PeerWork:
    """TRL's side of `row` from the plan miles-run runs (a miles_runner.plan.model.Plan)."""
    adapter, batch, opt, algo = plan.adapters[0], plan.batch, plan.optimizer, plan.algorithm
    if algo.advantage_estimator != "grpo" or batch.steps_per_rollout != 1:
        raise ValueError(
            f"the TRL side runs GRPO with one optimizer step per rollout; the plan has "
            f"{algo.advantage_estimator} with {batch.steps_per_rollout} (algorithm.advantage_estimator, "
            "algorithm.global_batch_size)"
        )
    return PeerWork(
        row=row.name,
        model_path=str(plan.model_path),
        task=adapter.task,
        reward=adapter.reward,
        max_turns=batch.max_turns,
        prompts=batch.rollout_batch_size,
        samples=batch.n_samples_per_prompt,
        max_new_tokens=batch.max_response_len,
        lora_rank=adapter.rank,
        lora_alpha=adapter.alpha,
        targets=list(adapter.target_modules),
        lr=opt.lr,
        adam_betas=(opt.adam_beta1, opt.adam_beta2),
        weight_decay=opt.weight_decay,
        clip_grad=opt.clip_grad,
        eps_clip=algo.eps_clip,
        eps_clip_high=algo.eps_clip_high,
        kl_coef=algo.kl_coef,
        steps=batch.num_steps,
        seed=plan.seed,
        temperature=plan.rollout.temperature,
        top_p=plan.rollout.top_p,
        std_normalized=algo.normalize_advantages_by_std,
        per_token_loss=plan.trainer.calculate_per_token_loss,
    )
