"""The TRL side, run by the peers venv: GRPOTrainer + peft LoRA on the work miles-run's plan describes.

    .venv-peers/bin/python -m bench.peers.trl_side WORK.json OUT.json [THREADS]

The model folder is the one miles-run loads; the prompts are the task's, in miles-run's order (the data cursor
from 0, ``shuffle_dataset=False``); the reward is the project's registered reward function itself. Per-step wall
times come from a TrainerCallback (``on_step_end`` to ``on_step_end``), rewards from its ``on_log``, and the
rollout's share from the seconds spent in the trainer's ``_generate``.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

from bench.peers.records import SideRun, StepRecord, step_walls
from bench.peers.work import PeerWork
from miles_runner.plugins.rewards import REWARDS, RewardFn
from miles_runner.plugins.tasks import TASKS, Prompt, Task

PACKAGES = ("trl", "peft", "transformers", "torch", "accelerate", "datasets")


def task_prompts(task: Task, count: int) -> list[Prompt]:
    """The first `count` prompts, the ones miles-run's data cursor takes over the same steps."""
    return [task.prompt(i) for i in range(count)]


def reward_func(task: Task, name: str, reward: RewardFn):
    """TRL's reward signature around the project's reward: the dataset's `index` names the task prompt; a
    multi-turn rollout passes every reply (`replies`), a single-turn one just its completion."""

    def score(prompts, completions, index, replies=None, **_) -> list[float]:
        texts = replies if replies is not None else [[c[-1]["content"]] for c in completions]
        return [reward(task.prompt(i), r) for i, r in zip(index, texts, strict=True)]

    score.__name__ = name
    return score


def grpo_settings(work: PeerWork) -> dict[str, Any]:
    """GRPOConfig's arguments for the work (plain values: the report lists them, the main venv tests them)."""
    return dict(
        per_device_train_batch_size=work.prompts * work.samples,
        gradient_accumulation_steps=1,
        num_generations=work.samples,
        max_completion_length=work.max_new_tokens,
        temperature=work.temperature,
        top_p=work.top_p,
        top_k=0,
        learning_rate=work.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=work.adam_betas[0],
        adam_beta2=work.adam_betas[1],
        weight_decay=work.weight_decay,
        max_grad_norm=work.clip_grad,
        beta=work.kl_coef,
        epsilon=work.eps_clip,
        epsilon_high=work.eps_clip_high,
        router_aux_loss_coef=0.0,  # miles adds no MoE load-balancing loss
        loss_type="dapo" if work.per_token_loss else "grpo",
        scale_rewards="group" if work.std_normalized else "none",
        max_steps=work.steps,
        seed=work.seed,
        shuffle_dataset=False,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        disable_tqdm=True,
    )


def step_callback():
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        """Step ends, rewards, and per step the seconds in and out of generation (``timed_generation``)."""

        def __init__(self) -> None:
            self.begins: list[float] = []
            self.ends: list[float] = []
            self.generate_s: list[float] = []
            self.rewards: dict[int, float] = {}

        def on_step_begin(self, args, state, control, **kwargs):
            self.begins.append(time.perf_counter())
            self.generate_s.append(0.0)

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.rewards[state.global_step] = float(logs["reward"])

    return StepTimes()


def timed_generation(trainer, callback) -> None:
    """Count the seconds of the trainer's `_generate` (tokenize, generate, decode; the multi-turn loop) per step:
    TRL's rollout, beside miles' rollout/seconds."""
    generate = trainer._generate

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return generate(*args, **kwargs)
        finally:
            callback.generate_s[-1] += time.perf_counter() - started

    trainer._generate = timed


def build_trainer(work: PeerWork, output_dir: str, callback):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    task = TASKS.get(work.task)(seed=work.seed)
    prompts = task_prompts(task, work.steps * work.prompts)
    dataset = Dataset.from_list([{"prompt": p.messages, "index": p.index} for p in prompts])
    tokenizer = AutoTokenizer.from_pretrained(work.model_path, padding_side="left")
    lora = LoraConfig(
        r=work.lora_rank,
        lora_alpha=work.lora_alpha,
        lora_dropout=0.0,
        target_modules=work.targets,
        task_type="CAUSAL_LM",
    )
    rollout = None
    if work.max_turns > 1:
        from bench.peers.trl_rollout import feedback_rollout

        rollout = feedback_rollout(task, prompts, work.max_turns)
    args = GRPOConfig(output_dir=output_dir, **grpo_settings(work))
    return GRPOTrainer(
        model=work.model_path,
        reward_funcs=reward_func(task, work.reward, REWARDS.get(work.reward)),
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[callback],
        rollout_func=rollout,
    )


def run(work: PeerWork) -> SideRun:
    callback = step_callback()
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = build_trainer(work, output_dir, callback)
        timed_generation(trainer, callback)
        trainer.train()
    steps = []
    for i, wall in enumerate(step_walls(callback.ends)):
        rollout_s = callback.generate_s[i]
        # The rest of the step body: rewards, advantages, the policy's forward and backward, the optimizer step.
        # TRL trains the model it generates with: nothing to sync.
        train_s = callback.ends[i] - callback.begins[i] - rollout_s
        steps.append(StepRecord(i, wall, callback.rewards[i + 1], rollout_s, train_s, sync_s=0.0))
    return SideRun("trl", work.row, process_s=0.0, steps=steps)  # process_s: the caller times the process


def main() -> None:
    work_file, out_file, *threads = sys.argv[1:]
    if threads and int(threads[0]) > 0:  # 0: torch's default (one thread per core)
        import torch

        torch.set_num_threads(int(threads[0]))
    result = run(PeerWork.from_json(Path(work_file).read_text()))
    versions = {name: version(name) for name in PACKAGES}
    Path(out_file).write_text(json.dumps({"run": result.to_dict(), "versions": versions}))


if __name__ == "__main__":
    main()
