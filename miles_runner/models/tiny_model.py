"""Deterministic tiny Hugging Face models for CPU runs and tests; never a hub download.

Two shapes, both saved as ordinary HF model folders (config.json, generation_config.json,
model.safetensors, tokenizer.json, tokenizer_config.json, chat_template.jinja):

- ``tiny-moe``: a Qwen3-MoE causal LM (2 layers, hidden 64, 8 experts, top-2) whose routers give real
  per-token expert choices (R3 routing replay).
- ``tiny-dense``: a Qwen3 dense causal LM of the same width.
- ``tiny-glm5``: a GLM-5 (``glm_moe_dsa``) causal LM of the same width: MLA attention, a DSA indexer that keeps
  every token of its context, a dense first layer, then 4 routed experts (top-2) and a shared expert.

The tokenizer is a byte-level BPE trained here on a small embedded corpus (digits, arithmetic, chat words,
answer formats), about 400 tokens, with ChatML special tokens and a chat template that honours
``add_generation_prompt``. Weights use ``initializer_range`` 0.1 (larger than usual) so that a LoRA adapter
can steer the model within a few RL steps.

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
from pathlib import Path
from typing import Any

from miles_runner.core.paths import model_cache_dir
from miles_runner.core.tiny_shapes import TINY_SHAPES

TINY_MODEL_NAMES = ("tiny-moe", "tiny-dense", "tiny-glm5")
# Bump when the builder's output changes, so cached folders are rebuilt.
BUILDER_VERSION = 1
COMPLETE_MARKER = "tiny_model.json"
# The models whose marker predates its "name" key (``dense`` tells them apart): their markers stay as they were, so
# their cached folders stay complete.
UNNAMED_MARKERS = ("tiny-moe", "tiny-dense")

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOKENIZER_VOCAB_SIZE = TINY_SHAPES["tiny-moe"]["vocab_size"]

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

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


def build_tokenizer(out_dir: Path) -> int:
    """Train the byte-level BPE tokenizer, save it with the chat template; return the vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.save_pretrained(out_dir)
    return len(wrapped)


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
    shape = dict(TINY_SHAPES[name])
    if vocab_size != shape["vocab_size"]:
        raise RuntimeError(f"the embedded tokenizer has {vocab_size} tokens; TINY_SHAPES says {shape['vocab_size']}")
    model_type = shape.pop("model_type")
    extra: dict[str, Any] = dict(
        initializer_range=init_std,
        tie_word_embeddings=False,
        sliding_window=None,
        bos_token_id=None,
        eos_token_id=token_ids["<|im_end|>"],
        pad_token_id=token_ids["<|endoftext|>"],
    )
    if model_type == "glm_moe_dsa":
        del extra["sliding_window"]  # full attention; GLM-5's config has no such key
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
    vocab_size = build_tokenizer(out)
    token_ids = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    model_name = _model_name(name, dense)
    config = _model_config(vocab_size, token_ids, name=model_name, init_std=init_std)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=[token_ids["<|im_end|>"], token_ids["<|endoftext|>"]],
        pad_token_id=token_ids["<|endoftext|>"],
    )
    if model_name == "tiny-glm5":
        # Left for each transformers version to derive: 5.12 (Megatron-Bridge's) refuses the newer name of GLM-5's
        # layer type ("indexed_attention"), and the newer versions refuse to write 5.12's.
        model.config.layer_types = None
    model.save_pretrained(out)
    dense = model_name == "tiny-dense"
    marker: dict[str, Any] = {"builder_version": BUILDER_VERSION, "dense": dense, "seed": seed, "init_std": init_std}
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
        recorded.get("builder_version") == BUILDER_VERSION
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
