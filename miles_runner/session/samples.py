"""Training samples from a session's records (docs/system.md §2.8): compute per turn -> truncate -> merge.

Every failure is a ValueError whose message names the turn; the server maps it to 422.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from miles_runner.session.r3 import assemble_incremental_r3, decode_record_r3
from miles_runner.session.records import SessionRecord

Decode = Callable[[list[int]], str]


class SampleStatus(StrEnum):
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"


STATUS_OF_FINISH: dict[str | None, SampleStatus] = {  # by finish_reason (None: unfinished)
    "stop": SampleStatus.COMPLETED,
    "tool_calls": SampleStatus.COMPLETED,
    "length": SampleStatus.TRUNCATED,
    "abort": SampleStatus.ABORTED,
}


@dataclass
class Sample:
    tokens: list[int]
    response_length: int
    loss_mask: list[int]
    rollout_log_probs: list[float]
    rollout_routed_experts: np.ndarray | None
    status: SampleStatus
    response: str = ""
    weight_versions: list[str] = field(default_factory=list)
    prefix_cache_info: dict[str, int] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    reward: float | None = None

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length


@dataclass(frozen=True)
class AssemblyOptions:
    max_trim_tokens: int
    use_addition_r3: bool
    num_layers: int
    max_seq_len: int | None = None


def build_sample(
    records: Sequence[SessionRecord], accumulated_ids: Sequence[int], options: AssemblyOptions, decode: Decode
) -> tuple[Sample | None, str | None]:
    """One merged sample for a linear chain of records, or (None, empty_reason)."""
    if not records:
        return None, "no_records"
    turns = compute_turn_samples(records, accumulated_ids, options)
    if options.max_seq_len is not None:
        turns = truncate_samples_by_total_tokens(turns, options.max_seq_len)
    if not turns:
        return None, "all_truncated"
    merged = merge_samples(turns, decode)
    if options.use_addition_r3 and any(r.meta_info.get("routed_experts") is not None for r in records):
        required_rows = len(merged.tokens) - 1
        merged.rollout_routed_experts = assemble_incremental_r3(records, required_rows, options.num_layers)
    return merged, None


def compute_turn_samples(
    records: Sequence[SessionRecord], accumulated_ids: Sequence[int], options: AssemblyOptions
) -> list[Sample]:
    """One sample per record, aligned with the accumulated ids (outputs may lose a trimmed tail)."""
    samples = []
    cursor = 0
    for turn, record in enumerate(records):
        prompt = record.prompt_ids
        if list(accumulated_ids[: len(prompt)]) != list(prompt):
            raise ValueError(f"turn {turn}: its prompt ({len(prompt)} tokens) is not a prefix of the session ids")
        matched = _matched_output_len(record.output_ids, accumulated_ids, len(prompt))
        trim = len(record.output_ids) - matched
        allowed = 0 if turn == len(records) - 1 else options.max_trim_tokens
        if trim > allowed:
            raise ValueError(
                f"turn {turn}: {trim} output tokens are not in the session ids (at most {allowed} may be trimmed)"
            )
        cursor = len(prompt) + matched
        samples.append(_turn_sample(record, turn, matched, options))
    if cursor != len(accumulated_ids):
        raise ValueError(f"the records cover {cursor} tokens but the session holds {len(accumulated_ids)}")
    return samples


def _matched_output_len(output_ids: list[int], accumulated_ids: Sequence[int], cursor: int) -> int:
    matched = 0
    for token in output_ids:
        if cursor + matched >= len(accumulated_ids) or accumulated_ids[cursor + matched] != token:
            break
        matched += 1
    return matched


def _turn_sample(record: SessionRecord, turn: int, matched: int, options: AssemblyOptions) -> Sample:
    meta = record.meta_info
    tokens = [*record.prompt_ids, *record.output_ids[:matched]]
    routed = None if options.use_addition_r3 else decode_record_r3(record, turn, options.num_layers)
    if routed is not None:
        start = int(record.request.get("routed_experts_start_len") or 0)
        if start:
            raise ValueError(f"turn {turn}: full R3 expected rows from 0, the record starts at row {start}")
        routed = routed[: len(tokens) - 1]
    return Sample(
        tokens=tokens,
        response_length=matched,
        loss_mask=[1] * matched,
        rollout_log_probs=record.output_logprobs[:matched],
        rollout_routed_experts=routed,
        status=STATUS_OF_FINISH.get(record.choice.get("finish_reason"), SampleStatus.ABORTED),
        response=record.choice["message"].get("content") or "",
        weight_versions=[str(meta.get("weight_version", "default"))],
        prefix_cache_info={
            "cached_tokens": int(meta.get("cached_tokens") or 0),
            "total_prompt_tokens": len(record.prompt_ids),
        },
    )


def truncate_samples_by_total_tokens(samples: Sequence[Sample], max_seq_len: int) -> list[Sample]:
    """Keep the turns that fit; cut the first that does not (dropped if no output remains); drop the rest."""
    kept = []
    for sample in samples:
        if len(sample.tokens) <= max_seq_len:
            kept.append(sample)
            continue
        keep = max_seq_len - sample.prompt_length
        if keep > 0:
            kept.append(_cut_response(sample, keep))
        break
    return kept


def _cut_response(sample: Sample, keep: int) -> Sample:
    tokens = sample.tokens[: sample.prompt_length + keep]
    routed = sample.rollout_routed_experts
    return dataclasses.replace(
        sample,
        tokens=tokens,
        response_length=keep,
        loss_mask=sample.loss_mask[:keep],
        rollout_log_probs=sample.rollout_log_probs[:keep],
        rollout_routed_experts=None if routed is None else routed[: len(tokens) - 1],
        status=SampleStatus.TRUNCATED,
    )


def merge_samples(samples: Sequence[Sample], decode: Decode) -> Sample:
    """Fold consecutive turns into one sample; observation tokens between turns get mask 0, logprob 0."""
    merged = dataclasses.replace(samples[0], weight_versions=list(samples[0].weight_versions))
    first_prompt_length = merged.prompt_length
    for turn, sample in enumerate(samples[1:], start=1):
        if merged.status != SampleStatus.COMPLETED:
            break
        if merged.rollout_routed_experts is not None and sample.rollout_routed_experts is None:
            break  # a replay gap: the rest of the trajectory has no routing to train with
        _append_turn(merged, sample, turn)
    merged.response = decode(merged.tokens[first_prompt_length:])
    return merged


def _append_turn(merged: Sample, sample: Sample, turn: int) -> None:
    if sample.tokens[: len(merged.tokens)] != merged.tokens:
        raise ValueError(f"turn {turn}: its tokens do not extend the previous turns (inconsistent prefix)")
    observation = sample.prompt_length - len(merged.tokens)
    if observation < 0:
        raise ValueError(f"turn {turn}: its prompt is shorter than the previous turns' tokens")
    merged.tokens = sample.tokens
    merged.response_length += observation + sample.response_length
    merged.loss_mask = [*merged.loss_mask, *[0] * observation, *sample.loss_mask]
    merged.rollout_log_probs = [*merged.rollout_log_probs, *[0.0] * observation, *sample.rollout_log_probs]
    merged.rollout_routed_experts = sample.rollout_routed_experts
    merged.status = sample.status
    merged.weight_versions.extend(sample.weight_versions)
    merged.prefix_cache_info = {
        key: merged.prefix_cache_info.get(key, 0) + value for key, value in sample.prefix_cache_info.items()
    }
