"""tiny-glm5 speaks GLM-4.7's chat format, as GLM-5 does on the agentic path (the TITO family glm47): its special
tokens, its template's renders (checked against zai-org/GLM-4.7's chat_template.jinja), its stop tokens, and format
pre-training on the transcripts the session server assembles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles_runner.core.tiny_shapes import GLM47_SPECIAL_TOKENS, GLM47_TEXT_TOKENS, TINY_SHAPES
from miles_runner.models.format_pretrain import format_recipe, transcript_tokens
from miles_runner.models.tiny_model import GLM47, GLM47_CHAT_TEMPLATE, build_tokenizer, builder_version
from miles_runner.session.tito import Glm47Tito

SYSTEM = {"role": "system", "content": "Count the words."}
USER = {"role": "user", "content": "How many words: cat dog?"}
CALL = {
    "role": "assistant",
    "content": "",
    "reasoning_content": "Ask the tool.",
    "tool_calls": [{"type": "function", "function": {"name": "count", "arguments": {"text": "cat dog", "n": 2}}}],
}
RESULT = {"role": "tool", "content": "2"}
ANSWER = {"role": "assistant", "content": "2", "reasoning_content": "It said 2."}
AGAIN = {"role": "user", "content": "And now?"}
CONVERSATION = [SYSTEM, USER, CALL, RESULT, ANSWER, AGAIN]

HEAD = "[gMASK]<sop><|system|>Count the words.<|user|>How many words: cat dog?"
CALLED = (
    "<tool_call>count<arg_key>text</arg_key><arg_value>cat dog</arg_value>"
    "<arg_key>n</arg_key><arg_value>2</arg_value></tool_call>"
)
OBSERVED = "<|observation|><tool_response>2</tool_response>"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("glm47_tokenizer")
    build_tokenizer(folder, GLM47)
    return AutoTokenizer.from_pretrained(folder)


def render(tokenizer, messages, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def test_the_tokenizer_has_glm_tokens_within_the_models_vocabulary(tokenizer):
    assert len(tokenizer) == TINY_SHAPES["tiny-glm5"]["vocab_size"]
    for token in GLM47_SPECIAL_TOKENS + GLM47_TEXT_TOKENS:
        assert tokenizer.encode(token, add_special_tokens=False) == [tokenizer.convert_tokens_to_ids(token)], token
    assert tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>"
    # The role tokens are special; GLM's reasoning and tool-call markers decode as text.
    ids = tokenizer.encode("<|assistant|><think>x</think>7<|user|>", add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think>x</think>7"


def test_a_conversation_with_tools_renders_as_glm47_renders_it(tokenizer):
    kept = render(tokenizer, CONVERSATION, add_generation_prompt=True, clear_thinking=False)
    assert kept == (
        f"{HEAD}<|assistant|><think>Ask the tool.</think>{CALLED}{OBSERVED}"
        "<|assistant|><think>It said 2.</think>2<|user|>And now?<|assistant|><think>"
    )
    # By default a turn before the last user message loses its reasoning.
    cleared = render(tokenizer, CONVERSATION, add_generation_prompt=True)
    assert (
        cleared
        == f"{HEAD}<|assistant|></think>{CALLED}{OBSERVED}<|assistant|></think>2<|user|>And now?<|assistant|><think>"
    )
    assert render(tokenizer, CONVERSATION[:5], add_generation_prompt=False) == (
        f"{HEAD}<|assistant|><think>Ask the tool.</think>{CALLED}{OBSERVED}<|assistant|><think>It said 2.</think>2"
    )


def test_the_generation_prompt_opens_thinking_unless_it_is_off(tokenizer):
    assert render(tokenizer, [USER], add_generation_prompt=True).endswith("?<|assistant|><think>")
    off = render(tokenizer, [USER], add_generation_prompt=True, enable_thinking=False)
    assert off == "[gMASK]<sop><|user|>How many words: cat dog?<|assistant|></think>"


def test_consecutive_tool_results_share_one_observation_and_reasoning_in_content_is_split(tokenizer):
    messages = [USER, {"role": "assistant", "content": "<think>\nhmm\n</think>\ncalling"}, RESULT, RESULT]
    assert render(tokenizer, messages) == (
        "[gMASK]<sop><|user|>How many words: cat dog?<|assistant|><think>hmm</think>calling"
        "<|observation|><tool_response>2</tool_response><tool_response>2</tool_response>"
    )


def test_tools_open_the_prompt_with_glm47s_system_block(tokenizer):
    tool = {"type": "function", "function": {"name": "count", "parameters": {"type": "object"}}}
    text = render(tokenizer, [USER], tools=[tool], add_generation_prompt=True)
    assert text.startswith("[gMASK]<sop><|system|>\n# Tools\n\nYou may call one or more functions")
    assert (
        '<tools>\n{"type": "function", "function": {"name": "count", "parameters": {"type": "object"}}}\n</tools>'
        in text
    )
    assert "<arg_value>{arg-value-2}</arg_value>...</tool_call><|user|>How many words" in text


def test_the_glm47_family_renders_and_merges_on_it(tokenizer):
    tito = Glm47Tito(tokenizer)
    rendered = tito.render(CONVERSATION, tools=None, add_generation_prompt=True, template_kwargs={})
    assert rendered == render(tokenizer, CONVERSATION, add_generation_prompt=True, clear_thinking=False)
    # A turn the model ended with <|user|> or <|observation|> loses it; the appended message opens with it again.
    stored = [*tito.first_turn_ids([USER], None, {}), *tito.encode("</think>3"), tito.token_id("<|user|>")]
    merged = tito.merge_tokens(
        [USER, {"role": "assistant", "content": "3"}], stored, [{"role": "user", "content": "Wrong."}], None, {}
    )
    assert merged[: len(stored)] == stored
    assert tito.decode(merged) == (
        "[gMASK]<sop><|user|>How many words: cat dog?<|assistant|><think></think>3<|user|>Wrong.<|assistant|><think>"
    )
    stored = [*tito.first_turn_ids([USER], None, {}), *tito.encode("</think>"), tito.token_id("<|observation|>")]
    merged = tito.merge_tokens([USER, {"role": "assistant", "content": ""}], stored, [RESULT], None, {})
    assert tito.decode(merged).endswith(
        "<think></think><|observation|><tool_response>2</tool_response><|assistant|><think>"
    )


def test_format_pretraining_trains_the_replies_as_the_session_stores_them(tokenizer):
    messages = [
        USER,
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "Wrong."},
        {"role": "assistant", "content": "2"},
    ]
    ids, mask = transcript_tokens(tokenizer, messages)
    assert tokenizer.decode(ids) == (
        "[gMASK]<sop><|user|>How many words: cat dog?<|assistant|><think></think>3<|user|>Wrong."
        "<|assistant|><think></think>2<|user|>"
    )
    assert tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m]) == "</think>3<|user|></think>2<|user|>"


def test_only_tiny_glm5s_pretrained_folder_records_its_base_version():
    assert "base_version" not in format_recipe("tiny-moe", 0)  # folders pre-trained before stay valid
    assert format_recipe("tiny-glm5", 0)["base_version"] == builder_version("tiny-glm5")


@pytest.mark.integration
def test_the_built_folder_stops_where_glm47_does():
    from miles_runner.models.tiny_model import COMPLETE_MARKER, ensure_tiny_model

    folder = ensure_tiny_model("tiny-glm5")
    ids = {t["content"]: t["id"] for t in json.loads((folder / "tokenizer.json").read_text())["added_tokens"]}
    stops = [ids["<|endoftext|>"], ids["<|user|>"], ids["<|observation|>"]]
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == stops
    config = json.loads((folder / "config.json").read_text())
    assert config["eos_token_id"] == stops and config["pad_token_id"] == ids["<|endoftext|>"]
    assert (folder / "chat_template.jinja").read_text() == GLM47_CHAT_TEMPLATE
    assert json.loads((folder / COMPLETE_MARKER).read_text())["builder_version"] == builder_version("tiny-glm5")


@pytest.mark.integration
@pytest.mark.slow
def test_the_format_pretrained_model_answers_count_through_the_glm_template():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miles_runner.models.format_pretrain import ensure_format_pretrained
    from miles_runner.plugins.tasks import TASKS

    folder: Path = ensure_format_pretrained("tiny-glm5")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    task = TASKS.get("count")(0)
    for index in range(8):
        ids = tokenizer.apply_chat_template(task.prompt(index).messages, add_generation_prompt=True, return_dict=False)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False, pad_token_id=0)
        reply = tokenizer.decode(out[0, len(ids) :])
        assert reply.startswith("</think>") and reply.endswith("<|user|>"), reply
        assert 1 <= int(reply.removeprefix("</think>").removesuffix("<|user|>")) <= 6, reply
