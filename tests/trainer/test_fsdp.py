"""FSDPTrainer on one CPU process: only the adapter trains, the GRPO step moves it the right way, exports
load in peft, checkpoints restore exactly."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from miles_runner.config.schema import AlgorithmConfig, OptimizerConfig
from miles_runner.session.samples import Sample, SampleStatus
from miles_runner.trainer.fsdp import FSDPTrainer

from .settings import make_settings

PROMPT = [1, 60, 61, 62, 63, 4]


def group(responses: list[list[int]], rewards: list[float]) -> list[Sample]:
    return [
        Sample(PROMPT + r, len(r), [1] * len(r), [], None, SampleStatus.COMPLETED, reward=w)
        for r, w in zip(responses, rewards, strict=True)
    ]


GOOD, BAD = [70, 71, 2], [90, 91, 2]


@pytest.fixture(scope="module")
def trainer(tiny_model_path) -> FSDPTrainer:
    return FSDPTrainer(tiny_model_path, make_settings())


def test_only_lora_parameters_train(trainer):
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)


def test_a_step_raises_the_rewarded_response_and_lowers_the_other(tiny_model_path):
    trainer = FSDPTrainer(tiny_model_path, make_settings())
    samples = group([GOOD, BAD], [1.0, 0.0])
    before = [sum(lp) for lp in trainer.compute_log_probs(samples)]
    for _ in range(3):
        trainer.train(samples)
    after = [sum(lp) for lp in trainer.compute_log_probs(samples)]
    assert after[0] > before[0] and after[1] < before[1]


def test_base_weights_do_not_move(tiny_model_path):
    trainer = FSDPTrainer(tiny_model_path, make_settings())
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    trainer.train(group([GOOD, BAD], [1.0, 0.0]))
    assert all(torch.equal(p, frozen[n]) for n, p in trainer.model.named_parameters() if not p.requires_grad)


def test_equal_rewards_give_no_update(tiny_model_path):
    trainer = FSDPTrainer(tiny_model_path, make_settings())
    metrics = trainer.train(group([GOOD, BAD], [1.0, 1.0]))
    assert metrics["grad_norm"] == 0.0


def test_micro_batching_does_not_change_the_update(tiny_model_path):
    samples = group([GOOD, BAD, [70, 2], [91, 2]], [1.0, 0.0, 0.5, 0.0])
    sgd = replace(OptimizerConfig(), name="sgd")  # Adam's first step is sign(grad): blind to the scale
    whole = FSDPTrainer(tiny_model_path, make_settings(micro_batch_size=4, optimizer=sgd))
    split = FSDPTrainer(tiny_model_path, make_settings(micro_batch_size=1, optimizer=sgd))
    whole.train(samples)
    split.train(samples)
    for (name, a), b in zip(whole.adapter_state().items(), split.adapter_state().values(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), name


def test_kl_to_the_base_is_zero_before_the_adapter_moves_and_positive_after(tiny_model_path):
    settings = make_settings(algorithm=replace(AlgorithmConfig(), kl_coef=0.1))
    trainer = FSDPTrainer(tiny_model_path, settings)
    samples = group([GOOD, BAD], [1.0, 0.0])
    first = trainer.train(samples)
    second = trainer.train(samples)
    assert first["kl"] == pytest.approx(0.0, abs=1e-7)
    assert second["kl"] > 0.0


def test_global_batch_size_gives_one_optimizer_step_per_batch(tiny_model_path):
    trainer = FSDPTrainer(tiny_model_path, make_settings(global_batch_size=2))
    trainer.train(group([GOOD, BAD, [70, 2], [91, 2]], [1.0, 0.0, 0.5, 0.0]))
    assert trainer.step == 2


def test_rollout_log_probs_give_the_mismatch_figure(trainer):
    samples = group([GOOD, BAD], [1.0, 0.0])
    own = trainer.compute_log_probs(samples)
    for s, lp in zip(samples, own, strict=True):
        s.rollout_log_probs = [x + 0.1 for x in lp]
    metrics = trainer.train(samples)
    assert metrics["rollout_logprob_abs_diff"] == pytest.approx(0.1, abs=1e-4)


def test_adapter_state_uses_peft_names(trainer):
    names = list(trainer.adapter_state())
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in names
    assert all(".default." not in n for n in names)


def test_saved_adapter_loads_in_peft_with_the_same_outputs(trainer, tiny_model_path, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer.train(group([GOOD, BAD], [1.0, 0.0]))
    folder = trainer.save_adapter(tmp_path / "adapter")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in folder.iterdir()}
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    loaded = PeftModel.from_pretrained(base, folder).eval()
    ids = torch.tensor([PROMPT + GOOD])
    trainer.model.eval()
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, trainer.model(input_ids=ids).logits, atol=1e-5)


def test_a_trainer_starts_from_the_saved_adapter_of_adapters_path(tiny_model_path, tmp_path):
    trained = FSDPTrainer(tiny_model_path, make_settings())
    trained.train(group([GOOD, BAD], [1.0, 0.0]))
    folder = trained.save_adapter(tmp_path / "adapter")
    adapter = replace(make_settings().adapter, init_path=str(folder))
    resumed = FSDPTrainer(tiny_model_path, make_settings(adapter=adapter))
    fresh = FSDPTrainer(tiny_model_path, make_settings())
    for name, tensor in trained.adapter_state().items():
        assert torch.equal(resumed.adapter_state()[name], tensor), name
    ids = torch.tensor([PROMPT + GOOD])
    with torch.no_grad():
        assert not torch.allclose(resumed.model(input_ids=ids).logits, fresh.model(input_ids=ids).logits)


def test_a_starting_adapter_of_another_shape_is_refused(tiny_model_path, tmp_path):
    folder = FSDPTrainer(tiny_model_path, make_settings()).save_adapter(tmp_path / "adapter")
    wider = replace(make_settings().adapter, rank=8, init_path=str(folder))
    with pytest.raises(ValueError, match="does not fit the planned adapter"):
        FSDPTrainer(tiny_model_path, make_settings(adapter=wider))


def test_checkpoint_restores_adapter_optimizer_rng_and_step(tiny_model_path):
    samples = group([GOOD, BAD], [1.0, 0.0])
    original = FSDPTrainer(tiny_model_path, make_settings())
    original.train(samples)
    state = original.state_dict()
    original.train(samples)
    expected = original.adapter_state()
    restored = FSDPTrainer(tiny_model_path, make_settings(seed=99))
    restored.load_state_dict(state)
    assert restored.step == 1
    restored.train(samples)
    for name, tensor in restored.adapter_state().items():
        assert torch.allclose(tensor, expected[name], atol=1e-7), name


def test_adapter_config_matches_the_plan(trainer):
    config = trainer.adapter_config()
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["peft_type"] == "LORA"
    assert config["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]


def test_using_rollout_log_probs_requires_them(tiny_model_path):
    settings = make_settings(algorithm=replace(AlgorithmConfig(), use_rollout_logprobs=True))
    trainer = FSDPTrainer(tiny_model_path, settings)
    with pytest.raises(ValueError, match="rollout_log_probs"):
        trainer.train(group([GOOD, BAD], [1.0, 0.0]))


def test_an_adapter_moved_into_shared_memory_trains_there_as_it_would_have_in_place(tiny_model_path):
    from miles_runner.sglang_client.tensor_shm import SharedTensors, handle_segment_name, read_segment

    samples = group([GOOD, BAD], [1.0, 0.0])
    kept, moved = FSDPTrainer(tiny_model_path, make_settings()), FSDPTrainer(tiny_model_path, make_settings())
    shared = SharedTensors(moved.adapter_views())
    try:
        moved.move_adapter(shared.tensors)
        assert shared.handle_for(moved.adapter_views()) == shared.handle  # the parameters are the shared tensors
        for _ in range(2):
            kept.train(samples)
            moved.train(samples)
        engine_view = read_segment(handle_segment_name(shared.handle))  # what an engine loads: the trained values
        for name, tensor in kept.adapter_state().items():
            assert torch.equal(engine_view[name], tensor), name
            assert torch.equal(moved.adapter_state()[name], tensor), name
    finally:
        shared.close()


def test_an_adapter_moves_only_into_homes_that_hold_its_values(trainer):
    views = trainer.adapter_views()
    before = {name: view.data_ptr() for name, view in views.items()}
    wrong = {name: torch.zeros_like(view) for name, view in views.items()}
    with pytest.raises(ValueError, match="does not hold its values"):
        trainer.move_adapter(wrong)
    with pytest.raises(ValueError, match="cannot move"):
        trainer.move_adapter({name: view.clone() for name, view in list(views.items())[1:]})
    assert {name: view.data_ptr() for name, view in trainer.adapter_views().items()} == before  # nothing moved
