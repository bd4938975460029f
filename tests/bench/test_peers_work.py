"""bench-peers' work definition: the overrides miles-run gets compile to a plan of exactly that work, and TRL's
side (PeerWork) is read off that plan. Main venv only: no TRL here."""

import dataclasses
import io
from pathlib import Path

import pytest

from bench.peers.miles_side import STEP_LINE, miles_command, step_record
from bench.peers.trl_side import grpo_settings, reward_func
from bench.peers.work import AGENTIC, ROWS, SINGLE_TURN, PeerWork, Work, miles_overrides, peer_work
from miles_runner.config.compose import compose
from miles_runner.plan.compile import compile_plan
from miles_runner.plugins.rewards import REWARDS
from miles_runner.plugins.tasks import TASKS
from miles_runner.tracking.progress import Progress

WORK = Work(steps=4, seed=3, lr=0.004)


@pytest.mark.parametrize("row", list(ROWS.values()), ids=list(ROWS))
def test_the_overrides_compile_to_the_work(row):
    plan = compile_plan(compose(miles_overrides(WORK, row)))
    batch, adapter = plan.batch, plan.adapters[0]
    assert (batch.rollout_batch_size, batch.n_samples_per_prompt, batch.max_response_len) == (8, 8, 8)
    assert (batch.num_steps, batch.steps_per_rollout, batch.samples_per_rollout) == (4, 1, 64)
    assert (adapter.rank, adapter.alpha, adapter.target_modules) == (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"])
    assert (plan.optimizer.lr, plan.seed, plan.rollout.temperature) == (0.004, 3, 1.0)
    assert plan.model_path.endswith("tiny-moe-seed0-format")  # the recipe's model, format-pretrained


def test_the_rows_differ_in_turns_and_session_only():
    single = compile_plan(compose(miles_overrides(WORK, SINGLE_TURN)))
    agentic = compile_plan(compose(miles_overrides(WORK, AGENTIC)))
    assert single.session is None and (single.adapters[0].task, single.batch.max_turns) == ("count", 1)
    assert agentic.session is not None and (agentic.adapters[0].task, agentic.batch.max_turns) == ("count_retry", 2)
    assert single.model_path == agentic.model_path


def test_peer_work_is_the_plans_work_and_survives_json():
    plan = compile_plan(compose(miles_overrides(WORK, AGENTIC)))
    peer = peer_work(plan, AGENTIC)
    assert PeerWork.from_json(peer.to_json()) == peer
    assert (peer.model_path, peer.task, peer.reward, peer.max_turns) == (
        plan.model_path,
        "count_retry",
        "hit_within_turns",
        2,
    )
    assert (peer.prompts, peer.samples, peer.max_new_tokens, peer.steps, peer.seed, peer.lr) == (8, 8, 8, 4, 3, 0.004)
    assert peer.adam_betas == (plan.optimizer.adam_beta1, plan.optimizer.adam_beta2)
    assert (peer.std_normalized, peer.per_token_loss, peer.kl_coef) == (True, False, 0.0)


def test_peer_work_refuses_what_grpo_trainer_cannot_run():
    row = dataclasses.replace(
        SINGLE_TURN, overrides=(*SINGLE_TURN.overrides, "algorithm.advantage_estimator=reinforce_plus_plus")
    )
    plan = compile_plan(compose(miles_overrides(WORK, row)))
    with pytest.raises(ValueError, match=r"algorithm\.advantage_estimator"):
        peer_work(plan, row)


def test_the_miles_command_is_the_cli_and_its_plan_is_the_same_work(tmp_path):
    command = miles_command(WORK, SINGLE_TURN, tmp_path / "run")
    assert Path(command[0]).name == "miles-run" and Path(command[0]).exists()
    assert f"hydra.run.dir={tmp_path / 'run'}" in command
    overrides = [arg for arg in command[1:] if not arg.startswith("hydra.")]
    plan = compile_plan(compose(overrides))  # ports, logging and checkpoints on top: still accepted, same work
    assert peer_work(plan, SINGLE_TURN) == peer_work(
        compile_plan(compose(miles_overrides(WORK, SINGLE_TURN))), SINGLE_TURN
    )
    assert (plan.logger.progress, plan.logger.wandb_mode, plan.checkpoint.interval) == ("plain", "disabled", 0)


def test_a_metrics_record_becomes_a_step_with_its_breakdown():
    record = {
        "step": 2,
        "reward/mean": 0.25,
        "rollout/seconds": 0.5,
        "train/seconds": 0.2,
        "sync/seconds": 0.05,
        "verify/seconds": 0.03,
    }
    step = step_record(record, 1.0)
    assert (step.reward, step.rollout_s, step.train_s, step.sync_s) == (0.25, 0.5, 0.2, pytest.approx(0.08))
    assert step.other_s == pytest.approx(0.22)


def test_trls_config_is_the_same_work():
    peer = peer_work(compile_plan(compose(miles_overrides(WORK, SINGLE_TURN))), SINGLE_TURN)
    settings = grpo_settings(peer)
    assert (
        settings["per_device_train_batch_size"],
        settings["num_generations"],
        settings["max_completion_length"],
        settings["max_steps"],
        settings["seed"],
    ) == (64, 8, 8, 4, 3)
    assert (settings["learning_rate"], settings["lr_scheduler_type"], settings["adam_beta2"]) == (
        0.004,
        "constant",
        0.98,
    )
    assert (settings["loss_type"], settings["scale_rewards"], settings["beta"]) == ("grpo", "group", 0.0)
    assert (settings["epsilon"], settings["epsilon_high"], settings["shuffle_dataset"]) == (0.2, 0.28, False)


def test_trls_reward_is_the_projects_reward_on_each_reply():
    task = TASKS.get("count_retry")(seed=0)
    prompt = task.prompt(0)
    score = reward_func(task, "hit_within_turns", REWARDS.get("hit_within_turns"))
    right, wrong = prompt.label, str(int(prompt.label) % 6 + 1)
    completions = [[{"role": "assistant", "content": right}], [{"role": "assistant", "content": wrong}]]
    assert score(None, completions, index=[0, 0]) == [1.0, 0.0]  # single turn: the completion is the reply
    assert score(None, completions, index=[0, 0], replies=[[wrong, right], [wrong, wrong]]) == [0.8, 0.0]


def test_the_step_lines_the_bench_times_are_the_ones_a_plain_run_prints():
    out = io.StringIO()
    progress = Progress(3, mode="plain", stream=out)
    for step in range(3):
        progress.phase_started(step, "rollout")
        progress.step_done(step, {"reward/mean": 0.5})
    progress.close()
    lines = out.getvalue().splitlines()
    assert [int(STEP_LINE.match(line).group(1)) for line in lines] == [1, 2, 3]
