"""One rank of the raw-LoRA layout-parity check: per case, build the megatron model from the tiny HF folder, attach
raw LoRA from a fixed seed, give B a non-zero start, take one SGD step (lr 1) on this rank's data-parallel share of
a fixed batch, and save the PEFT export before and after the step.

argv: out_dir, JSON list of cases ``{"name", "model": tiny-moe|tiny-dense, "layout": {tp, ep, sp}}``.
"""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from miles_runner.core.adapters import AdapterSpec
from miles_runner.models.tiny_model import ensure_tiny_model
from miles_runner.trainer.megatron import lora_export, parallel, raw_lora
from miles_runner.trainer.megatron.convert import load_hf_checkpoint
from miles_runner.trainer.megatron.model import build_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ROWS, WIDTH, VOCAB = 4, 12, 400


def adapter_spec(rank: int = 4, alpha: float = 8.0, targets: list[str] | None = None) -> AdapterSpec:
    return AdapterSpec(
        name="policy",
        lora_name="policy",
        rank=rank,
        alpha=alpha,
        dropout=0.0,
        target_modules=list(targets or TARGETS),
        task="t",
        reward="r",
        lr=1.0,
        rollout_batch_size=1,
        n_samples_per_prompt=1,
    )


def nonzero_start(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The exported state with every lora_B replaced by small values drawn from its name (the same anywhere)."""
    out = dict(state)
    for name, tensor in state.items():
        if ".lora_B." in name:
            generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            out[name] = torch.randn(tensor.shape, generator=generator) * 0.05
    return out


def batch() -> torch.Tensor:
    return torch.randint(3, VOCAB, (ROWS, WIDTH), generator=torch.Generator().manual_seed(11))


def run_case(model_name: str, layout: parallel.Layout) -> dict:
    folder = ensure_tiny_model(model_name)
    parallel.initialize(layout)
    model = build_model(json.loads((folder / "config.json").read_text()), layout)
    load_hf_checkpoint(model, str(folder))
    raw_lora.attach_lora(model, adapter_spec(), seed=5)
    lora_export.load_peft_state(model, nonzero_start(lora_export.export_peft_state(model)))
    start = lora_export.export_peft_state(model)
    ids = batch()[parallel.data_parallel_rank() :: parallel.data_parallel_size()]
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    raw_lora.reduce_lora_grads(model)
    norm = raw_lora.grad_norm(model)
    with torch.no_grad():
        for param in raw_lora.lora_parameters(model):
            param -= param.grad
    result = {"start": start, "after": lora_export.export_peft_state(model), "grad_norm": norm}
    parallel.destroy()
    return result


def main() -> None:
    out_dir, cases = Path(sys.argv[1]), json.loads(sys.argv[2])
    dist.init_process_group("gloo")  # the torchrun environment ranks_helper.run_ranks sets
    results = {case["name"]: run_case(case["model"], parallel.Layout(**case["layout"])) for case in cases}
    torch.save(results, out_dir / f"rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
