"""One generation request: what was asked (``GenRequest``), how far it got (``ReqState``), and the
immutable ``GenerationResult`` handed back to the HTTP layer (final, or a stream snapshot)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from miles_runner.embedded_engine.detokenizer import Detokenizer, find_stop_string
from miles_runner.embedded_engine.model_runner import KVCache, RowInput, RowOutput
from miles_runner.embedded_engine.prefix_cache import CachedPrefix
from miles_runner.embedded_engine.sampling import Choice, SamplingConfig, choose_token
from miles_runner.sglang_client.routed_experts import encode_routed_experts

# [logprob | None, token_id, text | None], SGLang's logprob triple.
LogprobTriple = list


@dataclass(frozen=True)
class LogprobRequest:
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: tuple[int, ...] | None = None
    return_text: bool = False


@dataclass(frozen=True)
class GenRequest:
    rid: str
    input_ids: list[int]
    sampling: SamplingConfig
    adapter: str | None = None
    logprob: LogprobRequest = LogprobRequest()
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    stream: bool = False
    extra_key: str | None = None  # the prefix cache's namespace (SGLang's radix key), with the adapter


@dataclass(frozen=True)
class GenerationResult:
    rid: str
    prompt_tokens: int
    output_ids: list[int]
    text: str
    finish_reason: dict | None
    weight_version: str
    num_retractions: int
    e2e_latency: float
    in_queue_abort: bool = False
    input_token_logprobs: list[LogprobTriple] | None = None
    output_token_logprobs: list[LogprobTriple] | None = None
    input_top_logprobs: list[list[LogprobTriple]] | None = None
    output_top_logprobs: list[list[LogprobTriple]] | None = None
    input_token_ids_logprobs: list[list[LogprobTriple]] | None = None
    output_token_ids_logprobs: list[list[LogprobTriple]] | None = None
    routed_experts: str | None = None
    cached_tokens: int = 0


@dataclass
class _Logprobs:
    """Per-position logprob records, in the shapes ``meta_info`` wants."""

    token: list[LogprobTriple] = field(default_factory=list)
    top: list[list[LogprobTriple]] = field(default_factory=list)
    token_ids: list[list[LogprobTriple]] = field(default_factory=list)


class ReqState:
    """Engine-side progress of one request; only the scheduler's worker thread touches it."""

    def __init__(self, req: GenRequest, sink: Callable[[GenerationResult], None], generator_seed: int):
        self.req = req
        self.sink = sink
        self.output_ids: list[int] = []
        self.cache: KVCache | None = None
        self.kv_len = 0
        self.routing_chunks: list[np.ndarray] = []
        self.prefix: CachedPrefix | None = None  # the prefix-cache entry the last admission started from
        self.cache_namespace: tuple | None = None  # the prefix cache's namespace at the last admission
        self.cached_tokens = 0  # prompt tokens served from the prefix cache (at the first admission, as SGLang)
        self.finish_reason: dict | None = None
        self.num_retractions = 0
        self.created_at = time.monotonic()
        self.generator = torch.Generator().manual_seed(generator_seed)
        self._input_logprobs: _Logprobs | None = None
        self._output_logprobs = _Logprobs()

    # ----- forward bookkeeping --------------------------------------------------------------------------
    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def tokens(self) -> list[int]:
        return self.req.input_ids + self.output_ids

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked for and are not recorded yet: the next forward keeps every position's logits."""
        spec = self.req.logprob
        return self._input_logprobs is None and spec.return_logprob and spec.logprob_start_len >= 0

    def prefix_limit(self) -> int:
        """How many leading tokens may come from the prefix cache (SGLang's max prefix length): all but the last,
        and none past the first prompt position whose logprob is asked for."""
        limit = len(self.tokens) - 1
        return min(limit, self.req.logprob.logprob_start_len) if self.needs_prompt_logprobs else limit

    def start_from(self, length: int, prefix: CachedPrefix) -> None:
        """Begin from the first `length` tokens' KV (and routing) in the prefix cache."""
        self.cache, routing = prefix.head(length)
        self.kv_len = length
        self.routing_chunks = [routing] if routing is not None else []
        self.prefix = prefix
        if not self.num_retractions:
            self.cached_tokens = length

    def row_input(self) -> RowInput:
        return RowInput(
            cache=self.cache,
            cache_len=self.kv_len,
            new_tokens=self.tokens[self.kv_len :],
            adapter=self.req.adapter,
            all_logits=self.needs_prompt_logprobs,
        )

    def absorb_forward(self, out: RowOutput, detok: Detokenizer) -> torch.Tensor:
        """Take the new cache and routing; record prompt logprobs once; return the next-token logits."""
        if self.needs_prompt_logprobs:  # this forward kept the logits of positions kv_len..
            self._input_logprobs = self._prompt_logprobs(out.logits, detok, first_position=self.kv_len)
        if out.routing is not None:
            self.routing_chunks.append(out.routing)
        self.cache = out.cache
        self.kv_len = len(self.tokens)
        return out.logits[-1]

    def retract(self) -> None:
        """Drop the KV cache (and its routing rows); the request recomputes from its tokens later."""
        self.cache, self.kv_len, self.routing_chunks, self.prefix = None, 0, [], None
        self.num_retractions += 1

    # ----- sampling and finishing ----------------------------------------------------------------------
    def banned_tokens(self, eos_ids: frozenset[int]) -> frozenset[int]:
        sampling = self.req.sampling
        if len(self.output_ids) >= sampling.min_new_tokens:
            return frozenset()
        return sampling.stop_token_ids | (frozenset() if sampling.ignore_eos else eos_ids)

    def append_token(self, choice: Choice, detok: Detokenizer, context_length: int) -> None:
        self.output_ids.append(choice.token_id)
        if self.req.logprob.return_logprob:
            self._record(self._output_logprobs, choice.logprobs, choice.token_id, detok)
        self.finish_reason = self._check_finished(detok, context_length)

    def sample(self, logits: torch.Tensor, eos_ids: frozenset[int]) -> Choice:
        return choose_token(logits, self.req.sampling, self.generator, self.banned_tokens(eos_ids))

    def _check_finished(self, detok: Detokenizer, context_length: int) -> dict | None:
        sampling, last = self.req.sampling, self.output_ids[-1]
        if len(self.output_ids) >= sampling.max_new_tokens or len(self.tokens) >= context_length:
            return {"type": "length", "length": len(self.output_ids)}
        if (not sampling.ignore_eos and last in detok.eos_token_ids) or last in sampling.stop_token_ids:
            return {"type": "stop", "matched": last}
        if sampling.stop:
            text = detok.decode(self.output_ids, skip_special_tokens=sampling.skip_special_tokens)
            hit = find_stop_string(text, sampling.stop)
            if hit is not None:
                return {"type": "stop", "matched": hit[0]}
        return None

    def abort(self, message: str, status_code: int | None = None) -> None:
        self.finish_reason = {"type": "abort", "message": message, "status_code": status_code, "err_type": None}

    # ----- logprobs ------------------------------------------------------------------------------------
    def _record(self, into: _Logprobs, logprobs: torch.Tensor, token_id: int, detok: Detokenizer) -> None:
        spec = self.req.logprob
        into.token.append(self._triple(float(logprobs[token_id]), token_id, detok))
        if spec.top_logprobs_num > 0:
            top = torch.topk(logprobs, min(spec.top_logprobs_num, logprobs.numel()))
            into.top.append(
                [self._triple(float(v), int(i), detok) for v, i in zip(top.values, top.indices, strict=True)]
            )
        if spec.token_ids_logprob is not None:
            into.token_ids.append([self._triple(float(logprobs[i]), i, detok) for i in spec.token_ids_logprob])

    def _triple(self, logprob: float | None, token_id: int, detok: Detokenizer) -> LogprobTriple:
        return [logprob, token_id, detok.token_text(token_id) if self.req.logprob.return_text else None]

    def _prompt_logprobs(self, logits: torch.Tensor, detok: Detokenizer, first_position: int) -> _Logprobs:
        """Entries for prompt positions ``start..len-1``; the first entry's logprob is null (SGLang). Row i of
        `logits` is position ``first_position + i`` (the tokens before came from the prefix cache)."""
        prompt, start = self.req.input_ids, self.req.logprob.logprob_start_len
        records = _Logprobs()
        first = prompt[start] if start < len(prompt) else None
        if first is not None:
            records.token.append(self._triple(None, first, detok))
            if self.req.logprob.top_logprobs_num > 0:
                records.top.append([])
            if self.req.logprob.token_ids_logprob is not None:
                records.token_ids.append([])
        scaled = torch.log_softmax(logits.float(), dim=-1)
        for position in range(start + 1, len(prompt)):
            self._record(records, scaled[position - 1 - first_position], prompt[position], detok)
        return records

    # ----- results -------------------------------------------------------------------------------------
    def result(self, detok: Detokenizer, weight_version: str, *, in_queue_abort: bool = False) -> GenerationResult:
        return GenerationResult(
            rid=self.rid,
            prompt_tokens=len(self.req.input_ids),
            output_ids=list(self.output_ids),
            text=self._text(detok),
            finish_reason=self.finish_reason,
            weight_version=weight_version,
            num_retractions=self.num_retractions,
            e2e_latency=time.monotonic() - self.created_at,
            in_queue_abort=in_queue_abort,
            routed_experts=self._routed_experts() if self.req.return_routed_experts else None,
            cached_tokens=self.cached_tokens,
            **self._logprob_fields(),
        )

    def _text(self, detok: Detokenizer) -> str:
        sampling, ids, finish = self.req.sampling, self.output_ids, self.finish_reason or {}
        matched = finish["matched"] if not sampling.no_stop_trim and finish.get("type") == "stop" else None
        if isinstance(matched, int):
            ids = ids[:-1]
        text = detok.decode(ids, skip_special_tokens=sampling.skip_special_tokens)
        if isinstance(matched, str):
            text = text[: text.find(matched)] if matched in text else text
        return text

    def _logprob_fields(self) -> dict:
        spec = self.req.logprob
        if not spec.return_logprob:
            return {}
        prompt = self._input_logprobs or _Logprobs()
        fields = {
            "input_token_logprobs": list(prompt.token),
            "output_token_logprobs": list(self._output_logprobs.token),
        }
        if spec.top_logprobs_num > 0:
            fields["input_top_logprobs"] = list(prompt.top)
            fields["output_top_logprobs"] = list(self._output_logprobs.top)
        if spec.token_ids_logprob is not None:
            fields["input_token_ids_logprobs"] = list(prompt.token_ids)
            fields["output_token_ids_logprobs"] = list(self._output_logprobs.token_ids)
        return fields

    def _routed_experts(self) -> str | None:
        """Rows for absolute positions ``start .. kv_len-1`` (every token that went through a forward)."""
        if not self.routing_chunks:
            return None
        rows = np.concatenate(self.routing_chunks, axis=0)[self.req.routed_experts_start_len :]
        return encode_routed_experts(np.ascontiguousarray(rows, dtype=np.int32))
