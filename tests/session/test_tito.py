import pytest

from miles_runner.session.errors import MessageValidationError

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
USER_1 = {"role": "user", "content": "What is 3 plus 4?"}
ANSWER = {"role": "assistant", "content": "The answer is 7."}
USER_2 = {"role": "user", "content": "Thank you!"}


def im_end(tito) -> int:
    return tito.tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_first_turn_renders_the_chat_template_with_a_generation_prompt(tito):
    ids = tito.first_turn_ids([SYSTEM, USER_1], None, {})
    assert tito.decode(ids).endswith("What is 3 plus 4?<|im_end|>\n<|im_start|>assistant\n")


def test_merge_after_a_stop_matches_rendering_the_whole_conversation(tito):
    prompt = tito.first_turn_ids([SYSTEM, USER_1], None, {})
    stored = [*prompt, *tito.encode("The answer is 7."), im_end(tito)]
    merged = tito.merge_tokens([SYSTEM, USER_1, ANSWER], stored, [USER_2], None, {})
    assert merged == tito.first_turn_ids([SYSTEM, USER_1, ANSWER, USER_2], None, {})


def test_merge_keeps_the_stored_spelling_of_generated_tokens(tito):
    prompt = tito.first_turn_ids([SYSTEM, USER_1], None, {})
    # The model spelled its answer one character per token, not as the tokenizer would.
    spelled = [tito.encode(ch)[0] for ch in "The answer is 7."]
    stored = [*prompt, *spelled, im_end(tito)]
    merged = tito.merge_tokens([SYSTEM, USER_1, ANSWER], stored, [USER_2], None, {})
    assert merged[: len(stored)] == stored
    assert tito.decode(merged[len(stored) :]) == "\n<|im_start|>user\nThank you!<|im_end|>\n<|im_start|>assistant\n"


def test_merge_after_a_length_cut_closes_the_assistant_turn(tito):
    prompt = tito.first_turn_ids([SYSTEM, USER_1], None, {})
    stored = [*prompt, *tito.encode("The answer")]
    cut = {"role": "assistant", "content": "The answer"}
    merged = tito.merge_tokens([SYSTEM, USER_1, cut], stored, [USER_2], None, {})
    assert tito.decode(merged[len(stored) :]).startswith("<|im_end|>\n<|im_start|>user\n")


def test_an_assistant_message_cannot_be_appended(tito):
    prompt = tito.first_turn_ids([SYSTEM, USER_1], None, {})
    with pytest.raises(MessageValidationError, match="role 'assistant' cannot be appended"):
        tito.merge_tokens([SYSTEM, USER_1, ANSWER], prompt, [USER_2, ANSWER], None, {})


def test_a_canonical_conversation_has_no_mismatch(tito):
    ids = tito.first_turn_ids([SYSTEM, USER_1], None, {})
    assert tito.mismatch([SYSTEM, USER_1], ids[:-3], None, {}) is None


def test_a_non_canonical_spelling_is_reported_as_a_mismatch(tito):
    prompt = tito.first_turn_ids([SYSTEM, USER_1], None, {})
    spelled = [tito.encode(ch)[0] for ch in "The answer is 7."]
    mismatch = tito.mismatch([SYSTEM, USER_1, ANSWER], [*prompt, *spelled], None, {})
    assert mismatch["position"] == len(prompt)


def test_template_kwargs_the_template_cannot_take_are_a_validation_error(tito):
    with pytest.raises(MessageValidationError, match="cannot render"):
        tito.first_turn_ids([SYSTEM, USER_1], None, {"tokenize": True})


TEXTS = [
    "",
    "<|im_end|>\n",
    "<|im_start|>user\nWhat is 3 plus 4?<|im_end|>\n<|im_start|>assistant\n",
    "plain words, digits 12345 and  two spaces",
    "unicode: héllo wörld – ünïcödé ✓ 数字",
    "<|im_end|><|im_start|><|endoftext|> back to back",
    "\x00miles-session-sentinel\x00 control bytes\t\r\n",
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_gives_what_the_tokenizers_own_encode_gives(tito, text):
    assert tito.encode(text) == tito.tokenizer.encode(text, add_special_tokens=False)


def test_encode_goes_through_the_wrapper_when_the_backend_would_truncate(tiny_model_dir):
    """The bare Rust encode is used only while nothing the wrapper resets is set on it: a backend left
    truncating (by a call with truncation=True) must not cut a prompt short."""
    from transformers import AutoTokenizer

    from miles_runner.session.tito import TitoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tito = TitoTokenizer(tokenizer)
    text = TEXTS[2]
    full = tito.encode(text)
    tokenizer.backend_tokenizer.enable_truncation(max_length=3)
    assert tito.encode(text) == full
    assert len(full) > 3
