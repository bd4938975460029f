"""Routing replay (R3) in sessions: which rows each turn asks for, and how the patches become one tensor.

Under incremental R3 a turn asks only for the rows after its checkpoint (`routed_experts_start_len =
len(checkpoint) - 1`), so the rows of a session are sent once. Assembly treats the records as a strict
append-only stream of patches: any gap, overlap, missing payload or wrong size is an error that names the
turn and the rows, never a silently wrong tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from miles_runner.engine.routed_experts import decode_routed_experts
from miles_runner.session.errors import TokenizationError
from miles_runner.session.records import SessionRecord
from miles_runner.session.tito import common_prefix_len


def addition_r3_start_len(checkpoint_ids: Sequence[int], prompt_ids: Sequence[int]) -> int:
    """First routing row a turn must ask for: the checkpoint's rows are already held by earlier records."""
    previous_rows = max(0, len(checkpoint_ids) - 1)
    stable = common_prefix_len(checkpoint_ids, prompt_ids)
    if stable < previous_rows:
        raise TokenizationError(
            f"incremental R3 needs the first {previous_rows} prompt tokens to equal the checkpoint's, "
            f"but they differ at token {stable}"
        )
    return previous_rows


def record_row_span(record: SessionRecord) -> tuple[int, int]:
    """[start, end) rows of the routing this record's response carries."""
    start = int(record.request.get("routed_experts_start_len") or 0)
    end = len(record.prompt_ids) + len(record.meta_info["output_token_logprobs"]) - 1
    return start, end


def decode_record_r3(record: SessionRecord, turn: int, num_layers: int) -> np.ndarray | None:
    """The routing rows of one record, shape (end - start, num_layers, topk); None when it carries none."""
    payload = record.meta_info.get("routed_experts")
    if payload is None:
        return None
    start, end = record_row_span(record)
    return _decode_patch(payload, turn, start, end, num_layers)


def assemble_incremental_r3(records: Sequence[SessionRecord], required_rows: int, num_layers: int) -> np.ndarray:
    """Concatenate the per-turn patches into rows [0, required_rows)."""
    covered = 0
    chunks: list[np.ndarray] = []
    for turn, record in enumerate(records):
        if chunks and covered >= required_rows:
            break
        start = record.request.get("routed_experts_start_len")
        if start is None:
            raise ValueError(f"incremental R3: turn {turn} was sent without routed_experts_start_len")
        if start != covered:
            problem = "leaves a gap over" if start > covered else "overlaps"
            lo, hi = sorted((covered, start))
            raise ValueError(
                f"incremental R3: turn {turn} starts at row {start} but rows [0, {covered}) are covered; "
                f"it {problem} rows [{lo}, {hi})"
            )
        payload = record.meta_info.get("routed_experts")
        _, end = record_row_span(record)
        if payload is None:
            raise ValueError(f"incremental R3: turn {turn} has no routed_experts payload for rows [{start}, {end})")
        chunks.append(_decode_patch(payload, turn, start, end, num_layers))
        covered = end
    if covered < required_rows:
        raise ValueError(
            f"incremental R3: the records cover rows [0, {covered}) but the sample needs {required_rows} "
            "rows (len(tokens) - 1)"
        )
    return _concatenate(chunks, required_rows)


def _decode_patch(payload: str, turn: int, start: int, end: int, num_layers: int) -> np.ndarray:
    rows = end - start
    if rows < 0:
        raise ValueError(f"R3: turn {turn} has start row {start} after its end row {end}")
    if bool(payload) != bool(rows):
        state = "a payload" if payload else "an empty payload"
        raise ValueError(f"R3: turn {turn} carries {state} for {rows} rows [{start}, {end})")
    try:
        return decode_routed_experts(payload, rows, num_layers)
    except ValueError as error:
        raise ValueError(f"R3: turn {turn} rows [{start}, {end}): {error}") from error


def _concatenate(chunks: list[np.ndarray], required_rows: int) -> np.ndarray:
    non_empty = [chunk for chunk in chunks if len(chunk)]
    if not non_empty:
        return chunks[0][:0]
    topks = sorted({chunk.shape[2] for chunk in non_empty})
    if len(topks) > 1:
        raise ValueError(f"R3: the turns disagree on top-k ({topks}); the patches cannot be concatenated")
    return np.ascontiguousarray(np.concatenate(non_empty)[:required_rows])
