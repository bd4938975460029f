"""Two trainer ranks (this test process is rank 0, a follower process rank 1) give the same update as one
process: the multi-LoRA trainer sums each slot's gradients over the ranks' shares before its step, and the
FSDP trainer shards with FSDP2; every call the driver makes is replayed on the follower."""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from miles_runner.config.compose import compose
from miles_runner.core.adapters import AdapterSpec, slot_lora_name
from miles_runner.models.format_pretrain import ensure_format_pretrained
from miles_runner.plan.compile import compile_plan
from miles_runner.plan.model import Plan
from miles_runner.plan.record import write_run_record
from miles_runner.procs.ports import free_port
from miles_runner.session.samples import Sample, SampleStatus
from miles_runner.trainer.ranks import RankedMultiLoRATrainer, build_multi_lora_trainer, make_multi_lora_trainer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TWO_RANKS = ("cluster.cpu_devices_per_node=3", "topology.actor_num_gpus_per_node=2")


def recorded_plan(tmp_path: Path, *overrides: str) -> tuple[Plan, Path]:
    ensure_format_pretrained("tiny-moe")
    args = [*overrides, f"engine.base_port={free_port()}", f"adapters.api_port={free_port()}"]
    composed = compose(args)
    plan = compile_plan(composed)
    run_dir = tmp_path / "run"
    write_run_record(run_dir, composed, plan, args)
    return plan, run_dir


def samples(slot: int, groups: int, n: int, seed: int) -> list[Sample]:
    """`groups` prompts' samples for `slot`, each group with one rewarded answer (an odd count per rank)."""
    return [
        Sample(
            tokens=[3, 4, 5, 6, 10 + seed + g, 20 + k],
            response_length=2,
            loss_mask=[1, 1],
            rollout_log_probs=[-1.0, -1.5],
            rollout_routed_experts=None,
            status=SampleStatus.COMPLETED,
            reward=float(k == g % n),
            metadata={"slot": slot},
        )
        for g in range(groups)
        for k in range(n)
    ]


def in_slot(adapter: AdapterSpec, slot: int) -> AdapterSpec:
    return dataclasses.replace(adapter, lora_name=slot_lora_name(slot))


def multi_lora_steps(trainer, plan: Plan) -> dict[str, torch.Tensor]:
    """Two slots; slot 0 steps after two train calls (gradients kept across them), slot 1 after one."""
    for slot, adapter in enumerate(plan.adapters[:2]):
        trainer.load_adapter(slot, in_slot(adapter, slot))
    trainer.train([*samples(0, 3, 8, 0), *samples(1, 5, 8, 1)], step_slots=[1])
    trainer.train(samples(0, 5, 8, 2), step_slots=[0])
    return {f"{slot}:{k}": v for slot in (0, 1) for k, v in trainer.adapter_state(slot).items()}


def test_the_multi_lora_trainer_on_two_ranks_matches_one_process(tmp_path):
    plan, run_dir = recorded_plan(tmp_path, "+recipe=tiny_multi_lora", *TWO_RANKS)
    assert plan.trainer.parallel.world_size == 2
    ranked = make_multi_lora_trainer(plan, run_dir)
    assert isinstance(ranked, RankedMultiLoRATrainer)
    try:
        two = multi_lora_steps(ranked, plan)
    finally:
        ranked.close()
    one = multi_lora_steps(build_multi_lora_trainer(plan), plan)
    assert two.keys() == one.keys()
    for name, tensor in one.items():
        assert torch.allclose(two[name], tensor, atol=1e-5), name
    assert (run_dir / "logs" / "trainer1.log").exists()


def test_a_follower_that_died_is_reported_before_the_next_call(tmp_path):
    plan, run_dir = recorded_plan(tmp_path, "+recipe=tiny_multi_lora", *TWO_RANKS)
    ranked = make_multi_lora_trainer(plan, run_dir)
    try:
        follower = ranked._followers[0]
        follower.stop()  # injected fault: rank 1 is gone
        with pytest.raises(RuntimeError, match=r"trainer ranks exited: trainer1 \(exit code"):
            ranked.load_adapter(0, in_slot(plan.adapters[0], 0))
    finally:
        ranked.close()


@pytest.mark.timeout(120, method="thread")  # a regression waits inside gloo, where the signal method cannot end it
def test_close_lets_a_call_in_flight_finish_before_the_followers_exit(tmp_path):
    """Ctrl-C cancels the run's loop while its train step goes on in a worker thread, and the loop's cleanup closes
    the trainer: the exit command must come after that step's collectives. Sent in the middle of them, rank 0's
    broadcast and rank 1's all-reduce waited on each other for the group's 10-minute timeout."""
    plan, run_dir = recorded_plan(tmp_path, "+recipe=tiny_multi_lora", *TWO_RANKS)
    ranked = make_multi_lora_trainer(plan, run_dir)
    follower, entered = ranked._followers[0], threading.Event()
    own_train = ranked._local.train

    def train_after_close_began(*args, **kwargs):  # injected delay: close() is called while the step is in flight
        entered.set()
        time.sleep(1.0)
        return own_train(*args, **kwargs)

    try:
        ranked.load_adapter(0, in_slot(plan.adapters[0], 0))
        ranked._local.train = train_after_close_began
        with ThreadPoolExecutor(1) as pool:
            step = pool.submit(ranked.train, samples(0, 3, 8, 0), step_slots=[0])
            assert entered.wait(60)
            ranked.close()
            assert 0 in step.result(timeout=60)  # the step ended, with slot 0's metrics
    finally:
        ranked.close()
    assert follower.returncode == 0, (run_dir / "logs" / "trainer1.log").read_text()[-3000:]
