"""Trainer/engine log-prob gap with routing replay (R3) and without, on the tiny MoE.

The runner's single-turn rollout samples PROMPTS x 8 answers from the embedded engine with
`return_routed_experts`; the `tiny_r3_session` plan's FSDP trainer then scores them twice, once replaying the
engine's routing and once routing on its own, and the mean / max |trainer - engine| log-prob over all response
tokens is reported: with the routers as at rollout, after Gaussian noise of growing std on every gate weight
(what an update between rollout and training does to routing), and after GRPO steps that move the attention
adapter (the same adapter in both trainers). "Differ" is the share of replayed tokens whose experts the trainer's
own routers would not have chosen (any layer): the metric `train/routing_replay_diff_frac`. Writes
bench/results/routing_replay_gap.json and its section of bench/REPORT.md.

    .venv/bin/python -m bench.routing_replay_gap
"""

from __future__ import annotations

import tempfile

from bench.report import write_result
from miles_testkit.routing_gap import engine_samples, measure, measure_gaps, r3_engine, r3_plan, trainers

PROMPTS = 16
ROUTER_NOISE = (0.0, 0.02, 0.05, 0.1, 0.2)  # std added to the gate weights (initialised with std 0.1)
TRAIN_STEPS = (1, 4)


def after_training(plan, samples, steps: tuple[int, ...]) -> dict[int, dict]:
    """Both trainers with the adapter the replaying one reached after `n` GRPO steps on the samples."""
    ours = trainers(plan)
    measured, done = {}, 0
    for n in steps:
        for _ in range(n - done):
            ours["replay"].train(samples)
        done = n
        ours["own routing"].load_state_dict(ours["replay"].state_dict())
        measured[n] = measure(ours, samples)
    return measured


def row(case: str, figures: dict) -> str:
    replay, own = figures["replay"], figures["own routing"]
    return (
        f"| {case} | {replay['diff_frac']:.3f} | {replay['mean']:.2e} / {replay['max']:.2e} "
        f"| {own['mean']:.2e} / {own['max']:.2e} | {own['mean'] / max(replay['mean'], 1e-12):.1f}x |"
    )


def main() -> None:
    plan = r3_plan()
    with r3_engine(plan, tempfile.mkdtemp(prefix="r3-gap-")) as url:
        samples = engine_samples(plan, url, PROMPTS)
    noise = measure_gaps(plan, samples, ROUTER_NOISE)
    trained = after_training(plan, samples, TRAIN_STEPS)
    tokens = sum(s.response_length for s in samples)
    lines = [
        f"`tiny_r3_session` plan: tiny-moe ({plan.model.num_layers} MoE layers, {plan.model.num_experts} experts, "
        f"top-{plan.model.moe_topk}), {len(samples)} samples from the embedded engine, {tokens} response tokens. "
        "Gap = |trainer - engine| log-prob per response token (mean / max); differ = share of replayed tokens "
        "the trainer's own routers would send elsewhere.",
        "",
        "| trainer vs rollout | differ | gap with replay | gap without | without / with |",
        "|---|---|---|---|---|",
        *(row("routers as at rollout" if s == 0 else f"gate weights + N(0, {s}^2)", noise[s]) for s in ROUTER_NOISE),
        *(row(f"after {n} GRPO step{'s' * (n > 1)} (lr {plan.adapters[0].lr})", trained[n]) for n in TRAIN_STEPS),
    ]
    results = {
        "samples": len(samples),
        "response_tokens": tokens,
        "router_noise": {str(s): noise[s] for s in ROUTER_NOISE},
        "grpo_steps": {str(n): trained[n] for n in TRAIN_STEPS},
    }
    print(write_result("routing_replay_gap", results, lines))


if __name__ == "__main__":
    main()
