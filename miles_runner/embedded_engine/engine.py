"""The embedded engine as the HTTP routes see it: requests in, results out, admin operations.

It owns the tokenizer, the model runner, the scheduler (worker thread), the LoRA registry, the pause gate and
the set of in-flight rids. Every model mutation (adapters, weights) runs on the worker thread between steps.
Validation failures raise ``ValueError`` with SGLang's wording where SGLang has one; routes turn them into
HTTP 400.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_runner.embedded_engine.args import ServerArgs
from miles_runner.embedded_engine.detokenizer import Detokenizer
from miles_runner.embedded_engine.lora_registry import (
    TENSOR_SOURCE,
    LoRARef,
    LoRARegistry,
    check_adapter_name,
    read_adapter_config,
)
from miles_runner.embedded_engine.model_runner import ModelRunner
from miles_runner.embedded_engine.prefix_cache import PrefixCache
from miles_runner.embedded_engine.protocol import (
    GenerateReqInput,
    InitWeightsUpdateGroupReqInput,
    LoadLoRAAdapterFromDistributedReqInput,
    LoadLoRAAdapterFromTensorsReqInput,
    SamplingParams,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
)
from miles_runner.embedded_engine.request import GenerationResult, GenRequest, LogprobRequest, ReqState
from miles_runner.embedded_engine.sampling import SamplingConfig
from miles_runner.embedded_engine.scheduler import Scheduler
from miles_runner.embedded_engine.validation import GREEDY_BELOW, Limits, check_token_ids, verify_sampling
from miles_runner.embedded_engine.weight_groups import WeightUpdateGroups
from miles_runner.sglang_client.tensor_shm import SegmentReader
from miles_runner.sglang_client.tensor_wire import (
    borrowed_named_tensors,
    check_tensor_checksums,
    deserialize_named_tensors,
)
from miles_runner.sglang_client.weight_update_group import parse_dtype

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

ENGINE_VERSION = "embedded-0.1"
# Secrets are never served (a keyed client must not learn the admin key, nor a proxy pass a key on).
NOT_IN_SERVER_INFO = frozenset({"ignored_flags", "api_key", "admin_api_key"})
DEFAULT_DIST_TIMEOUT_S = 300  # without --dist-timeout: how long a weight-update group join or broadcast may take


class EmbeddedEngine:
    def __init__(self, args: ServerArgs) -> None:
        from transformers import AutoTokenizer

        self.args = args
        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path)
        self.runner = ModelRunner(
            args.model_path, enable_lora=args.enable_lora, lora_target_modules=args.lora_target_modules
        )
        self.context_length = args.context_length or self.runner.config.max_position_embeddings
        check_dsa_context(self.runner.config, self.context_length)
        self.detok = Detokenizer(self.tokenizer, _eos_token_ids(args.model_path, self.tokenizer))
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.lora = LoRARegistry(args)
        self.limits = Limits(max_n=args.max_n, max_batch_size=args.max_batch_size)
        self.weight_groups = WeightUpdateGroups(args.dist_timeout or DEFAULT_DIST_TIMEOUT_S)
        self.segments = SegmentReader()  # adapter tensors a trainer on this host hands over in shared memory
        self.scheduler = Scheduler(
            self.runner,
            self.detok,
            pad_id=self.pad_id,
            context_length=self.context_length,
            max_running_requests=args.max_running_requests,
            max_loras_per_batch=args.max_loras_per_batch,
            weight_version=args.weight_version,
            prefix_cache=None if args.disable_radix_cache else PrefixCache(),
            memory_saver=args.enable_memory_saver,
            weights_cpu_backup=args.enable_weights_cpu_backup,
        )
        self._inflight: Counter[str] = Counter()  # item rids and request (parent) rids
        self._gated: set[str] = set()  # item rids waiting at the pause gate (not yet with the scheduler)
        self._aborted_at_gate: set[str] = set()  # of those, the ones an abort matched
        self._seed_counter = 0
        # asyncio's Event and Lock bind to the loop that first waits on them: they can be made before it runs.
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._lora_lock = asyncio.Lock()
        self.ready = False
        self.stopping = False
        for spec in args.lora_paths:  # before the worker starts, so no thread hop is needed
            self.lora.check_new(spec.lora_name, read_adapter_config(spec.lora_path))
            self.runner.load_adapter_from_path(spec.lora_name, spec.lora_path)
            self.lora.register(LoRARef(spec.lora_name, spec.lora_path, spec.pinned))

    # ----- lifecycle ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        self.scheduler.start(asyncio.get_running_loop())
        self.ready = True

    def begin_shutdown(self) -> None:
        """On SIGTERM: take no more requests and end every one in flight with an abort, those waiting at the pause
        gate included, so that open connections answer at once rather than at uvicorn's graceful timeout."""
        self.ready = False
        self.stopping = True
        self._aborted_at_gate |= self._gated
        self.scheduler.request_stop()
        self._unpaused.set()

    def shutdown(self) -> None:
        self.ready = False
        self.stopping = True
        self.scheduler.stop()

    @property
    def weight_version(self) -> str:
        return self.scheduler.weight_version

    # ----- building requests ------------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def build_generate_requests(self, body: GenerateReqInput) -> tuple[list[GenRequest], bool]:
        """Expand a ``/generate`` body (single or batch, n samples each) into one GenRequest per output;
        also say whether the response is a list (a batch, or n > 1) rather than one object."""
        prompts, batched = self._prompts(body)
        count = len(prompts)
        # Per-item fields: one value for every prompt, or (a batch only) one entry per prompt.
        sampling = _per_item(body.sampling_params, count, "sampling_params", batched)
        lora = _per_item(body.lora_path, count, "lora_path")  # a single prompt may name its adapter in a list of one
        return_logprob = _per_item(body.return_logprob, count, "return_logprob", batched)
        logprob_start = _per_item(body.logprob_start_len, count, "logprob_start_len", batched)
        top_logprobs = _per_item(body.top_logprobs_num, count, "top_logprobs_num", batched)
        token_ids_logprob = _token_ids_logprob(body.token_ids_logprob, count)
        rids = _item_rids(body.rid, count, batched)
        extra_keys = _per_item(body.extra_key, count, "extra_key", batched)
        self.limits.check_request([(params or SamplingParams()).n for params in sampling])
        if body.custom_logit_processor is not None:
            raise ValueError(
                "The server is not configured to enable custom logit processor. "
                "Please set `--enable-custom-logit-processor` to enable this feature."
            )
        self.lora.resolve([name for name in lora if isinstance(name, str)])
        requests = []
        for i, prompt in enumerate(prompts):
            params = sampling[i] or SamplingParams()
            logprob = LogprobRequest(
                return_logprob=bool(return_logprob[i]),
                logprob_start_len=int(logprob_start[i]),
                top_logprobs_num=int(top_logprobs[i]),
                token_ids_logprob=token_ids_logprob[i],
                return_text=body.return_text_in_logprobs,
            )
            requests += self.samples_for_prompt(
                rids[i],
                prompt,
                params,
                adapter=lora[i],
                logprob=logprob,
                routed=body.return_routed_experts,
                routed_start=body.routed_experts_start_len,
                stream=body.stream,
                extra_key=extra_keys[i] or None,  # SGLang: an empty key is no key
            )
        return requests, batched or len(requests) > 1

    def _prompts(self, body: GenerateReqInput) -> tuple[list[list[int]], bool]:
        given = [name for name in ("text", "input_ids", "input_embeds") if getattr(body, name) is not None]
        if len(given) != 1:
            raise ValueError("Exactly one of text, input_ids or input_embeds should be provided.")
        if body.input_embeds is not None:
            raise ValueError("input_embeds is not supported by the embedded engine.")
        if body.text is not None:
            texts = body.text if isinstance(body.text, list) else [body.text]
            return [self.tokenize(t) for t in texts], isinstance(body.text, list)
        ids: list[Any] = body.input_ids or []  # token ids, or a list of them (a batch)
        batched = bool(ids) and isinstance(ids[0], list)
        return (list(ids) if batched else [list(ids)]), batched

    def samples_for_prompt(
        self,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        *,
        adapter: str | None,
        logprob: LogprobRequest,
        routed: bool,
        routed_start: int,
        stream: bool,
        extra_key: str | None = None,
    ) -> list[GenRequest]:
        verify_sampling(params, self.runner.vocab_size)
        self.limits.check_request([params.n])
        self._check_prompt(prompt, logprob, routed_start)
        self._check_total_tokens(len(prompt), params.max_new_tokens)
        rids = [rid] if params.n == 1 else [f"{rid}_{j}" for j in range(params.n)]
        return [
            GenRequest(
                rid=sample_rid,
                input_ids=prompt,
                sampling=self._sampling_config(params, len(prompt), sample_index=j),
                adapter=adapter,
                logprob=logprob,
                return_routed_experts=routed and self.args.enable_return_routed_experts and self.runner.is_moe,
                routed_experts_start_len=routed_start,
                stream=stream,
                extra_key=extra_key,
            )
            for j, sample_rid in enumerate(rids)
        ]

    def _check_prompt(self, prompt: list[int], logprob: LogprobRequest, routed_start: int) -> None:
        if not prompt:
            raise ValueError("The input is empty: give a non-empty text or input_ids.")
        bad = [t for t in prompt if not 0 <= t < self.runner.vocab_size]
        if bad:
            raise ValueError(f"Token id {bad[0]} in input_ids is out of the vocabulary [0, {self.runner.vocab_size}).")
        if len(prompt) >= self.context_length:
            raise ValueError(
                f"The input ({len(prompt)} tokens) is longer than the model's context length "
                f"({self.context_length} tokens)."
            )
        if logprob.logprob_start_len >= len(prompt):
            raise ValueError(
                f"logprob_start_len ({logprob.logprob_start_len}) is superior or equal to the length of "
                f"the input ({len(prompt)})."
            )
        if not 0 <= routed_start <= len(prompt):
            raise ValueError(f"routed_experts_start_len must be in [0, {len(prompt)}], got {routed_start}.")
        if logprob.top_logprobs_num < 0:
            raise ValueError(f"top_logprobs_num must be at least 0, got {logprob.top_logprobs_num}.")
        check_token_ids("token_ids_logprob", logprob.token_ids_logprob or (), self.runner.vocab_size)

    def _check_total_tokens(self, prompt_len: int, max_new_tokens: int | None) -> None:
        """SGLang's tokenizer manager refuses a request whose prompt and max_new_tokens exceed the context."""
        if max_new_tokens is not None and prompt_len + max_new_tokens > self.context_length:
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of {self.context_length} "
                f"tokens. You requested a total of {prompt_len + max_new_tokens} tokens: {prompt_len} tokens from "
                f"the input messages and {max_new_tokens} tokens for the completion. Please reduce the number of "
                "tokens in the input messages or the completion to fit within the limit."
            )

    def _sampling_config(self, p: SamplingParams, prompt_len: int, *, sample_index: int) -> SamplingConfig:
        if p.sampling_seed is not None:
            seed = p.sampling_seed + sample_index
        else:
            self._seed_counter += 1
            seed = self.args.random_seed * 1_000_003 + self._seed_counter
        max_new = p.max_new_tokens if p.max_new_tokens is not None else self.context_length - prompt_len
        stop = (p.stop,) if isinstance(p.stop, str) else tuple(p.stop or ())
        return SamplingConfig(
            max_new_tokens=max_new,
            temperature=0.0 if p.temperature < GREEDY_BELOW else p.temperature,  # SGLang: greedy
            top_p=p.top_p,
            top_k=p.top_k,
            min_p=p.min_p,
            min_new_tokens=p.min_new_tokens,
            stop=stop,
            stop_token_ids=frozenset(p.stop_token_ids or ()),
            ignore_eos=p.ignore_eos,
            no_stop_trim=p.no_stop_trim,
            skip_special_tokens=p.skip_special_tokens,
            seed=seed,
        )

    # ----- running requests -------------------------------------------------------------------------------
    async def generate(
        self, requests: list[GenRequest], parent_rid: str | None = None
    ) -> AsyncIterator[tuple[int, GenerationResult]]:
        """Yield ``(index, result)`` as results arrive (stream snapshots, then one final per request).

        Waits at the pause gate first. If the consumer stops early (client gone), unfinished requests are
        aborted on the engine.
        """
        rids = [r.rid for r in requests]
        if parent_rid is not None and parent_rid not in rids:
            rids.append(parent_rid)  # so that an exact abort by the request's own rid reaches its samples
        self._claim(rids)
        unfinished = {r.rid for r in requests}
        try:
            await self._pass_gate(unfinished)
            if self.stopping:  # the worker is gone or going: nothing would answer these
                for index, request in enumerate(requests):
                    yield index, self._shutdown_result(request)
                unfinished.clear()
                return
            results: asyncio.Queue[tuple[int, GenerationResult]] = asyncio.Queue()
            for index, request in enumerate(requests):
                sink = _indexed_sink(results, index)
                self.scheduler.submit(ReqState(request, sink, generator_seed=request.sampling.seed))
            if aborted := unfinished & self._aborted_at_gate:  # as SGLang: aborted in the waiting queue
                self._aborted_at_gate -= aborted
                await self.scheduler.call(lambda: self.scheduler.abort_matching(aborted.__contains__))
            while unfinished:
                index, result = await results.get()
                if result.finish_reason is not None:
                    unfinished.discard(result.rid)
                yield index, result
        finally:
            if unfinished:
                self.scheduler.call(lambda: self.scheduler.abort_matching(unfinished.__contains__))
            self._inflight.subtract(rids)
            self._inflight += Counter()  # drop zero counts
            self._aborted_at_gate.difference_update(rids)

    def _shutdown_result(self, request: GenRequest) -> GenerationResult:
        state = ReqState(request, sink=lambda _result: None, generator_seed=0)
        state.abort("The server is shutting down.")
        return state.result(self.detok, self.weight_version, in_queue_abort=True)

    async def _pass_gate(self, rids: set[str]) -> None:
        """Wait while the engine is paused; an abort meanwhile is remembered for these requests."""
        self._gated |= rids
        try:
            await self._unpaused.wait()
        finally:
            self._gated -= rids

    def _claim(self, rids: list[str]) -> None:
        duplicates = [rid for rid in rids if self._inflight[rid]]
        if duplicates or len(set(rids)) != len(rids):
            raise ValueError(f"Duplicate request ID detected: {duplicates[0] if duplicates else rids}")
        self._inflight.update(rids)

    async def abort(self, rid: str, *, abort_all: bool = False, prefix: bool = False) -> None:
        """SGLang's abort: nothing unless abort_all or an exact in-flight rid (or ``prefix``); then every
        request whose rid starts with ``rid`` is aborted, waiting or running."""
        if abort_all:
            match: Callable[[str], bool] = lambda _rid: True  # noqa: E731
        elif rid and (prefix or self._inflight[rid]):
            match = lambda candidate: candidate.startswith(rid)  # noqa: E731
        else:
            return
        self._aborted_at_gate |= {gated for gated in self._gated if match(gated)}
        await self.scheduler.call(lambda: self.scheduler.abort_matching(match))

    # ----- pause, weights, cache ---------------------------------------------------------------------------
    async def pause(self, mode: str) -> None:
        self._unpaused.clear()
        await self.scheduler.call(lambda: self.scheduler.pause(mode))

    async def resume(self) -> None:
        await self.scheduler.call(self.scheduler.resume)
        self._unpaused.set()

    @property
    def paused(self) -> bool:
        return not self._unpaused.is_set()

    async def flush_cache(self) -> bool:
        """True when the prefix cache was dropped; refused while requests hold or await KV."""
        return await self.scheduler.call(self.scheduler.flush_prefix_cache)

    async def release_memory_occupation(self, tags: list[str] | None) -> None:
        await self.scheduler.call(lambda: self.scheduler.release_memory(tags))

    async def resume_memory_occupation(self, tags: list[str] | None) -> None:
        await self.scheduler.call(lambda: self.scheduler.resume_memory(tags, self.args.model_path))

    async def update_weights_from_disk(self, body: UpdateWeightFromDiskReqInput) -> str:
        def load() -> int:
            count = self.runner.update_weights_from_disk(body.model_path)
            self.args.model_path = body.model_path
            return count

        count = await self._update_weights(load, body.abort_all_requests, body.weight_version)
        return f"Succeeded to update model weights ({count} tensors) from {body.model_path}."

    async def update_weights_from_tensor(self, body: UpdateWeightsFromTensorReqInput) -> str:
        tensors = deserialize_named_tensors(body.serialized_named_tensors[0])
        count = await self._update_weights(
            lambda: self.runner.update_weights(tensors), body.abort_all_requests, body.weight_version
        )
        return f"Succeeded to update {count} tensors."

    async def init_weights_update_group(self, body: InitWeightsUpdateGroupReqInput) -> None:
        await self.weight_groups.init(
            master_address=body.master_address,
            master_port=body.master_port,
            rank=body.rank_offset,
            world_size=body.world_size,
            group_name=body.group_name,
            backend=body.backend,
        )

    async def update_weights_from_distributed(self, body: UpdateWeightsFromDistributedReqInput) -> str:
        if body.load_format is not None:
            raise ValueError(f"load_format {body.load_format!r} is not supported; send one tensor per name.")
        tensors = await self.weight_groups.receive(body.group_name, body.names, body.dtypes, body.shapes)
        count = await self._update_weights(
            lambda: self.runner.update_weights(tensors), body.abort_all_requests, body.weight_version
        )
        return f"Succeeded to update {count} tensors from group {body.group_name}."

    async def _update_weights(self, load: Callable[[], int], abort_all: bool, version: str | None) -> int:
        if abort_all:
            await self.abort("", abort_all=True)

        def apply() -> int:
            count = load()
            if version is not None:
                self.scheduler.weight_version = version
            return count

        return await self.scheduler.call_when_idle(apply)

    async def update_weight_version(self, new_version: str, abort_all: bool) -> None:
        if abort_all:
            await self.abort("", abort_all=True)

        def apply() -> None:
            self.scheduler.weight_version = new_version

        await self.scheduler.call(apply)

    # ----- LoRA --------------------------------------------------------------------------------------------
    async def load_lora(self, name: str, path: str, pinned: bool) -> None:
        async with self._lora_lock:
            check_adapter_name(name)  # before the folder is read: a bad name is refused whatever the path
            self.lora.check_new(name, read_adapter_config(path))
            await self.scheduler.call(lambda: _as_bad_adapter(name, path, self.runner.load_adapter_from_path))
            self.lora.register(LoRARef(name, path, pinned))

    async def load_lora_from_tensors(self, body: LoadLoRAAdapterFromTensorsReqInput) -> None:
        if body.load_format is not None:
            raise ValueError(f"load_format {body.load_format!r} is not supported; send one safetensors entry per rank.")
        async with self._lora_lock:
            self.lora.check_new(body.lora_name, body.config_dict)
            entry = body.serialized_named_tensors[0]  # this engine is TP rank 0
            with borrowed_named_tensors(entry, self.segments) as (tensors, borrowed):
                if body.expected_checksums is not None:
                    check_tensor_checksums(tensors, body.expected_checksums)
                await self._add_adapter(body.lora_name, body.config_dict, tensors, body.pinned, borrowed=borrowed)

    async def load_lora_from_distributed(self, body: LoadLoRAAdapterFromDistributedReqInput) -> None:
        """Receive the adapter's tensors from rank 0 of the group, then load them; an upsert of a loaded name
        overwrites its weights in place (requests paused in place keep running on the same adapter)."""
        async with self._lora_lock:
            in_place = body.upsert and body.lora_name in self.lora.loaded_adapters()
            into = None
            if not in_place:
                self.lora.check_new(body.lora_name, body.config_dict)
                into = await self.scheduler.call(lambda: self._parked_weights(body))
            tensors = await self.weight_groups.receive(body.group_name, body.names, body.dtypes, body.shapes, into=into)
            if in_place:
                await self.scheduler.call(
                    lambda: self.runner.replace_adapter_weights(body.lora_name, body.config_dict, tensors)
                )
            else:
                await self._add_adapter(body.lora_name, body.config_dict, tensors, body.pinned)

    def _parked_weights(self, body: LoadLoRAAdapterFromDistributedReqInput) -> dict[str, torch.Tensor] | None:
        """Where the broadcast may land: the parked adapter's weights, when this load would reuse them (the
        unload-then-load of a single-adapter sync); the reload then copies nothing."""
        shapes = {name: tuple(shape) for name, shape in zip(body.names, body.shapes, strict=True)}
        dtypes = {name: parse_dtype(dtype) for name, dtype in zip(body.names, body.dtypes, strict=True)}
        return self.runner.parked_weights(body.lora_name, body.config_dict, shapes, dtypes)

    async def _add_adapter(
        self, name: str, config: dict, tensors: dict, pinned: bool, *, borrowed: bool = False
    ) -> None:
        await self.scheduler.call(
            lambda: self.runner.load_adapter_from_tensors(name, config, tensors, borrowed=borrowed)
        )
        self.lora.register(LoRARef(name, TENSOR_SOURCE, pinned))

    async def unload_lora(self, name: str) -> None:
        async with self._lora_lock:
            self.lora.unregister(name)  # new requests for it fail from here on
            await self.scheduler.call_when_unused(name, lambda: self.runner.unload_adapter(name))

    # ----- info ---------------------------------------------------------------------------------------------
    def model_info(self) -> dict:
        config = self.runner.config
        return {
            "model_path": self.args.model_path,
            "served_model_name": self.args.model_name,
            "tokenizer_path": self.args.tokenizer_path or self.args.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": config.model_type,
            "architectures": list(config.architectures or []),
        }

    def server_info(self) -> dict:
        info = {k: v for k, v in asdict(self.args).items() if k not in NOT_IN_SERVER_INFO}
        info["lora_paths"] = [asdict(ref) for ref in self.lora.refs()]
        info.update(
            weight_version=self.weight_version,
            context_length=self.context_length,
            max_total_num_tokens=self.context_length * self.args.max_running_requests,
            max_req_input_len=self.context_length - 1,
            internal_states=[{**self.scheduler.load(), "paused": self.paused}],
            version=ENGINE_VERSION,
        )
        return info

    def model_cards(self) -> list[dict]:
        created = int(time.time())
        base = {
            "id": self.args.model_name,
            "object": "model",
            "created": created,
            "owned_by": "sglang",
            "root": self.args.model_name,
            "parent": None,
            "max_model_len": self.context_length,
        }
        adapters = [
            {**base, "id": ref.lora_name, "root": ref.lora_path, "parent": self.args.model_name, "max_model_len": None}
            for ref in self.lora.refs()
        ]
        return [base, *adapters]


def check_dsa_context(config, context_length: int) -> None:
    """Refuse a context longer than a DSA indexer's index_topk (the plan refuses it too, where it can read the
    checkpoint). Past it the indexer drops keys, and transformers' top-k breaks tied scores (ReLU makes exact zeros
    common) by column, which a ragged batch's padding and a prefix-cache hit move: a request's attention would depend
    on its batch. Within it every key is kept, whatever the layout."""
    index_topk = getattr(config.get_text_config(), "index_topk", None)
    if index_topk is not None and context_length > index_topk:
        raise ValueError(
            f"the embedded engine serves a DSA indexer only while it keeps every token: --context-length "
            f"{context_length} outgrows index_topk {index_topk}; pass --context-length {index_topk}"
        )


def _eos_token_ids(model_path: str, tokenizer) -> frozenset[int]:
    ids = {tokenizer.eos_token_id} - {None}
    generation_config = Path(model_path) / "generation_config.json"
    if generation_config.is_file():
        eos = json.loads(generation_config.read_text()).get("eos_token_id")
        ids |= set(eos) if isinstance(eos, list) else ({eos} - {None})
    return frozenset(ids)


def _as_bad_adapter(name: str, path: str, load: Callable[[str, str], None]) -> None:
    """peft's load of an adapter folder, its failures (a config peft refuses, weights that do not fit the model)
    reported as the request's error, a 400."""
    try:
        load(name, path)
    except Exception as exc:
        raise ValueError(f"Failed to load LoRA adapter {name} from {path}: {exc}") from exc


def _per_item(value, count: int, field: str, batched: bool = True) -> list:
    if isinstance(value, list):
        if not batched:
            raise ValueError(f"{field} must be a single value for a single prompt; a list is for a batch of prompts.")
        if len(value) != count:
            raise ValueError(f"{field} has {len(value)} entries but the request has {count} prompts.")
        return value
    return [value] * count


def _token_ids_logprob(value: list | None, count: int) -> list[tuple[int, ...] | None]:
    """One flat list for every prompt, or one list per prompt."""
    if not value:
        return [None] * count
    if isinstance(value[0], list):
        return [tuple(ids) for ids in _per_item(value, count, "token_ids_logprob")]
    return [tuple(value)] * count


def _item_rids(rid: str | list[str] | None, count: int, batched: bool) -> list[str]:
    if isinstance(rid, list):
        return _per_item(rid, count, "rid")
    if rid is None:
        return [uuid.uuid4().hex for _ in range(count)]
    return [f"{rid}_{i}" for i in range(count)] if batched else [rid]


def _indexed_sink(results: asyncio.Queue, index: int) -> Callable[[GenerationResult], None]:
    return lambda result: results.put_nowait((index, result))
