"""What the trainer, the optimizer, the rollout switches and the metrics file can honour here: each setting below
either runs as printed or is refused with the reason and the setting that would honour it.

The `*-not-built` refusals (NOT_BUILT) are miles features docs/system.md describes that this release has not built;
compile_design leaves them out (see backends.py).
"""

from __future__ import annotations

from collections.abc import Iterator

from miles_runner.config.schema import AlgorithmConfig, MilesConfig, TrainerConfig
from miles_runner.plan.derive import Derived
from miles_runner.plan.rules.base import BACKEND, Finding, rule

ESTIMATOR = "algorithm.advantage_estimator"
NOT_BUILT = (
    "ppo-needs-critic",
    "keep-old-actor-not-built",
    "group-rm-not-built",
    "partial-rollout-not-built",
    "prefill-logprob-recompute-not-built",
)


@rule("ppo-needs-critic")
def ppo_needs_critic(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.algorithm.advantage_estimator == "ppo":
        yield Finding(
            (ESTIMATOR,),
            "PPO's advantages come from a critic (a value model trained beside the actor, GAE over its values); "
            "the trainers here train LoRA adapters and build no critic. GRPO, GSPO and REINFORCE++ need none.",
            f"{ESTIMATOR}=grpo",
        )


@rule("gamma-needs-reinforce")
def gamma_needs_reinforce(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    a = cfg.algorithm
    if a.gamma != AlgorithmConfig.gamma and a.advantage_estimator != "reinforce_plus_plus":
        yield Finding(
            ("algorithm.gamma", ESTIMATOR),
            f"algorithm.gamma discounts REINFORCE++'s per-token returns; {a.advantage_estimator} has none to discount.",
            f"{ESTIMATOR}=reinforce_plus_plus",
        )


@rule("muon-needs-whole-matrices")
def muon_needs_whole_matrices(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.optimizer.name == "muon" and not d.multi_lora and d.trainer_world_size > 1:
        yield Finding(
            ("optimizer.name", "topology.actor_num_gpus_per_node"),
            f"Muon orthogonalises each whole LoRA matrix; the FSDP trainer shards every matrix over its "
            f"{d.trainer_world_size} ranks.",
            "topology.actor_num_gpus_per_node=1",
        )


@rule("fsdp-optimizer-is-distributed")
def fsdp_optimizer_is_distributed(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    single = not d.multi_lora and cfg.trainer.backend == "fsdp"
    if single and not cfg.optimizer.use_distributed_optimizer and d.trainer_world_size > 1:
        yield Finding(
            ("optimizer.use_distributed_optimizer", BACKEND),
            f"The FSDP trainer shards the adapter's parameters, gradients and optimizer state over its "
            f"{d.trainer_world_size} ranks (fully_shard): that is the distributed optimizer; one replicated on "
            "every rank is not built.",
            "optimizer.use_distributed_optimizer=true",
        )


@rule("dynamic-batch-token-budget")
def dynamic_batch_token_budget(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    t = cfg.trainer
    if t.use_dynamic_batch_size and t.max_tokens_per_gpu < 1:
        yield Finding(
            ("trainer.use_dynamic_batch_size", "trainer.max_tokens_per_gpu"),
            "Dynamic micro-batches are filled up to max_tokens_per_gpu tokens; the budget must be positive.",
            f"trainer.max_tokens_per_gpu={TrainerConfig.max_tokens_per_gpu}",
        )
    elif not t.use_dynamic_batch_size and t.max_tokens_per_gpu != TrainerConfig.max_tokens_per_gpu:
        yield Finding(
            ("trainer.max_tokens_per_gpu", "trainer.use_dynamic_batch_size"),
            "max_tokens_per_gpu sizes dynamic micro-batches only; fixed micro-batches hold micro_batch_size samples.",
            "trainer.use_dynamic_batch_size=true",
        )


@rule("keep-old-actor-not-built")
def keep_old_actor_not_built(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.trainer.keep_old_actor:
        yield Finding(
            ("trainer.keep_old_actor",),
            "Keeping the adapter that generated each batch to score its old log-probs (miles' old_actor queue) "
            "is not built: the trainer holds one adapter. The rollout's own log-probs (use_rollout_logprobs) or "
            "TIS (use_tis) correct async samples instead.",
            "trainer.keep_old_actor=false algorithm.use_tis=true",
        )


@rule("group-rm-not-built")
def group_rm_not_built(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.rollout.group_rm:
        yield Finding(
            ("rollout.group_rm", "rollout.reward"),
            "group_rm scores a whole group of samples in one reward-model call; every registered reward scores "
            "one sample (reward(prompt, replies)) and no group reward model is built.",
            "rollout.group_rm=false",
        )


@rule("partial-rollout-not-built")
def partial_rollout_not_built(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.rollout.partial_rollout:
        yield Finding(
            ("rollout.partial_rollout",),
            "partial_rollout returns the unfinished samples of an over-sampled, aborted rollout to the buffer; "
            "these rollouts generate exactly their batch and abort nothing (no dynamic sampling is built).",
            "rollout.partial_rollout=false",
        )


@rule("prefill-logprob-recompute-not-built")
def prefill_logprob_recompute_not_built(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.rollout.recompute_logprobs_via_prefill:
        yield Finding(
            ("rollout.recompute_logprobs_via_prefill",),
            "Rescoring rollout log-probs with a deterministic SGLang prefill needs miles' true-on-policy mode "
            "(deterministic inference on the engines), which is not built; the rollout keeps its decode "
            "log-probs.",
            "rollout.recompute_logprobs_via_prefill=false",
        )


@rule("metrics-jsonl-needed-to-resume")
def metrics_jsonl_needed_to_resume(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if not cfg.logger.metrics_jsonl and (cfg.run.resume or cfg.run.dir):
        yield Finding(
            ("logger.metrics_jsonl", "run.dir" if cfg.run.dir else "run.resume"),
            "A resumed run reads its earlier steps back from metrics.jsonl: the multi-LoRA loop finds the "
            "iteration to go on from there, and the end-of-run plot and summary cover the earlier steps from it.",
            "logger.metrics_jsonl=true",
        )
