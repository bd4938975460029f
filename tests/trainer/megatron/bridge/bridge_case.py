"""One Megatron-Bridge LoRA case, run the same way in the test process (one rank) and by each rank of the gloo
workers: build the Bridge model with its LoRA for a layout, record the adapter (PEFT names), take two SGD steps on
the parity batch (rows split over the data-parallel ranks, the whole-batch gradient), record the adapter again
and the whole batch's logits (with the adapter, and disabled), and export the adapter with Bridge's
save_hf_adapter. ``replay``: every forward routes as parity_case.random_routes say (routing replay, R3)."""

from __future__ import annotations

from pathlib import Path

import torch

from miles_runner.core.adapters import AdapterSpec
from miles_runner.trainer.megatron import parallel

from ..parity_case import batch, random_routes, token_log_prob_sum

ATTENTION_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_TARGETS = [*ATTENTION_TARGETS, "gate_proj", "up_proj", "down_proj"]
LR = 0.5  # large enough that the steps move every adapter tensor well past float noise
STEPS = 2  # B starts at zero, so A's gradient is zero in the first step: the second moves A too


def adapter(targets: list[str] = ALL_TARGETS, rank: int = 4, alpha: float = 8.0) -> AdapterSpec:
    return AdapterSpec(
        name="bridge",
        lora_name="bridge",
        rank=rank,
        alpha=alpha,
        dropout=0.0,
        target_modules=list(targets),
        task="test",
        reward="test",
        lr=LR,
        rollout_batch_size=1,
        n_samples_per_prompt=1,
    )


def dp_rows(tensor: torch.Tensor) -> torch.Tensor:
    return tensor[parallel.data_parallel_rank() :: parallel.data_parallel_size()]


def logits_of(model, ids: torch.Tensor, mask: torch.Tensor, routes: torch.Tensor | None) -> torch.Tensor:
    from miles_runner.trainer.megatron.model import replay_routing

    with replay_routing(model, routes):
        return model(input_ids=ids, attention_mask=mask).logits


def sgd_step(model, ids: torch.Tensor, mask: torch.Tensor, routes: torch.Tensor | None = None) -> float:
    """One SGD step (a fresh optimizer: SGD keeps no state) on the mean negative log-likelihood of the whole batch
    (each DP rank its rows, routed as its rows of ``routes`` say); the loss."""
    tokens = float((mask[:, 1:] * mask[:, :-1]).sum())
    local_ids, local_mask = dp_rows(ids), dp_rows(mask)
    logits = logits_of(model, local_ids, local_mask, None if routes is None else dp_rows(routes))
    # reduce_grads takes the DP mean, so each rank's loss is its share of the whole-batch loss times the DP size
    loss = -token_log_prob_sum(logits, local_ids, local_mask) / tokens * parallel.data_parallel_size()
    loss.backward()
    model.reduce_grads()
    optimizer = torch.optim.SGD(model.lora_parameters(), lr=LR)
    optimizer.step()
    optimizer.zero_grad()
    return float(loss.detach())


def run_case(
    model_path: str,
    layout: parallel.Layout,
    export_dir: Path,
    targets: list[str] = ALL_TARGETS,
    allow_expert_ep: bool = False,
    replay: bool = False,
) -> dict:
    from miles_runner.trainer.megatron.bridge import build_bridge_lora_model
    from miles_runner.trainer.megatron.model import routing_layout

    parallel.initialize(layout)
    model = build_bridge_lora_model(
        model_path, adapter(targets), layout, seed=0, allow_expert_ep=allow_expert_ep, routing_replay=replay
    )
    ids, mask = batch(model.vocab_size)
    routes = None
    if replay:
        routing = routing_layout(model)
        routes = random_routes(ids, routing.num_layers, routing.top_k, routing.num_experts)
    with torch.no_grad():
        initial_logits = logits_of(model, ids, mask, routes)  # B is zero: the base model's
    start = model.adapter_state()
    losses = [sgd_step(model, ids, mask, routes) for _ in range(STEPS)]
    after = model.adapter_state()
    with torch.no_grad():
        logits = logits_of(model, ids, mask, routes)
        with model.disabled():
            disabled_logits = logits_of(model, ids, mask, routes)
    model.export_adapter(export_dir)
    parallel.destroy()
    return {
        "initial_logits": initial_logits,
        "start": start,
        "after": after,
        "losses": losses,
        "logits": logits,
        "disabled_logits": disabled_logits,
        "export_dir": str(export_dir),
    }
