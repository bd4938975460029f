"""One parity case, run the same way by the single-process reference (in the test process) and by each rank of
the gloo workers: build the megatron model for a layout, load the tiny HF checkpoint, and return the checkpoint
tensors its gathered export does not reproduce bit for bit, the whole batch's logits, the parameter gradients in
HF names (full, gathered) and, for MoE, the logits and replay counts under a routing replay.

Data parallelism is real: the global batch's rows are split over the data-parallel ranks, and gradients are summed
over the data-parallel (expert: expert-data-parallel) group, so every layout computes the same whole-batch
quantities. Sequence-parallel norm and router gradients, and the qk-layernorm gradients under TP, are summed over
TP first: what megatron's finalize_model_grads does with the parameters tagged ``sequence_parallel``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from miles_runner.trainer.megatron import convert, parallel
from miles_runner.trainer.megatron.model import build_model, replay_routing, routing_layout
from miles_runner.trainer.routing_replay import NO_ROW, ReplayStats

WIDTH = 11  # odd: sequence parallelism pads it to a multiple of TP inside the forward
REAL = (WIDTH, 7)  # real tokens per row; row 1 is right-padded


def batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (len(REAL), WIDTH), generator=generator)
    mask = torch.zeros_like(ids)
    for row, real in enumerate(REAL):
        mask[row, :real] = 1
        ids[row, real:] = 0
    return ids, mask


def random_routes(ids: torch.Tensor, layers: int, top_k: int, experts: int) -> torch.Tensor:
    """Distinct random experts per token and layer; -1 where a sample has no row (its last token, padding) and on
    one real token, which then keeps the model's own routing."""
    generator = torch.Generator().manual_seed(1)
    scores = torch.rand(*ids.shape, layers, experts, generator=generator)
    routes = scores.argsort(dim=-1)[..., :top_k].to(torch.int32)
    for row, real in enumerate(REAL):
        routes[row, real - 1 :] = NO_ROW
    routes[0, 2] = NO_ROW
    return routes


def token_log_prob_sum(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    picked = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return (picked * (mask[:, 1:] * mask[:, :-1])).sum()


def _dp_rows(tensor: torch.Tensor) -> torch.Tensor:
    return tensor[parallel.data_parallel_rank() :: parallel.data_parallel_size()]


def _gather_rows(local: torch.Tensor) -> torch.Tensor:
    """Rows split round-robin over the DP ranks, back in batch order."""
    from megatron.core import parallel_state as ps

    size = parallel.data_parallel_size()
    if size == 1:
        return local
    shards = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(shards, local.contiguous(), group=ps.get_data_parallel_group())
    return torch.stack(shards, dim=1).reshape(-1, *local.shape[1:])


def _reduce_grads(model, layout: parallel.Layout) -> None:
    from megatron.core import parallel_state as ps

    for name, param in model.gpt.named_parameters():
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        qk_norm = "q_layernorm" in name or "k_layernorm" in name
        if layout.tp > 1 and ((layout.sp and getattr(param, "sequence_parallel", False)) or qk_norm):
            dist.all_reduce(param.grad, group=ps.get_tensor_model_parallel_group())
        expert = ".experts." in name
        group = ps.get_expert_data_parallel_group() if expert else ps.get_data_parallel_group()
        if dist.get_world_size(group) > 1:
            dist.all_reduce(param.grad, group=group)


def _grads_as_hf(model) -> dict[str, torch.Tensor]:
    """The gradients in HF names, full on every rank: the export of a model whose weights are its gradients."""
    saved = {name: param.data for name, param in model.gpt.named_parameters()}
    for param in model.gpt.parameters():
        param.data = param.grad
    try:
        return convert.export_hf_state(model)
    finally:
        for name, param in model.gpt.named_parameters():
            param.data = saved[name]


def run_case(model_path: str, layout: parallel.Layout) -> dict:
    parallel.initialize(layout)
    hf_config = json.loads((Path(model_path) / "config.json").read_text())
    moe = hf_config["model_type"] == "qwen3_moe"
    model = build_model(hf_config, layout, routing_replay=moe)
    convert.load_hf_checkpoint(model, model_path)
    exported, checkpoint = convert.export_hf_state(model), load_file(Path(model_path) / "model.safetensors")
    inexact = sorted(set(exported) ^ set(checkpoint)) + [
        k for k in checkpoint if not torch.equal(exported[k], checkpoint[k])
    ]
    ids, mask = batch(hf_config["vocab_size"])
    local_ids, local_mask = _dp_rows(ids), _dp_rows(mask)
    logits = model(input_ids=local_ids, attention_mask=local_mask).logits
    token_log_prob_sum(logits, local_ids, local_mask).backward()
    _reduce_grads(model, layout)
    result = {"inexact": inexact, "logits": _gather_rows(logits.detach()), "grads": _grads_as_hf(model)}
    if moe:
        result.update(_replayed(model, ids, mask))
    parallel.destroy()
    return result


def _replayed(model, ids: torch.Tensor, mask: torch.Tensor) -> dict:
    from megatron.core import parallel_state as ps

    layout = routing_layout(model)
    routes = random_routes(ids, layout.num_layers, layout.top_k, layout.num_experts)
    stats = ReplayStats()
    with torch.no_grad(), replay_routing(model, _dp_rows(routes), stats):
        logits = model(input_ids=_dp_rows(ids), attention_mask=_dp_rows(mask)).logits
    counts = torch.tensor([stats.tokens, stats.differing])
    if parallel.data_parallel_size() > 1:
        dist.all_reduce(counts, group=ps.get_data_parallel_group())
    return {"replay_logits": _gather_rows(logits), "replay_counts": counts.tolist()}
