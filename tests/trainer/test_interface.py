"""Every trainer implements its Protocol (trainer/interface.py) member for member, with the Protocol's signature, so
that a drift fails here and not in a run: the one-adapter trainers and rank 0's proxy of them are `Trainer`s, the
multi-LoRA trainer and its proxy are `MultiLoRATrainer`s. Checked on the classes: no model is built."""

from __future__ import annotations

import inspect

import pytest

from miles_runner.trainer.fsdp import FSDPTrainer
from miles_runner.trainer.host import HostedMultiLoRATrainer, HostedTrainer
from miles_runner.trainer.interface import MultiLoRATrainer, Trainer
from miles_runner.trainer.megatron.bridge import BridgeMultiLoRATrainer, BridgeTrainer
from miles_runner.trainer.megatron.multi_lora import MegatronMultiLoRATrainer
from miles_runner.trainer.megatron.trainer import MegatronTrainer
from miles_runner.trainer.multi_lora import PeftMultiLoRATrainer
from miles_runner.trainer.ranks import RankedMultiLoRATrainer, RankedTrainer

IMPLEMENTATIONS = [
    (FSDPTrainer, Trainer),
    (MegatronTrainer, Trainer),
    (BridgeTrainer, Trainer),
    (RankedTrainer, Trainer),
    (HostedTrainer, Trainer),
    (PeftMultiLoRATrainer, MultiLoRATrainer),
    (MegatronMultiLoRATrainer, MultiLoRATrainer),
    (BridgeMultiLoRATrainer, MultiLoRATrainer),
    (RankedMultiLoRATrainer, MultiLoRATrainer),
    (HostedMultiLoRATrainer, MultiLoRATrainer),
]


def members(protocol: type) -> list[str]:
    """The methods a Protocol declares."""
    return sorted(name for name, value in vars(protocol).items() if inspect.isfunction(value) and name[0] != "_")


def test_each_protocol_declares_what_the_loops_call():
    assert "train" in members(Trainer) and "save_adapter" in members(Trainer)
    assert "load_adapter" in members(MultiLoRATrainer) and "adapter_step" in members(MultiLoRATrainer)


@pytest.mark.parametrize(("implementation", "protocol"), IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_each_trainer_has_every_member_of_its_protocol_with_its_signature(implementation, protocol):
    for name in members(protocol):
        method = getattr(implementation, name, None)
        assert callable(method), f"{implementation.__name__} lacks {protocol.__name__}.{name}"
        mine, declared = inspect.signature(method), inspect.signature(getattr(protocol, name))
        assert mine == declared, f"{implementation.__name__}.{name}{mine} is not {protocol.__name__}.{name}{declared}"


@pytest.mark.parametrize("implementation", [c for c, _ in IMPLEMENTATIONS], ids=lambda c: c.__name__)
def test_no_trainer_leaves_a_member_abstract(implementation):
    assert not getattr(implementation, "__abstractmethods__", None)
