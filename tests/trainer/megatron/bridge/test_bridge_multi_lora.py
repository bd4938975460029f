"""Megatron multi-LoRA with lora_mode=bridge: the slots on Bridge's model take the same steps as on the raw
megatron model (whose slots take the one-adapter trainer's steps: ../test_multi_lora.py), with R3 replayed."""

from __future__ import annotations

import pytest
import torch

from miles_runner.trainer.megatron import parallel

from ..multi_lora_case import ADAPTERS, multi_case, start_state

pytestmark = pytest.mark.integration


def test_bridge_slots_train_as_the_raw_slots(tiny_moe_path):
    from miles_runner.trainer.megatron.bridge import BridgeMultiLoRATrainer

    starts = {slot: start_state(tiny_moe_path, slot) for slot in ADAPTERS}
    raw = multi_case(tiny_moe_path, parallel.Layout(), starts)
    bridge = multi_case(tiny_moe_path, parallel.Layout(), starts, trainer_class=BridgeMultiLoRATrainer)
    for slot in ADAPTERS:
        assert set(bridge["after"][slot]) == set(raw["after"][slot])
        for name, tensor in raw["after"][slot].items():
            assert torch.allclose(bridge["after"][slot][name], tensor, atol=1e-5), (slot, name)
        assert bridge["metrics"][1][slot]["grad_norm"] == pytest.approx(raw["metrics"][1][slot]["grad_norm"], rel=1e-4)
    assert bridge["configs"] == raw["configs"]
