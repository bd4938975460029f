"""Request bodies with the field names, required fields and JSON shapes of the pinned SGLang
(core.sglang_protocol.SGLANG_VERSION: io_struct.py, openai/protocol.py); tests/sglang_client/test_wire_format.py checks
them against SGLang's own definitions.

Unknown keys are treated as SGLang treats them: ignored at the top level of every body (SGLang parses native
bodies as typed dicts with `extra_behavior="ignore"` and OpenAI bodies with pydantic's default), refused inside
/generate's `sampling_params` (SGLang's contract gate rejects them). Wrong types are rejected naming the field.
Keys SGLang defines that this engine does not implement are refused by name rather than dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from miles_runner.sglang_client.client import DEFAULT_GROUP_NAME

# SGLang's /generate sampling_params keys this engine does not implement (the wire-format tests keep this list
# equal to SGLang's keys minus SamplingParams' fields below).
NOT_IMPLEMENTED_SAMPLING_KEYS = ("stop_regex", "stream_interval", "logit_bias", "beam_width", "watermark", "choice")


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")  # as SGLang's /generate contract gate

    max_new_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    min_new_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    n: int = 1
    sampling_seed: int | None = None
    # Accepted so that every request SGLang takes is taken (the penalties range-checked as SGLang does, validation.py)
    # and not applied: the embedded engine's sampler has no penalties and no custom logit processor.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    custom_params: dict[str, Any] | None = None
    # Constrained decoding is refused with a 400 rather than silently ignored.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_not_implemented(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        given = [key for key in NOT_IMPLEMENTED_SAMPLING_KEYS if data.get(key) not in (None, [], {})]
        if given:
            raise ValueError(f"{given} are SGLang sampling keys the embedded engine does not implement")
        # Their empty values are SGLang's defaults: nothing to implement.
        return {key: value for key, value in data.items() if key not in NOT_IMPLEMENTED_SAMPLING_KEYS}


class GenerateReqInput(_Body):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    input_embeds: Any = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    token_ids_logprob: list[int] | list[list[int]] | None = None
    return_text_in_logprobs: bool = False
    lora_path: str | list[str | None] | None = None
    extra_key: str | list[str] | None = None
    custom_logit_processor: str | list[str | None] | None = None
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    return_hidden_states: bool = False


class ChatMessage(_Body):
    role: str
    content: str | list[dict[str, Any]] | None = None


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ChatCompletionRequest(_Body):
    messages: list[ChatMessage]
    model: str = "default"
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    lora_path: str | None = None
    rid: str | None = None
    extra_key: str | None = None
    input_ids: list[int] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
    return_meta_info: bool = False
    return_prompt_token_ids: bool = False
    return_token_ids: bool = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    return_cached_tokens_details: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None


class AbortReqInput(_Body):
    rid: str = ""
    abort_all: bool = False
    prefix: bool = False  # fork-only (core.sglang_protocol): abort every rid that starts with ``rid``


class PauseGenerationReqInput(_Body):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationReqInput(_Body):
    torch_empty_cache: bool = True


class ReleaseMemoryOccupationReqInput(_Body):
    tags: list[str] | None = None  # kv_cache, weights, cuda_graph; none: all


class ResumeMemoryOccupationReqInput(_Body):
    tags: list[str] | None = None


class LoadLoRAAdapterReqInput(_Body):
    lora_name: str
    lora_path: str
    pinned: bool = False


class UnloadLoRAAdapterReqInput(_Body):
    lora_name: str


class LoadLoRAAdapterFromTensorsReqInput(_Body):
    lora_name: str
    config_dict: dict[str, Any]
    # One entry per TP rank (this engine has one and reads entry 0); engine.tensor_wire says what an entry holds.
    serialized_named_tensors: list[str] = Field(min_length=1)
    pinned: bool = False
    added_tokens_config: dict[str, Any] | None = None
    load_format: str | None = None  # SGLang's "flattened_bucket" packing: refused, not implemented here
    expected_checksums: dict[str, str] | None = None  # tensor name -> sha256 of its bytes, checked before loading


class _WeightUpdate(_Body):
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True
    load_format: str | None = None


class UpdateWeightFromDiskReqInput(_WeightUpdate):
    model_path: str


class UpdateWeightsFromTensorReqInput(_WeightUpdate):
    serialized_named_tensors: list[str] = Field(min_length=1)


class UpdateWeightVersionReqInput(_Body):
    new_version: str
    abort_all_requests: bool = True


class InitWeightsUpdateGroupReqInput(_Body):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int
    world_size: int = Field(ge=2)
    group_name: str = DEFAULT_GROUP_NAME
    backend: str = "nccl"


class DestroyWeightsUpdateGroupReqInput(_Body):
    group_name: str = DEFAULT_GROUP_NAME


class _BroadcastTensors(_Body):
    """Metadata of tensors that rank 0 of ``group_name`` broadcasts, one after the other, in this order."""

    names: list[str]
    dtypes: list[str]  # torch dtype names without "torch.", e.g. "bfloat16"
    shapes: list[list[int]]
    group_name: str = DEFAULT_GROUP_NAME

    @model_validator(mode="after")
    def _one_entry_per_tensor(self):
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(
                f"names, dtypes and shapes must have one entry per tensor; got {len(self.names)}, "
                f"{len(self.dtypes)} and {len(self.shapes)}"
            )
        if len(set(self.names)) != len(self.names):
            raise ValueError("names must be unique")
        if any(dim < 0 for shape in self.shapes for dim in shape):
            raise ValueError("shapes must not have negative dimensions")
        return self


class UpdateWeightsFromDistributedReqInput(_BroadcastTensors, _WeightUpdate):
    pass


class LoadLoRAAdapterFromDistributedReqInput(_BroadcastTensors):
    """A fork-only route (core.sglang_protocol.FORK_ONLY); its fields are the fork's."""

    lora_name: str
    config_dict: dict[str, Any]
    pinned: bool = False
    upsert: bool = False  # fork-only: replace the weights of a loaded adapter in place, no unload
    added_tokens_config: dict[str, Any] | None = None
