"""Which SGLang protocol miles-runner speaks: stock SGLang at one pinned release, plus the few features that
only the sglang-miles fork serves, each listed here once.

`SGLANG_VERSION` is the pin: pyproject's `gpu` extra installs exactly this release, every run records it in
provenance.json, and the wire-format tests (tests/sglang_client/test_wire_format.py) check every request body the
project sends against this release's own request definitions (read from its wheel).

A plan says which build its engines are (`engine.build`): `stock` (the pinned release from PyPI) or
`miles_fork` (sglang-miles, which the embedded engine also implements). The rules in
plan/rules/engine_build.py refuse, on a stock plan, every setting that would use a feature of FORK_ONLY.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SGLANG_VERSION = "0.5.23"
STOCK = "stock"
MILES_FORK = "miles_fork"
ENGINE_BUILDS = (STOCK, MILES_FORK)
# SGLang's _SAMPLING_EPS: a temperature in [0, eps) samples greedily, and SGLang then reports the logprobs of
# temperature 1.0 (SamplingParams.__post_init__ sets temperature 1.0 and top_k 1), which the trainer must match.
GREEDY_TEMPERATURE_BELOW = 1e-6


# The memory tags of release/resume_memory_occupation (sglang/srt/constants.py); a body without tags means all.
KV_CACHE_TAG, WEIGHTS_TAG, CUDA_GRAPH_TAG = "kv_cache", "weights", "cuda_graph"
MEMORY_TAGS = (KV_CACHE_TAG, WEIGHTS_TAG, CUDA_GRAPH_TAG)


def offload_tags(levels: Sequence[str]) -> list[str]:
    """What miles' train.py releases after each rollout: the CUDA graphs always, the KV cache and the weights where
    --offload-rollout-level names `kv_cache` and `weight`."""
    return [
        CUDA_GRAPH_TAG,
        *([KV_CACHE_TAG] if "kv_cache" in levels else []),
        *([WEIGHTS_TAG] if "weight" in levels else []),
    ]


def logprob_temperature(temperature: float) -> float:
    """The temperature whose distribution SGLang's logprobs describe when a request asks for `temperature`."""
    return 1.0 if 0.0 <= temperature < GREEDY_TEMPERATURE_BELOW else temperature


@dataclass(frozen=True)
class ForkFeature:
    """A request that only the sglang-miles fork serves.

    `fields`: the request fields stock SGLang does not define on `route`; with `whole_route`, stock has no such
    route and `fields` is the fork's whole body. `stock`: what stock SGLang does instead, as read in its source
    at SGLANG_VERSION (a phrase that follows "stock SGLang 0.5.23").
    """

    name: str
    route: str
    fields: tuple[str, ...]
    whole_route: bool
    stock: str
    used_for: str


LORA_BROADCAST_ROUTE = "/load_lora_adapter_from_distributed"
ABORT_ROUTE = "/abort_request"

# The body of the fork's broadcast load, as miles sends it (lora_name ... group_name; then pinned, upsert,
# added_tokens_config). The tensors themselves travel by the weight-update group's broadcast.
LORA_BROADCAST_FIELDS = (
    "lora_name",
    "config_dict",
    "names",
    "dtypes",
    "shapes",
    "group_name",
    "pinned",
    "upsert",
    "added_tokens_config",
)

FORK_ONLY: tuple[ForkFeature, ...] = (
    ForkFeature(
        "lora-broadcast-load",
        LORA_BROADCAST_ROUTE,
        LORA_BROADCAST_FIELDS,
        True,
        "has no such route (404); it loads adapters only from disk or from tensors sent in the request",
        "adapter sync by broadcast (weight_sync on disaggregated engines, every multi-LoRA push)",
    ),
    ForkFeature(
        "lora-upsert",
        LORA_BROADCAST_ROUTE,
        ("upsert",),
        False,
        "cannot refresh a loaded adapter in place; it unloads it first, which waits for requests paused in place",
        "multi-LoRA pushes, and single-adapter broadcast pushes under pause_generation_mode=in_place",
    ),
    ForkFeature(
        "abort-by-rid-prefix",
        ABORT_ROUTE,
        ("prefix",),
        False,
        "drops `prefix` (AbortReq has no such field) and aborts only when `rid` names a request in flight",
        "retiring a multi-LoRA adapter aborts its `name::` requests",
    ),
)


def fork_only_route(route: str) -> bool:
    """Whether stock SGLang has no `route` at all."""
    return any(f.route == route and f.whole_route for f in FORK_ONLY)


def fork_only_fields(route: str) -> frozenset[str]:
    """The fields of `route` that only the fork defines (every field of a fork-only route)."""
    return frozenset(field for f in FORK_ONLY if f.route == route for field in f.fields)


def fork_feature(name: str) -> ForkFeature:
    return next(f for f in FORK_ONLY if f.name == name)
