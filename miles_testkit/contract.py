"""The EngineClient contract: every client call run against a live engine, with the protocol facts it checks.

One list of checks serves both targets: the pytest contract tests run it against the embedded engine, and
`scripts/gpu_check_sglang.py` against real SGLang serving the same tiny model folder. Each check is
independent and leaves the engine as it found it (adapters, weights, weight version, pause state), so checks
can run alone or in any order. The engine must be started with LoRA on, `target.adapter_name` loaded from
`target.adapter_path`, and `--enable-return-routed-experts`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from miles_runner.engine import response as res
from miles_runner.engine.client import EngineClient, EngineError
from miles_runner.engine.routed_experts import decode_routed_experts
from miles_runner.procs.ports import LOOPBACK

CONTRACT_ADAPTER = "contract_adapter"
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
PROMPT = "What is 3 plus 4?"
CHAT_MESSAGES = [{"role": "user", "content": PROMPT}]
CHECK_TIMEOUT_S = 180.0

TensorWire = Callable[[Mapping[str, Any]], str]


class ContractViolation(AssertionError):
    """The engine's answer breaks the SGLang protocol as the client relies on it."""


@dataclass(frozen=True)
class ContractTarget:
    """A live engine and what the checks need to know about it.

    `lora_wire` turns `{name: tensor}` into the `serialized_tensors` string the engine takes and
    `weights_wire` into one `serialized_named_tensors` entry (MultiprocessingSerializer strings for real
    SGLang, base64 safetensors for the embedded engine). `long_tokens` is a generation length that is still
    running a moment after its first token arrives. `logprob_tol` is how far two runs of the same request
    may differ (float32 on CPU is near exact; an engine in bf16 needs more).
    """

    client: EngineClient
    model_dir: Path
    adapter_name: str
    adapter_path: Path
    lora_wire: TensorWire
    weights_wire: TensorWire
    long_tokens: int = 512
    logprob_tol: float = 1e-3

    def same_logprobs(self, a: list[float], b: list[float]) -> bool:
        return len(a) == len(b) and all(abs(x - y) <= self.logprob_tol for x, y in zip(a, b, strict=True))

    @property
    def model_config(self) -> dict[str, Any]:
        return json.loads((self.model_dir / "config.json").read_text())

    @property
    def num_layers(self) -> int:
        return int(self.model_config["num_hidden_layers"])

    @property
    def num_experts(self) -> int:
        config = self.model_config  # transformers 5 saves Qwen3-MoE's num_experts as num_local_experts
        return int(config.get("num_experts", config.get("num_local_experts")))

    @property
    def top_k(self) -> int:
        return int(self.model_config["num_experts_per_tok"])


Check = Callable[[ContractTarget], Awaitable[dict[str, Any]]]
CONTRACT_CHECKS: list[Check] = []


def contract_check(check: Check) -> Check:
    CONTRACT_CHECKS.append(check)
    return check


async def run_contract(target: ContractTarget, checks: list[Check] | None = None) -> dict[str, Any]:
    """Run the checks in order; a failing check is recorded and the rest still run."""
    results: dict[str, Any] = {}
    for check in checks or CONTRACT_CHECKS:
        started = time.monotonic()
        try:
            facts = await asyncio.wait_for(check(target), CHECK_TIMEOUT_S)
            results[check.__name__] = {"ok": True, "facts": facts}
        except Exception as exc:  # the summary reports every failure, whatever its kind
            results[check.__name__] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        results[check.__name__]["seconds"] = round(time.monotonic() - started, 3)
    passed = sum(result["ok"] for result in results.values())
    return {"passed": passed, "failed": len(results) - passed, "checks": results}


def build_contract_adapter(model_dir: Path, out_dir: Path, *, rank: int = 8, seed: int = 0) -> Path:
    """Save a PEFT LoRA adapter for `model_dir` with random (non-zero) A and B, so that it visibly changes
    the model's logprobs."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(LORA_TARGET_MODULES), init_lora_weights=False)
    get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), config).save_pretrained(out_dir)
    return out_dir


def contract_engine_argv(module: str, model_dir: Path, port: int, adapter_path: Path) -> list[str]:
    """The launch command the contract expects: `module` is sglang.launch_server or the embedded engine."""
    return [
        sys.executable, "-m", module,
        "--model-path", str(model_dir),
        "--host", LOOPBACK,
        "--port", str(port),
        "--enable-lora",
        "--lora-paths", f"{CONTRACT_ADAPTER}={adapter_path}",
        "--max-loras-per-batch", "4",
        "--enable-return-routed-experts",
    ]  # fmt: skip


# ---- helpers ------------------------------------------------------------------------------------------


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise ContractViolation(message)


def rid(tag: str) -> str:
    """Unique, prefix-free request ids (abort matches by prefix)."""
    return f"contract-{tag}-{uuid.uuid4().hex}"


def greedy(max_new_tokens: int = 8) -> dict[str, Any]:
    return {
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": -1,
        "max_new_tokens": max_new_tokens,
        "ignore_eos": True,
    }


def generate_payload(max_new_tokens: int = 8, **fields: Any) -> dict[str, Any]:
    return {"text": PROMPT, "sampling_params": greedy(max_new_tokens), "return_logprob": True, **fields}


async def greedy_logprobs(client: EngineClient, **fields: Any) -> tuple[list[int], list[float]]:
    return res.output_token_logprobs(await client.generate(generate_payload(**fields)))


async def expect_engine_error(call: Awaitable[Any], statuses: tuple[int, ...] = (400,)) -> EngineError:
    try:
        await call
    except EngineError as error:
        expect(error.status_code in statuses, f"expected HTTP {statuses}, got {error.status_code}: {error}")
        expect(bool(error.message), "the error has no message")
        return error
    raise ContractViolation(f"expected HTTP {statuses}, the call succeeded")


class BackgroundStream:
    """A streaming /generate consumed in the background; `started` is set once tokens are flowing.

    On exit an unfinished stream is aborted by its rid, so a failing check leaves nothing running.
    """

    def __init__(self, client: EngineClient, payload: Mapping[str, Any]) -> None:
        self.client = client
        self.rid = str(payload["rid"])
        self.events: list[dict[str, Any]] = []
        self.started = asyncio.Event()
        self.task = asyncio.create_task(self._consume(payload))

    async def _consume(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        try:
            async for event in self.client.generate_stream(payload):
                self.events.append(event)
                if event.get("output_ids"):
                    self.started.set()
        finally:
            self.started.set()
        return self.events[-1]

    @property
    def tokens_so_far(self) -> int:
        return len(self.events[-1]["output_ids"]) if self.events else 0

    async def wait_started(self, timeout_s: float = 60.0) -> None:
        await asyncio.wait_for(self.started.wait(), timeout_s)
        expect(not self.task.done() or self.task.exception() is None, f"stream {self.rid} failed early")

    async def result(self, timeout_s: float = 120.0) -> dict[str, Any]:
        return await asyncio.wait_for(asyncio.shield(self.task), timeout_s)

    async def __aenter__(self) -> BackgroundStream:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self.task.done():
            await self.client.abort_request(self.rid)
            self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


def long_stream(target: ContractTarget, tag: str, max_new_tokens: int | None = None) -> BackgroundStream:
    payload = generate_payload(max_new_tokens or target.long_tokens, rid=rid(tag))
    return BackgroundStream(target.client, payload)


async def still_running_after(stream: BackgroundStream, seconds: float) -> bool:
    await asyncio.sleep(seconds)
    return not stream.task.done()


# ---- health and info ------------------------------------------------------------------------------------


@contract_check
async def health_endpoints_answer_ok(target: ContractTarget) -> dict[str, Any]:
    expect(await target.client.health(), "/health is not 200")
    expect(await target.client.health_generate(), "/health_generate is not 200")
    return {}


@contract_check
async def model_info_reports_weight_version(target: ContractTarget) -> dict[str, Any]:
    info = await target.client.model_info()
    expect(isinstance(info.get("weight_version"), str), f"no weight_version in {info}")
    expect("model_path" in info, f"no model_path in {info}")
    legacy = await target.client.request("GET", "/get_model_info")
    expect(legacy.status_code == 200, f"/get_model_info answered {legacy.status_code}")
    return {"weight_version": info["weight_version"]}


@contract_check
async def server_info_reports_lora_and_routed_experts(target: ContractTarget) -> dict[str, Any]:
    info = await target.client.server_info()
    expect(info.get("enable_lora") is True, "server_info.enable_lora is not true")
    expect(info.get("enable_return_routed_experts") is True, "enable_return_routed_experts is not true")
    legacy = await target.client.request("GET", "/get_server_info")
    expect(legacy.status_code == 200, f"/get_server_info answered {legacy.status_code}")
    return {"max_loras_per_batch": info.get("max_loras_per_batch")}


@contract_check
async def list_models_has_base_and_adapter_cards(target: ContractTarget) -> dict[str, Any]:
    ids = [card["id"] for card in await target.client.list_models()]
    expect(len(ids) >= 2, f"expected a base card and an adapter card, got {ids}")
    expect(target.adapter_name in ids[1:], f"adapter {target.adapter_name} has no card in {ids}")
    return {"models": ids}


# ---- /generate ----------------------------------------------------------------------------------------


@contract_check
async def generate_text_returns_aligned_tokens_and_logprobs(target: ContractTarget) -> dict[str, Any]:
    request_id = rid("text")
    result = await target.client.generate(generate_payload(8, rid=request_id))
    info = res.meta_info(result)
    tokens, logprobs = res.output_token_logprobs(result)
    expect(tokens == result["output_ids"], "output_token_logprobs ids differ from output_ids")
    expect(len(tokens) == info["completion_tokens"] == 8, f"expected 8 tokens, got {len(tokens)}")
    expect(all(lp <= 0.0 for lp in logprobs), f"logprobs above 0: {logprobs}")
    expect(info["finish_reason"] == {"type": "length", "length": 8}, f"finish_reason {info['finish_reason']}")
    expect(info["id"] == request_id, f"meta_info.id {info['id']} is not the rid {request_id}")
    expect(info["prompt_tokens"] > 0 and isinstance(result["text"], str), "no prompt_tokens or text")
    again = await target.client.generate(generate_payload(8))
    expect(again["output_ids"] == tokens, "greedy generation is not deterministic")
    return {"prompt_tokens": info["prompt_tokens"], "weight_version": res.weight_version(result)}


@contract_check
async def generate_input_ids_batch_returns_list_in_order(target: ContractTarget) -> dict[str, Any]:
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    rids = [rid("batch0"), rid("batch1")]
    results = await target.client.generate(
        {"input_ids": prompts, "sampling_params": greedy(4), "rid": rids, "return_logprob": True}
    )
    expect(isinstance(results, list) and len(results) == 2, f"expected a list of 2, got {type(results)}")
    for prompt, request_id, result in zip(prompts, rids, results, strict=True):
        expect(result["meta_info"]["id"] == request_id, "batch results are not in input order")
        expect(res.prompt_tokens(result, prompt) == len(prompt), "prompt_tokens differs from len(input_ids)")
        expect(len(result["output_ids"]) == 4, "a batch item did not generate 4 tokens")
    return {}


@contract_check
async def generate_n_samples_returns_n_results(target: ContractTarget) -> dict[str, Any]:
    sampling = {**greedy(6), "temperature": 1.0, "n": 3}
    results = await target.client.generate({"text": PROMPT, "sampling_params": sampling})
    expect(isinstance(results, list) and len(results) == 3, "n=3 did not return 3 results")
    return {"distinct_samples": len({tuple(r["output_ids"]) for r in results})}


@contract_check
async def generate_stream_chunks_are_cumulative(target: ContractTarget) -> dict[str, Any]:
    events = [event async for event in target.client.generate_stream(generate_payload(8))]
    ids = [event["output_ids"] for event in events]
    cumulative = all(later[: len(earlier)] == earlier for earlier, later in itertools.pairwise(ids))
    expect(cumulative, "stream chunks are not cumulative")
    expect(all(res.finish_reason_type(e) is None for e in events[:-1]), "finish_reason set before the end")
    expect(res.finish_reason_type(events[-1]) == "length", "the last chunk has no finish_reason")
    final = await target.client.generate(generate_payload(8))
    expect(events[-1]["output_ids"] == final["output_ids"], "streamed result differs from non-streamed")
    return {"events": len(events)}


@contract_check
async def generate_routed_experts_have_one_row_per_forwarded_token(target: ContractTarget) -> dict[str, Any]:
    result = await target.client.generate(generate_payload(8, return_routed_experts=True))
    full = res.routed_experts(result, num_layers=target.num_layers)
    expect(full is not None, "no routed_experts in meta_info")
    rows = result["meta_info"]["prompt_tokens"] + 8 - 1
    expect(full.shape == (rows, target.num_layers, target.top_k), f"shape {full.shape}, expected {rows} rows")
    expect(int(full.min()) >= 0 and int(full.max()) < target.num_experts, "expert id out of range")
    start = 3
    tail = await target.client.generate(generate_payload(8, return_routed_experts=True, routed_experts_start_len=start))
    partial = res.routed_experts(tail, num_layers=target.num_layers, start_len=start)
    expect(partial is not None and (partial == full[start:]).all(), "routed_experts_start_len rows differ")
    return {"shape": list(full.shape)}


# ---- LoRA ---------------------------------------------------------------------------------------------


@contract_check
async def lora_path_applies_the_adapter(target: ContractTarget) -> dict[str, Any]:
    _, base = await greedy_logprobs(target.client)
    _, adapted = await greedy_logprobs(target.client, lora_path=target.adapter_name)
    expect(not target.same_logprobs(base, adapted), "the adapter does not change the logprobs")
    return {}


@contract_check
async def unknown_adapter_is_a_400_naming_it(target: ContractTarget) -> dict[str, Any]:
    name = f"never_loaded_{uuid.uuid4().hex[:8]}"
    error = await expect_engine_error(target.client.generate(generate_payload(4, lora_path=name)))
    expect(name in error.message, f"the message does not name the adapter: {error.message}")
    return {"message": error.message}


@contract_check
async def stream_with_unknown_adapter_raises_engine_error(target: ContractTarget) -> dict[str, Any]:
    # SGLang reports it as a 400 before the stream or as an error event inside it; both are an EngineError.
    name = f"never_loaded_{uuid.uuid4().hex[:8]}"
    stream = target.client.generate_stream(generate_payload(4, lora_path=name))
    error = await expect_engine_error(anext(stream))
    return {"message": error.message}


@contract_check
async def lora_load_and_unload_round_trip(target: ContractTarget) -> dict[str, Any]:
    name = f"contract_{uuid.uuid4().hex[:8]}"
    loaded = await target.client.load_lora_adapter(name, str(target.adapter_path))
    try:
        expect(loaded["success"] is True and name in loaded["loaded_adapters"], f"load reply {loaded}")
        await expect_engine_error(target.client.load_lora_adapter(name, str(target.adapter_path)))
        _, via_new = await greedy_logprobs(target.client, lora_path=name)
        _, via_startup = await greedy_logprobs(target.client, lora_path=target.adapter_name)
        expect(target.same_logprobs(via_new, via_startup), "the same adapter loaded twice gives different logprobs")
    finally:
        unloaded = await target.client.unload_lora_adapter(name)
    expect(unloaded["success"] is True and name not in unloaded["loaded_adapters"], f"unload {unloaded}")
    return {}


@contract_check
async def lora_load_from_tensors_matches_disk_adapter(target: ContractTarget) -> dict[str, Any]:
    from safetensors.torch import load_file

    tensors = load_file(str(target.adapter_path / "adapter_model.safetensors"))
    config = json.loads((target.adapter_path / "adapter_config.json").read_text())
    name = f"contract_tensors_{uuid.uuid4().hex[:8]}"
    loaded = await target.client.load_lora_adapter_from_tensors(name, config, target.lora_wire(tensors))
    try:
        expect(loaded["success"] is True, f"load_lora_adapter_from_tensors reply {loaded}")
        _, from_tensors = await greedy_logprobs(target.client, lora_path=name)
        _, from_disk = await greedy_logprobs(target.client, lora_path=target.adapter_name)
        expect(
            target.same_logprobs(from_tensors, from_disk), "adapter from tensors differs from the same adapter on disk"
        )
    finally:
        await target.client.unload_lora_adapter(name)
    return {}


# ---- weights ------------------------------------------------------------------------------------------


@contract_check
async def update_weights_from_disk_sets_weight_version(target: ContractTarget) -> dict[str, Any]:
    original = await target.client.weight_version()
    _, before = await greedy_logprobs(target.client)
    version = f"contract-disk-{uuid.uuid4().hex[:6]}"
    try:
        reply = await target.client.update_weights_from_disk(str(target.model_dir), weight_version=version)
        expect(reply["success"] is True, f"update reply {reply}")
        expect(await target.client.weight_version() == version, "model_info.weight_version not updated")
        result = await target.client.generate(generate_payload(8))
        expect(res.weight_version(result) == version, "meta_info.weight_version not updated")
        expect(
            target.same_logprobs(res.output_token_logprobs(result)[1], before),
            "reloading the same weights changed them",
        )
    finally:
        await target.client.update_weight_version(original)
    return {}


@contract_check
async def update_weights_from_tensor_changes_the_model(target: ContractTarget) -> dict[str, Any]:
    from safetensors import safe_open

    with safe_open(str(target.model_dir / "model.safetensors"), "pt") as weights:
        norm = weights.get_tensor("model.norm.weight")
    original = await target.client.weight_version()
    _, before = await greedy_logprobs(target.client)
    try:
        reply = await target.client.update_weights_from_tensor(
            [target.weights_wire({"model.norm.weight": norm * 3.0})], weight_version="contract-tensor"
        )
        expect(reply["success"] is True, f"update reply {reply}")
        _, scaled = await greedy_logprobs(target.client)
        expect(not target.same_logprobs(scaled, before), "scaling model.norm.weight did not change the logprobs")
        expect(await target.client.weight_version() == "contract-tensor", "weight_version not updated")
    finally:
        await target.client.update_weights_from_tensor([target.weights_wire({"model.norm.weight": norm})])
        await target.client.update_weight_version(original)
    _, restored = await greedy_logprobs(target.client)
    expect(target.same_logprobs(restored, before), "restoring model.norm.weight did not restore the logprobs")
    return {}


@contract_check
async def update_weight_version_is_reported(target: ContractTarget) -> dict[str, Any]:
    original = await target.client.weight_version()
    try:
        reply = await target.client.update_weight_version("contract-version")
        expect(reply["success"] is True, f"update_weight_version reply {reply}")
        expect(await target.client.weight_version() == "contract-version", "model_info not updated")
    finally:
        await target.client.update_weight_version(original)
    return {}


@contract_check
async def flush_cache_succeeds_when_idle(target: ContractTarget) -> dict[str, Any]:
    expect(await target.client.flush_cache() is True, "flush_cache on an idle engine did not succeed")
    return {}


# ---- abort and pause ----------------------------------------------------------------------------------


@contract_check
async def abort_by_rid_returns_partial_tokens(target: ContractTarget) -> dict[str, Any]:
    async with long_stream(target, "abort") as stream:
        await stream.wait_started()
        await target.client.abort_request(stream.rid)
        final = await stream.result()
    expect(res.is_aborted(final), f"finish_reason {final['meta_info']['finish_reason']}, expected abort")
    tokens = len(final["output_ids"])
    expect(0 < tokens < target.long_tokens, f"expected partial tokens, got {tokens}")
    expect(len(res.output_token_logprobs(final)[0]) == tokens, "logprobs not aligned with partial tokens")
    return {"partial_tokens": tokens}


@contract_check
async def abort_all_aborts_non_streaming_requests(target: ContractTarget) -> dict[str, Any]:
    request = generate_payload(target.long_tokens, rid=rid("abort-all"))
    pending = asyncio.create_task(target.client.generate(request))
    async with long_stream(target, "abort-all-stream") as stream:
        await stream.wait_started()
        await target.client.abort_request(abort_all=True)
        streamed = await stream.result()
    result = await asyncio.wait_for(pending, 60)
    expect(res.is_aborted(result) and res.is_aborted(streamed), "abort_all left a request unaborted")
    return {"partial_tokens": len(result["output_ids"])}


@contract_check
async def abort_by_prefix_aborts_every_match(target: ContractTarget) -> dict[str, Any]:
    prefix = rid("prefix") + "-"
    async with contextlib.AsyncExitStack() as running:
        streams = [
            await running.enter_async_context(
                BackgroundStream(target.client, generate_payload(target.long_tokens, rid=f"{prefix}{i}"))
            )
            for i in range(2)
        ]
        bystander = asyncio.create_task(target.client.generate(generate_payload(16, rid=rid("bystander"))))
        for stream in streams:
            await stream.wait_started()
        await target.client.abort_request(prefix, prefix=True)
        finals = [await stream.result() for stream in streams]
    expect(all(res.is_aborted(final) for final in finals), "a request matching the prefix was not aborted")
    expect(res.finish_reason_type(await bystander) == "length", "a request outside the prefix was aborted")
    return {}


@contract_check
async def pause_abort_aborts_running_and_holds_new_requests(target: ContractTarget) -> dict[str, Any]:
    async with long_stream(target, "pause-abort") as stream:
        await stream.wait_started()
        try:
            await target.client.pause_generation("abort")
            final = await stream.result()
            expect(res.is_aborted(final), "pause(abort) did not abort the running request")
            held = asyncio.create_task(target.client.generate(generate_payload(4)))
            await asyncio.sleep(1.0)
            expect(not held.done(), "a request sent while paused was not held")
        finally:
            await target.client.continue_generation()
    result = await asyncio.wait_for(held, 60)
    expect(res.finish_reason_type(result) == "length", "the held request did not complete after continue")
    return {}


async def _pause_then_resume(target: ContractTarget, mode: str) -> dict[str, Any]:
    """A running request survives `mode` (retract or in_place): no tokens while paused, complete after."""
    async with long_stream(target, f"pause-{mode}", max_new_tokens=target.long_tokens) as stream:
        await stream.wait_started()
        try:
            await target.client.pause_generation(mode)
            paused_at = stream.tokens_so_far
            expect(await still_running_after(stream, 1.0), f"the request finished during pause({mode})")
            expect(stream.tokens_so_far <= paused_at + 1, f"tokens kept flowing during pause({mode})")
            flushed = await target.client.flush_cache()
        finally:
            await target.client.continue_generation()
        final = await stream.result()
    expect(res.finish_reason_type(final) == "length", f"finish {final['meta_info']['finish_reason']}")
    expect(len(final["output_ids"]) == target.long_tokens, "the resumed request is incomplete")
    return {"flush_cache_while_paused": flushed, "tokens_at_pause": paused_at}


@contract_check
async def pause_retract_resumes_running_requests(target: ContractTarget) -> dict[str, Any]:
    return await _pause_then_resume(target, "retract")


@contract_check
async def pause_in_place_resumes_running_requests_and_blocks_flush(target: ContractTarget) -> dict[str, Any]:
    facts = await _pause_then_resume(target, "in_place")
    expect(facts["flush_cache_while_paused"] is False, "flush_cache succeeded with a request kept in place")
    return facts


# ---- OpenAI chat --------------------------------------------------------------------------------------


def chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": "default", "messages": CHAT_MESSAGES, "max_tokens": 8, "temperature": 0.0, **fields}


@contract_check
async def chat_completion_returns_meta_info_and_weight_version(target: ContractTarget) -> dict[str, Any]:
    reply = await target.client.chat_completions(chat_body(logprobs=True, return_meta_info=True))
    choice = reply["choices"][0]
    expect(isinstance(choice["message"]["content"], str), "message.content is not a string")
    tokens, _ = res.output_token_logprobs(choice)
    expect(len(tokens) == reply["usage"]["completion_tokens"], "meta_info logprobs differ from usage")
    version = await target.client.weight_version()
    expect(reply.get("metadata", {}).get("weight_version") == version, "metadata.weight_version missing")
    return {"finish_reason": choice["finish_reason"]}


@contract_check
async def chat_model_suffix_selects_the_adapter(target: ContractTarget) -> dict[str, Any]:
    def logprobs(reply: dict[str, Any]) -> list[float]:
        return res.output_token_logprobs(reply["choices"][0])[1]

    body = chat_body(logprobs=True, return_meta_info=True)
    base = logprobs(await target.client.chat_completions(body))
    suffix = logprobs(await target.client.chat_completions({**body, "model": f"default:{target.adapter_name}"}))
    field = logprobs(await target.client.chat_completions({**body, "lora_path": target.adapter_name}))
    expect(target.same_logprobs(suffix, field), "model 'base:adapter' and lora_path disagree")
    expect(not target.same_logprobs(suffix, base), "model 'base:adapter' did not apply the adapter")
    return {}


@contract_check
async def chat_routed_experts_decode(target: ContractTarget) -> dict[str, Any]:
    reply = await target.client.chat_completions(chat_body(return_routed_experts=True))
    payload = res.chat_routed_experts_payload(reply)
    expect(payload is not None, "no routed_experts in the chat response")
    usage = reply["usage"]
    rows = usage["prompt_tokens"] + usage["completion_tokens"] - 1
    experts = decode_routed_experts(payload, rows, target.num_layers)
    expect(experts.shape[2] == target.top_k, f"top_k {experts.shape[2]}, expected {target.top_k}")
    return {"shape": list(experts.shape)}


# ---- errors -------------------------------------------------------------------------------------------


@contract_check
async def generate_without_input_is_a_native_error(target: ContractTarget) -> dict[str, Any]:
    error = await expect_engine_error(target.client.generate({"sampling_params": greedy(4)}), (400, 422))
    return {"status": error.status_code, "message": error.message}


@contract_check
async def chat_without_messages_is_an_openai_error(target: ContractTarget) -> dict[str, Any]:
    error = await expect_engine_error(target.client.chat_completions({"model": "default"}), (400, 422))
    expect("messages" in error.message, f"the message does not name the field: {error.message}")
    return {"status": error.status_code}
