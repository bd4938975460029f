"""The MoE routers of an HF model, and recording the experts they choose (what an engine returns as R3).

A router is found by its class and its decoder layer by its module path (``...layers.<i>.mlp.gate``), so the
same lookup works on a bare HF model, under peft and under FSDP2. Routing is laid out as SGLang returns it:
``(tokens, num_layers, top_k)`` over *all* decoder layers; a dense layer's entries are 0 and never read.

Only routers whose forward we know are listed: replaying a router means rewriting its forward
(trainer/routing_replay.py), so an unknown router is refused rather than guessed at.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

# HF Qwen3-MoE: logits = hidden @ W.T; softmax over all experts; top-k; renormalised when norm_topk_prob.
SUPPORTED_ROUTERS = ("Qwen3MoeTopKRouter",)
_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


@dataclass(frozen=True)
class RoutingLayout:
    """The shape of a model's routing rows: ``(tokens, num_layers, top_k)``, experts in ``[0, num_experts)``."""

    num_layers: int
    top_k: int
    num_experts: int
    moe_layers: tuple[int, ...]  # the decoder layers with a router; the other layers' entries are ignored


def moe_routers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """Every supported router with its decoder-layer index, in layer order."""
    found = []
    for name, module in model.named_modules():
        if type(module).__name__ not in SUPPORTED_ROUTERS:
            continue
        match = _LAYER_INDEX.search(f".{name}.")
        if match is None:
            raise ValueError(f"router {name!r} is not under a decoder layer (.layers.<i>.): cannot index its rows")
        found.append((int(match.group(1)), module))
    return sorted(found, key=lambda pair: pair[0])


def routing_layout(model: torch.nn.Module) -> RoutingLayout:
    """The model's routing layout; ValueError naming the model type when it has no supported router."""
    config = model.config
    text_config = getattr(config, "text_config", None) or config
    routers = moe_routers(model)
    if not routers:
        raise ValueError(
            f"routing replay needs a MoE model with one of the routers {list(SUPPORTED_ROUTERS)}; "
            f"model_type {getattr(config, 'model_type', '?')!r} has none"
        )
    top_ks = {int(router.top_k) for _, router in routers}
    num_experts = {int(router.num_experts) for _, router in routers}
    if len(top_ks) != 1 or len(num_experts) != 1:
        raise ValueError(f"routers disagree on top_k {sorted(top_ks)} or num_experts {sorted(num_experts)}")
    return RoutingLayout(
        num_layers=int(text_config.num_hidden_layers),
        top_k=top_ks.pop(),
        num_experts=num_experts.pop(),
        moe_layers=tuple(index for index, _ in routers),
    )


@contextmanager
def recording(model: torch.nn.Module) -> Iterator[dict[int, list[torch.Tensor]]]:
    """Within the block, every forward of every router appends its chosen experts ``[tokens, top_k]`` (tokens in
    the flattened ``batch x width`` order of that forward) to the list of its layer."""
    captured: dict[int, list[torch.Tensor]] = {}
    handles = []
    for layer, router in moe_routers(model):
        captured[layer] = []
        handles.append(router.register_forward_hook(_capture_into(captured[layer])))
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def _capture_into(chosen: list[torch.Tensor]):
    def hook(_module, _inputs, output) -> None:
        chosen.append(output[2].detach().cpu())  # (router_logits, weights, indices)

    return hook
