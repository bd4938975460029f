"""TitoTokenizer.render skips apply_chat_template's conversion of message objects (ours are plain JSON): it must still
render exactly what `tokenizer.apply_chat_template(..., tokenize=False)` renders, as SGLang does, for every message
shape a session stores (content, reasoning, tool calls with JSON-text or object arguments, None fields), with and
without tools, on the model's own template and on the qwen3 family's fixed one."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_runner.session.errors import MessageValidationError
from miles_runner.session.messages import template_view
from miles_runner.session.tito import TitoTokenizer

TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)
ARGUMENTS = st.dictionaries(st.sampled_from(["a", "city", "n"]), st.one_of(TEXT, st.integers()), max_size=2)
TOOL_CALL = st.fixed_dictionaries(
    {
        "id": st.sampled_from(["c1", "c2"]),
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["add", "weather"]), "arguments": st.one_of(ARGUMENTS.map(json.dumps), ARGUMENTS)}
        ),
    }
)
USER = st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": TEXT})
TOOL = st.fixed_dictionaries({"role": st.just("tool"), "content": TEXT, "tool_call_id": st.sampled_from(["c1", "c2"])})
ASSISTANT = st.fixed_dictionaries(
    {"role": st.just("assistant"), "content": st.one_of(st.none(), TEXT)},
    optional={
        "reasoning_content": st.one_of(st.none(), TEXT),
        "tool_calls": st.one_of(st.none(), st.lists(TOOL_CALL, max_size=2)),
    },
)
CONVERSATION = st.lists(st.one_of(USER, ASSISTANT, TOOL), min_size=1, max_size=6)
TOOLS = st.one_of(
    st.none(),
    st.just(
        [
            {
                "type": "function",
                "function": {
                    "name": "add",
                    "description": "adds",
                    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
                },
            }
        ]
    ),
)


def apply_chat_template(tito: TitoTokenizer, messages, tools, add_generation_prompt: bool) -> str:
    return tito.tokenizer.apply_chat_template(
        template_view(messages),
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        chat_template=tito.chat_template,
        **tito.template_kwargs({}),
    )


@pytest.fixture(scope="module", params=["default", "qwen3"])
def family(request, tiny_model_dir) -> TitoTokenizer:
    return TitoTokenizer.from_model_path(tiny_model_dir, request.param)


@settings(max_examples=150, derandomize=True, database=None, deadline=None)
@given(messages=CONVERSATION, tools=TOOLS, add_generation_prompt=st.booleans())
def test_render_is_apply_chat_template(family, messages, tools, add_generation_prompt):
    try:
        expected = apply_chat_template(family, messages, tools, add_generation_prompt)
    except Exception as error:  # the template cannot render it (None content on ChatML): neither can render
        with pytest.raises(MessageValidationError):
            family.render(messages, tools=tools, add_generation_prompt=add_generation_prompt, template_kwargs={})
        assert type(error).__name__ in {"TypeError", "TemplateError", "UndefinedError", "ValueError", "KeyError"}
        return
    assert (
        family.render(messages, tools=tools, add_generation_prompt=add_generation_prompt, template_kwargs={})
        == expected
    )


def test_the_template_sees_the_tokenizers_special_tokens_and_no_none_valued_field(tiny_model_dir):
    tito = TitoTokenizer.from_model_path(tiny_model_dir)
    tito.tokenizer.chat_template = "{{ eos_token }}{% for m in messages %}{{ 'reasoning_content' in m }}{% endfor %}"
    messages = [{"role": "assistant", "content": "hi", "reasoning_content": None}]
    rendered = tito.render(messages, tools=None, add_generation_prompt=False, template_kwargs={})
    assert rendered == "<|im_end|>False" == apply_chat_template(tito, messages, None, False)


def test_an_empty_conversation_is_a_validation_error(tiny_model_dir):
    with pytest.raises(MessageValidationError, match="empty conversation"):
        TitoTokenizer.from_model_path(tiny_model_dir).render(
            [], tools=None, add_generation_prompt=True, template_kwargs={}
        )


def test_a_template_kwarg_naming_a_parameter_of_apply_chat_template_acts_as_that_parameter(tito):
    # SGLang passes chat_template_kwargs on to apply_chat_template, whose own parameters they then set.
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer"}]
    rendered = tito.render(
        messages, tools=None, add_generation_prompt=False, template_kwargs={"continue_final_message": True}
    )
    assert rendered.endswith("assistant\nThe answer")
    assert rendered == tito.tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
