"""Routing replay (R3) in sessions: which rows each turn asks for, and how the patches become one tensor.

Under incremental R3 a turn asks only for the rows after its checkpoint (`routed_experts_start_len =
len(checkpoint) - 1`), so the rows of a session are sent once. Assembly treats the records as a strict
append-only stream of patches: any gap, overlap, missing payload or wrong size is an error that names the
turn and the rows, never a silently wrong tensor.

Speed (bench/r3_merge_speed.py): once the first patch has set the result's width, each patch is base64-decoded
straight into its rows of the preallocated result (sglang_client/base64_into.py: one pass, no intermediate bytes); a
patch that does not fit exactly (another top-k, a stop-edge row) is decoded on its own and checked. That way a long
session's merge runs within a small factor of a plain copy's bandwidth. (Threads gain nothing here: the writes into
fresh pages of the result bound it, not the decoding.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from miles_runner.session.errors import TokenizationError
from miles_runner.session.records import SessionRecord
from miles_runner.session.tito import common_prefix_len
from miles_runner.sglang_client.base64_into import b64decode_into
from miles_runner.sglang_client.routed_experts import decode_routed_experts


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
    if required_rows < 0:
        raise ValueError(f"incremental R3: required_rows must be >= 0, got {required_rows}")
    patches, stream_error = _patch_stream(records, required_rows)
    merged = _MergedRows(required_rows, num_layers)
    for patch in patches:  # in turn order: a turn's error comes first
        merged.add(patch)
    if stream_error is not None:
        raise stream_error
    return merged.result()


@dataclass(frozen=True)
class _Patch:
    turn: int
    payload: str
    start: int
    end: int


def _patch_stream(records: Sequence[SessionRecord], required_rows: int) -> tuple[list[_Patch], ValueError | None]:
    """The turns' patches while they form an append-only stream from row 0, and the error that ends it early
    (raised after the patches before it are checked, so that the first faulty turn is the one reported)."""
    patches: list[_Patch] = []
    covered = 0
    for turn, record in enumerate(records):
        if patches and covered >= required_rows:
            break
        start = record.request.get("routed_experts_start_len")
        if start is None:
            return patches, ValueError(f"incremental R3: turn {turn} was sent without routed_experts_start_len")
        if start != covered:
            problem = "leaves a gap over" if start > covered else "overlaps"
            lo, hi = sorted((covered, start))
            return patches, ValueError(
                f"incremental R3: turn {turn} starts at row {start} but rows [0, {covered}) are covered; "
                f"it {problem} rows [{lo}, {hi})"
            )
        payload = record.meta_info.get("routed_experts")
        _, end = record_row_span(record)
        if payload is None:
            error = f"incremental R3: turn {turn} has no routed_experts payload for rows [{start}, {end})"
            return patches, ValueError(error)
        patches.append(_Patch(turn, payload, start, end))
        covered = end
    if covered < required_rows:
        return patches, ValueError(
            f"incremental R3: the records cover rows [0, {covered}) but the sample needs {required_rows} "
            "rows (len(tokens) - 1)"
        )
    return patches, None


class _MergedRows:
    """Rows [0, required_rows), each patch decoded straight into its rows. The result is allocated at the first
    patch that has rows (its top-k sets the width); a patch of another top-k is only noted, so that every turn is
    still checked in order before the disagreement is reported."""

    def __init__(self, required_rows: int, num_layers: int) -> None:
        self.required_rows = required_rows
        self.num_layers = num_layers
        self.topks: set[int] = set()
        self.rows: np.ndarray | None = None

    def add(self, patch: _Patch) -> None:
        """Decode `patch` into its rows of the result (allocating it at the first)."""
        merged = self.rows
        fits = patch.start < patch.end <= self.required_rows
        if merged is not None and fits and b64decode_into(patch.payload, merged[patch.start : patch.end]):
            return  # one pass, no bytes between: the payload filled exactly its rows, the result's top-k
        rows = _decode_patch(patch.payload, patch.turn, patch.start, patch.end, self.num_layers)
        if not len(rows):
            return
        if merged is None:
            merged = self.rows = np.empty((self.required_rows, self.num_layers, rows.shape[2]), dtype=np.int32)
        if rows.shape[2] == merged.shape[2]:
            stop = min(patch.end, self.required_rows)
            merged[patch.start : stop] = rows[: stop - patch.start]
        self.topks.add(rows.shape[2])

    def result(self) -> np.ndarray:
        if self.rows is None:  # no patch has rows: the empty shape a zero-row patch decodes to
            return np.zeros((0, self.num_layers, 0), dtype=np.int32)
        if len(self.topks) > 1:
            raise ValueError(
                f"R3: the turns disagree on top-k ({sorted(self.topks)}); the patches cannot be concatenated"
            )
        return self.rows


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
