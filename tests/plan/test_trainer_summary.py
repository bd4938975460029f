"""The plan summary's trainer row names what will run: for trainer=megatron, its LoRA path (raw LoRA on
megatron-core's linears, or Megatron-Bridge's PEFT LoRA), how a micro-batch lays its samples out (thd packs them,
bshd pads rows) and sequence parallelism, which the trainer turns on whenever TP > 1."""

import pytest

from miles_runner.plan.summary import trainer_line

MEGATRON_CPU = ("trainer=megatron", "lora_mode=raw")  # the default CPU shape: tiny MoE, 2 slots


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            MEGATRON_CPU,
            "megatron, 2 ranks, TP 1, EP 1, PP 1, CP 1, DP 2, megatron-core, raw LoRA on megatron "
            "linears, thd packs samples, LoRA r8 a16 via raw on [q_proj, k_proj, v_proj, o_proj]",
        ),
        (
            (*MEGATRON_CPU, "trainer.parallel.tp=2", "trainer.parallel.qkv_format=bshd"),
            "megatron, 2 ranks, TP 2, EP 1, PP 1, CP 1, DP 1, megatron-core, raw LoRA on megatron linears, "
            "bshd pads rows, SP, LoRA r8",
        ),
        (
            ("+recipe=qwen25_05b_lora",),
            "megatron, 1 rank, TP 1, EP 1, PP 1, CP 1, DP 1, megatron-core + "
            "Megatron-Bridge PEFT LoRA, thd packs samples, LoRA r32 a32 via bridge",
        ),
    ],
    ids=["raw-thd", "raw-tp2-bshd", "bridge"],
)
def test_the_megatron_trainer_row_names_its_lora_path_layout_and_sequence_parallelism(overrides, expected, plan):
    assert trainer_line(plan(overrides)).startswith(expected)


def test_sequence_parallelism_is_named_only_under_tensor_parallelism(plan):
    assert ", SP" not in trainer_line(plan([*MEGATRON_CPU, "trainer.parallel.ep=2"]))
    assert ", SP" in trainer_line(plan(("+recipe=glm52_lora_agentic",)))  # TP 8


def test_the_fsdp_trainer_row_names_no_megatron_parts(plan):
    line = trainer_line(plan(("+recipe=tiny_lora_agentic",)))
    assert line.startswith("fsdp, ") and "megatron" not in line and "SP" not in line and "pads rows" not in line
