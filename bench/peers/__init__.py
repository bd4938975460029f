"""`make bench-peers`: miles-run against TRL's GRPOTrainer + peft on the same work, side by side.

- ``work``: the one definition of the work (model, task, reward, batch, LoRA, optimizer, steps, seeds) and how it
  becomes miles-run's overrides and TRL's GRPOConfig.
- ``records``: what one side's run measured (per-step wall time, breakdown, reward), shared by both venvs.
- ``miles_side``: miles-run (the CLI, a subprocess of the main venv), timed from its step lines and metrics.jsonl.
- ``trl_side`` / ``trl_rollout``: run by the peers venv (.venv-peers): GRPOTrainer, and its multi-turn rollout.
- ``run``: the command: N runs of every side and row, then ``report`` writes BENCHMARKS.md and the reward plot.

TRL is never a dependency of the project: only the peers venv has it, and only ``trl_side``/``trl_rollout`` import it.
"""
