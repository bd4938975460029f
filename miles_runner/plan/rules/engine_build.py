"""What the engines' SGLang build serves: a plan for stock SGLang (`engine.build=stock`, the pinned release) uses
no feature that only the sglang-miles fork serves (core.sglang_protocol.FORK_ONLY). Each rule names the settings
that would use the feature; the fix is the fork, or the reason says which setting turns the feature off.
"""

from __future__ import annotations

from collections.abc import Iterator

from miles_runner.config.schema import MilesConfig
from miles_runner.core.sglang_protocol import MILES_FORK, SGLANG_VERSION, STOCK, fork_feature
from miles_runner.plan.derive import Derived
from miles_runner.plan.rules.base import ADAPTERS, PAUSE, TOPOLOGY, Finding, rule

BUILD = "engine.build"


@rule("stock-sglang-has-no-lora-broadcast")
def stock_sglang_has_no_lora_broadcast(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.engine.build == STOCK and d.lora_enabled and d.transfer_mode == "broadcast":
        colocated = "adapters=single topology=colocated" if d.multi_lora else "topology=colocated"
        yield _fork_only(
            "lora-broadcast-load",
            (TOPOLOGY, ADAPTERS),
            "Disaggregated engines receive the adapter by broadcast",
            colocated,
        )


@rule("stock-sglang-has-no-lora-upsert")
def stock_sglang_has_no_lora_upsert(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    # weight_sync.sync.make_sync upserts on a broadcast push for every multi-LoRA slot, and when requests stay paused
    # in place (an unload would wait for them).
    if not (cfg.engine.build == STOCK and d.lora_enabled and d.transfer_mode == "broadcast"):
        return
    if d.multi_lora:
        yield _fork_only("lora-upsert", (ADAPTERS,), "Every multi-LoRA push refreshes its slot in place", "")
    elif cfg.weight_sync.pause_generation_mode == "in_place":
        yield _fork_only(
            "lora-upsert",
            (PAUSE,),
            "Under an in_place pause the adapter is refreshed in place",
            f"{PAUSE}=retract",
        )


@rule("stock-sglang-has-no-prefix-abort")
def stock_sglang_has_no_prefix_abort(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.engine.build == STOCK and d.multi_lora:
        yield _fork_only(
            "abort-by-rid-prefix",
            (ADAPTERS,),
            "Retiring a multi-LoRA adapter aborts its `name::` requests",
            "adapters=single",
        )


def _fork_only(name: str, keys: tuple[str, ...], why_here: str, turn_off: str) -> Finding:
    feature = fork_feature(name)
    what = feature.route if feature.whole_route else f"`{'`, `'.join(feature.fields)}` of {feature.route}"
    without = f" Without the fork: {turn_off}." if turn_off else ""
    return Finding(
        (BUILD, *keys),
        f"{why_here} through {what}, which only the sglang-miles fork serves; stock SGLang {SGLANG_VERSION} "
        f"{feature.stock}.{without}",
        f"{BUILD}={MILES_FORK}",
    )
