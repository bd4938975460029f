"""LoRA target modules: expansion of `all-linear` (MLA-aware) and exclusion, per docs/system.md §1.2 rules 18-19."""

from __future__ import annotations

STANDARD_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MLA_KV = ("kv_a_proj_with_mqa", "kv_b_proj")
MLA_Q = ("q_a_proj", "q_b_proj")
ALL_ALIASES = ("all-linear", "all_linear", "all")
# Names that a Megatron or HF model may expose as LoRA targets; anything else is most likely a typo.
KNOWN_MODULES = frozenset(
    STANDARD_LINEAR
    + MLA_KV
    + MLA_Q
    + ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "in_proj_qkvz", "in_proj_ba", "experts")
    + ("linear_q", "linear_k", "linear_v", "linear_fc1_gate", "linear_fc1_up", "wq_b", "wk", "weights_proj")
)


def expand_target_modules(
    targets: list[str], exclude: list[str], *, kv_lora_rank: int = 0, q_lora_rank: int = 0
) -> list[str]:
    """The concrete module list: aliases expanded (never the DSA indexer), exclusions removed, order kept."""
    out: list[str] = []
    for name in targets:
        if name in ALL_ALIASES:
            # miles' expansion (docs/system.md §1.2 rule 19): the standard names stay for an MLA model too, where
            # they match nothing; only names written out are checked against the model (lora-target-not-in-model).
            expanded = list(STANDARD_LINEAR)
            if kv_lora_rank:
                expanded += MLA_KV
                if q_lora_rank:
                    expanded += MLA_Q
        else:
            expanded = [name]
        out += [m for m in expanded if m not in out]
    return [m for m in out if m not in set(exclude)]


def is_known_module(name: str) -> bool:
    """Wildcards and dotted paths pass: they address modules the model defines."""
    return name in KNOWN_MODULES or name in ALL_ALIASES or "*" in name or "." in name


def absent_modules(*, kv_lora_rank: int, q_lora_rank: int) -> frozenset[str]:
    """The attention linears a model does not have: MLA (kv_lora_rank > 0) projects keys and values through
    kv_a_proj_with_mqa and kv_b_proj (no k_proj, v_proj), and queries through q_a_proj and q_b_proj when it has a
    query rank (else q_proj); standard attention has none of the MLA ones."""
    if not kv_lora_rank:
        return frozenset(MLA_KV + MLA_Q)
    return frozenset(("k_proj", "v_proj") + (("q_proj",) if q_lora_rank else MLA_Q))
