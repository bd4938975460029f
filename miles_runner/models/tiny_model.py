"""Deterministic tiny Hugging Face models for CPU runs and tests; never a hub download.

Two shapes, both saved as ordinary HF model folders (config.json, generation_config.json,
model.safetensors, tokenizer.json, tokenizer_config.json, chat_template.jinja):

- ``tiny-moe``: a Qwen3-MoE causal LM (2 layers, hidden 64, 8 experts, top-2) whose routers give real
  per-token expert choices (R3 routing replay).
- ``tiny-dense``: a Qwen3 dense causal LM of the same width.
- ``tiny-glm5``: a GLM-5 (``glm_moe_dsa``) causal LM of the same width: MLA attention, a DSA indexer that keeps
  every token of its context, a dense first layer, then 4 routed experts (top-2) and a shared expert.

The tokenizer is a byte-level BPE trained here on a small embedded corpus (digits, arithmetic, chat words,
answer formats), 400 tokens with its added ones. tiny-moe and tiny-dense speak ChatML (a chat template that honours
``add_generation_prompt``; eos ``<|im_end|>``). tiny-glm5 speaks GLM-4.7's chat format, as GLM-5 does: ``[gMASK]<sop>``,
the role tokens ``<|system|>``, ``<|user|>``, ``<|assistant|>``, ``<|observation|>`` (tool results), ``<think>``
reasoning that ``clear_thinking=False`` keeps in past turns, a generation prompt ending ``<|assistant|><think>``, and
``<|endoftext|>``, ``<|user|>`` and ``<|observation|>`` as its stop tokens. Weights use ``initializer_range`` 0.1
(larger than usual) so that a LoRA adapter can steer the model within a few RL steps.

Public API (other components rely on it):
- ``build_tiny_model(out_dir, *, dense=False, seed=0, init_std=0.1, name=None) -> Path`` writes one folder
  (``name`` picks any of ``TINY_MODEL_NAMES``; without it ``dense`` picks tiny-dense or tiny-moe).
- ``ensure_tiny_model(name="tiny-moe", cache_dir=None, seed=0) -> Path`` returns the cached folder
  ``<cache>/models/<name>-seed<seed>`` (``miles_runner.core.paths.cache_dir``: $MILES_CACHE_DIR, else a
  source checkout's .cache/, else the user's cache folder), building it when missing or incomplete. Builds go to a temp
  folder that is renamed into place, so a crash never leaves a half model.
- CLI: ``python -m miles_runner.models.tiny_model DIR [--dense | --name NAME] [--seed N]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_runner.core.paths import model_cache_dir
from miles_runner.core.tiny_shapes import CHATML_TOKENS, GLM47_SPECIAL_TOKENS, GLM47_TEXT_TOKENS, TINY_SHAPES

TINY_MODEL_NAMES = ("tiny-moe", "tiny-dense", "tiny-glm5")
# Bump when the builder's output changes, so cached folders are rebuilt; a change to one model bumps its entry in
# MODEL_VERSIONS instead, so that the others' folders stay valid.
BUILDER_VERSION = 1
MODEL_VERSIONS = {"tiny-glm5": 3}  # 2: GLM-4.7's tokenizer and chat template; 3: its format model reads in 5.12
COMPLETE_MARKER = "tiny_model.json"
# The models whose marker predates its "name" key (``dense`` tells them apart): their markers stay as they were, so
# their cached folders stay complete.
UNNAMED_MARKERS = ("tiny-moe", "tiny-dense")

TOKENIZER_VOCAB_SIZE = TINY_SHAPES["tiny-moe"]["vocab_size"]

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# GLM-4.7's chat template (zai-org/GLM-4.7 chat_template.jinja; the TITO family glm47 renders with it), cut down to
# what the runner's messages carry (string contents; OpenAI tool calls with object arguments, as session/messages.py
# template_view gives them) and rendering as it does: no newline after a role token; an assistant turn opens with its
# reasoning in <think>...</think> when clear_thinking=False or it follows the last user message, else with a bare
# </think>; consecutive tool results share one <|observation|>; the generation prompt opens thinking with <think>
# (</think> when enable_thinking=False).
GLM47_CHAT_TEMPLATE = (
    r"""[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}
{{ tool | tojson(ensure_ascii=False) }}
{% endfor %}
</tools>

For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>"""
    r"""<arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>
{%- endif -%}
{%- set ns = namespace(last_user_index=-1) -%}
{%- for m in messages -%}
    {%- if m.role == 'user' -%}{%- set ns.last_user_index = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
    {%- set content = m.content if m.content is string else '' -%}
    {%- if m.role == 'system' -%}
        {{- '<|system|>' + content -}}
    {%- elif m.role == 'user' -%}
        {{- '<|user|>' + content -}}
    {%- elif m.role == 'assistant' -%}
        {%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' -%}
        {%- if m.reasoning_content is not string and '</think>' in content -%}
            {%- set reasoning = content.split('</think>')[0].rstrip('
').split('<think>')[-1].lstrip('
') -%}
            {%- set content = content.split('</think>')[-1].lstrip('
') -%}
        {%- endif -%}
        {{- '<|assistant|>' -}}
        {%- set keep = (clear_thinking is defined and not clear_thinking) or loop.index0 > ns.last_user_index -%}
        {%- if keep and reasoning -%}
            {{- '<think>' + reasoning.strip() + '</think>' -}}
        {%- else -%}
            {{- '</think>' -}}
        {%- endif -%}
        {{- content.strip() -}}
        {%- for tc in m.tool_calls or [] -%}
            {%- set call = tc.function if tc.function else tc -%}
            {{- '<tool_call>' + call.name -}}
            {%- for k, v in call.arguments.items() -%}
                {{- '<arg_key>' + k + '</arg_key><arg_value>' -}}
                {{- v if v is string else v | tojson(ensure_ascii=False) -}}
                {{- '</arg_value>' -}}
            {%- endfor -%}
            {{- '</tool_call>' -}}
        {%- endfor -%}
    {%- elif m.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|observation|>' -}}{%- endif -%}
        {{- '<tool_response>' + content + '</tool_response>' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|assistant|>' + ('</think>' if enable_thinking is defined and not enable_thinking else '<think>') -}}
{%- endif -%}"""
)


@dataclass(frozen=True)
class ChatFormat:
    """A tiny tokenizer's added tokens and chat template, and the tokens that end a turn."""

    special_tokens: tuple[str, ...]  # trained into the BPE first, so they take the lowest ids
    eos_token: str
    pad_token: str
    additional_special_tokens: tuple[str, ...]
    stop_tokens: tuple[str, ...]  # generation_config.json's eos_token_id, in this order
    template: str
    text_tokens: tuple[str, ...] = ()  # single tokens that decode as text (skip_special_tokens keeps them)


CHATML = ChatFormat(
    special_tokens=CHATML_TOKENS,
    eos_token="<|im_end|>",
    pad_token="<|endoftext|>",
    additional_special_tokens=("<|im_start|>",),
    stop_tokens=("<|im_end|>", "<|endoftext|>"),
    template=CHAT_TEMPLATE,
)
# As GLM-4.7's tokenizer_config.json and generation_config.json have them: the end-of-text token ends and pads, and a
# turn also ends where the model opens the next message (a user's, or a tool result's).
GLM47 = ChatFormat(
    special_tokens=GLM47_SPECIAL_TOKENS,
    eos_token="<|endoftext|>",
    pad_token="<|endoftext|>",
    additional_special_tokens=GLM47_SPECIAL_TOKENS,
    stop_tokens=("<|endoftext|>", "<|user|>", "<|observation|>"),
    template=GLM47_CHAT_TEMPLATE,
    text_tokens=GLM47_TEXT_TOKENS,
)
CHAT_FORMATS = {"tiny-moe": CHATML, "tiny-dense": CHATML, "tiny-glm5": GLM47}


def builder_version(name: str) -> int:
    return MODEL_VERSIONS.get(name, BUILDER_VERSION)


_CHAT_LINES = """\
You are a helpful assistant.
Hello! How can I help you today?
Please answer the question. Think step by step, then give the final answer.
What is the answer? The answer is 42.
Answer: 7
The final answer is 12.
#### 15
<answer>9</answer>
Compute the sum of the numbers. Add them together.
What is 3 plus 4? 3 + 4 = 7. So the answer is 7.
What is 9 minus 2? 9 - 2 = 7.
What is 6 times 7? 6 * 7 = 42.
What is 8 divided by 2? 8 / 2 = 4.
Let me think. First, I add the tens, then the ones.
The user asks a question and the assistant answers it.
Thank you! You are welcome. Goodbye.
Sure, here is the result: 100.
Count from one to ten: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10.
Is the number even or odd? The number is even.
Yes. No. Maybe. Correct. Wrong. Try again.
system user assistant tool function call result
The weather is nice today, and the sky is blue.
Write a short story about a cat and a dog.
Reply with a single number.
"""


def training_corpus() -> list[str]:
    """The embedded tokenizer corpus: chat phrases plus every small sum, difference and product."""
    lines = _CHAT_LINES.splitlines()
    for a in range(13):
        for b in range(13):
            lines.append(f"{a} + {b} = {a + b}. {a} * {b} = {a * b}. {a + b} - {b} = {a}.")
    lines += [f"The answer is {n}. Answer: {n}" for n in range(0, 200, 7)]
    return lines


def build_tokenizer(out_dir: Path, chat: ChatFormat = CHATML) -> int:
    """Train the byte-level BPE tokenizer, save it with the chat template; return the vocab size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE - len(chat.text_tokens),  # the text tokens are added after training
        special_tokens=list(chat.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(), trainer=trainer)
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in chat.text_tokens])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=chat.eos_token,
        pad_token=chat.pad_token,
        additional_special_tokens=list(chat.additional_special_tokens),
    )
    wrapped.chat_template = chat.template
    wrapped.save_pretrained(out_dir)
    return len(wrapped)


def added_token_ids(model_dir: Path) -> dict[str, int]:
    """The ids of a saved tokenizer's added tokens (special or not)."""
    added = json.loads((model_dir / "tokenizer.json").read_text())["added_tokens"]
    return {token["content"]: token["id"] for token in added}


def _model_name(name: str | None, dense: bool) -> str:
    return name if name is not None else ("tiny-dense" if dense else "tiny-moe")


def _glm5_config(shape: dict[str, Any], extra: dict[str, Any]) -> Any:
    from transformers import GlmMoeDsaConfig

    config = GlmMoeDsaConfig(
        **shape,
        **extra,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        # Megatron-Bridge's GLM-5 bridge reads this key, which the config only writes when it is given.
        indexer_rope_interleave=False,
        num_nextn_predict_layers=0,
    )
    # transformers 5.12 (Megatron-Bridge's) also reads a `num_experts` key, 256 when absent; newer versions fold it
    # into n_routed_experts. Written, so that every version sees one expert count.
    config.num_experts = shape["n_routed_experts"]
    return config


def _model_config(vocab_size: int, token_ids: dict[str, int], *, name: str, init_std: float) -> Any:
    chat = CHAT_FORMATS[name]
    shape = dict(TINY_SHAPES[name])
    if vocab_size != shape["vocab_size"]:
        raise RuntimeError(f"the embedded tokenizer has {vocab_size} tokens; TINY_SHAPES says {shape['vocab_size']}")
    model_type = shape.pop("model_type")
    extra: dict[str, Any] = dict(
        initializer_range=init_std,
        tie_word_embeddings=False,
        sliding_window=None,
        bos_token_id=None,
        eos_token_id=token_ids[chat.eos_token],
        pad_token_id=token_ids[chat.pad_token],
    )
    if model_type == "glm_moe_dsa":
        del extra["sliding_window"]  # full attention; GLM-5's config has no such key
        extra["eos_token_id"] = [token_ids[token] for token in chat.stop_tokens]  # GLM-5's config lists them all
        return _glm5_config(shape, extra)
    if model_type == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(**shape, **extra)
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**shape, **extra)


def build_tiny_model(
    out_dir: str | Path, *, dense: bool = False, seed: int = 0, init_std: float = 0.1, name: str | None = None
) -> Path:
    """Write a complete tiny model folder (weights, config, tokenizer, chat template) to ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model_name = _model_name(name, dense)
    chat = CHAT_FORMATS[model_name]
    vocab_size = build_tokenizer(out, chat)
    token_ids = added_token_ids(out)
    config = _model_config(vocab_size, token_ids, name=model_name, init_std=init_std)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=[token_ids[token] for token in chat.stop_tokens],
        pad_token_id=token_ids[chat.pad_token],
    )
    save_portable(model, out)
    dense = model_name == "tiny-dense"
    marker: dict[str, Any] = {
        "builder_version": builder_version(model_name),
        "dense": dense,
        "seed": seed,
        "init_std": init_std,
    }
    if model_name not in UNNAMED_MARKERS:
        marker["name"] = model_name
    (out / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return out


def _is_complete(folder: Path, *, name: str, seed: int) -> bool:
    marker = folder / COMPLETE_MARKER
    if not marker.is_file():
        return False
    recorded = json.loads(marker.read_text())
    return (
        recorded.get("builder_version") == builder_version(name)
        and recorded.get("name", _model_name(None, bool(recorded.get("dense")))) == name
        and (recorded.get("seed") == seed)
    )


def ensure_tiny_model(name: str = "tiny-moe", cache_dir: str | Path | None = None, seed: int = 0) -> Path:
    """Return the cached tiny model folder, building it (atomically, via rename) when missing or stale."""
    if name not in TINY_MODEL_NAMES:
        raise ValueError(f"unknown tiny model {name!r}; choose one of {', '.join(TINY_MODEL_NAMES)}")
    root = Path(cache_dir) if cache_dir is not None else model_cache_dir()
    target = root / f"{name}-seed{seed}"
    if _is_complete(target, name=name, seed=seed):
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        build_tiny_model(staging, seed=seed, name=name)
        if target.exists() and not _is_complete(target, name=name, seed=seed):
            shutil.rmtree(target, ignore_errors=True)
        try:
            staging.rename(target)
        except OSError:
            # Another process finished the same build first; its folder is as good as ours.
            if not _is_complete(target, name=name, seed=seed):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a deterministic tiny HF model folder.")
    parser.add_argument("out_dir", type=Path)
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--dense", action="store_true", help="dense Qwen3 instead of Qwen3-MoE")
    shape.add_argument("--name", choices=TINY_MODEL_NAMES, help="which tiny model (default tiny-moe)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init-std", type=float, default=0.1)
    args = parser.parse_args(argv)
    path = build_tiny_model(args.out_dir, dense=args.dense, seed=args.seed, init_std=args.init_std, name=args.name)
    print(path)


if __name__ == "__main__":
    main()


def save_portable(model: Any, out: Path) -> None:
    """Save a tiny model so that every transformers version here reads it: GLM-5's ``layer_types`` is left for
    each version to derive (5.12, Megatron-Bridge's, refuses the newer name "indexed_attention", and the newer
    versions refuse to write 5.12's)."""
    if getattr(model.config, "model_type", "") == "glm_moe_dsa":
        model.config.layer_types = None
    model.save_pretrained(out)
