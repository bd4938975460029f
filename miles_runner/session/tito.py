"""Token-in/token-out: turn chat messages into the token ids the session sends, reusing what it stored.

The stored ids (prompt + what the model generated) always win: a later turn appends only the tokens of the
new suffix, so the engine sees exactly the sequence the policy produced, not a re-tokenization of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from miles_runner.session.errors import MessageValidationError
from miles_runner.session.messages import Message

# Roles an agent may append after a generated assistant turn (observations and instructions, never
# assistant text the policy did not generate).
ALLOWED_APPEND_ROLES = frozenset({"user", "tool", "system"})
_SENTINEL = "\x00miles-session-sentinel\x00"


class TitoTokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def from_model_path(cls, model_path: str | Path) -> TitoTokenizer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(model_path)))

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: list[dict] | None,
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any],
    ) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                list(messages),
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **template_kwargs,
            )
        except (TemplateError, TypeError, ValueError, KeyError) as error:
            # A template that cannot render the request is the request's problem (a 400), not a crash.
            raise MessageValidationError(f"the chat template cannot render the messages: {error}") from error

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def first_turn_ids(
        self, messages: Sequence[Message], tools: list[dict] | None, template_kwargs: dict[str, Any]
    ) -> list[int]:
        text = self.render(messages, tools=tools, add_generation_prompt=True, template_kwargs=template_kwargs)
        return self.encode(text)

    def merge_tokens(
        self,
        stored_messages: Sequence[Message],
        stored_ids: Sequence[int],
        appended: Sequence[Message],
        tools: list[dict] | None,
        template_kwargs: dict[str, Any],
    ) -> list[int]:
        """`stored_ids` + the tokens of what `appended` adds to the rendered conversation.

        `stored_messages` ends with the generated assistant turn whose tokens end `stored_ids`; the engine
        may or may not have emitted the template's turn-closing tokens (a stop versus a length cut), so the
        part of the closing text it did not emit is prepended to the new suffix.
        """
        check_append_roles(appended)
        old_text = self.render(
            stored_messages, tools=tools, add_generation_prompt=False, template_kwargs=template_kwargs
        )
        new_text = self.render(
            [*stored_messages, *appended],
            tools=tools,
            add_generation_prompt=True,
            template_kwargs=template_kwargs,
        )
        if not new_text.startswith(old_text):
            raise MessageValidationError(
                "the chat template does not render the new messages as an append-only extension of the "
                "stored conversation (did `tools` or `chat_template_kwargs` change between turns?)"
            )
        glue = self._missing_turn_close(stored_messages, stored_ids, tools, template_kwargs)
        return [*stored_ids, *self.encode(glue + new_text[len(old_text) :])]

    def _missing_turn_close(
        self,
        stored_messages: Sequence[Message],
        stored_ids: Sequence[int],
        tools: list[dict] | None,
        template_kwargs: dict[str, Any],
    ) -> str:
        close_text = self._assistant_close_text(stored_messages[:-1], tools, template_kwargs)
        close_ids = self.encode(close_text)
        emitted = _longest_emitted_prefix(stored_ids, close_ids)
        return close_text[len(self.decode(close_ids[:emitted])) :]

    def _assistant_close_text(
        self, history: Sequence[Message], tools: list[dict] | None, template_kwargs: dict[str, Any]
    ) -> str:
        """Text the template writes after an assistant message's content (ChatML: `<|im_end|>\\n`)."""
        probe = [*history, {"role": "assistant", "content": _SENTINEL}]
        text = self.render(probe, tools=tools, add_generation_prompt=False, template_kwargs=template_kwargs)
        return text[text.rindex(_SENTINEL) + len(_SENTINEL) :]

    def mismatch(
        self,
        messages: Sequence[Message],
        accumulated_ids: Sequence[int],
        tools: list[dict] | None,
        template_kwargs: dict[str, Any],
    ) -> dict[str, int] | None:
        """Where the canonical tokenization of the conversation first differs from the accumulated ids."""
        text = self.render(messages, tools=tools, add_generation_prompt=False, template_kwargs=template_kwargs)
        canonical = self.encode(text)
        for position, (ours, theirs) in enumerate(zip(accumulated_ids, canonical, strict=False)):
            if ours != theirs:
                return {
                    "position": position,
                    "accumulated_token": ours,
                    "canonical_token": theirs,
                    "num_accumulated": len(accumulated_ids),
                    "num_canonical": len(canonical),
                }
        return None


def check_append_roles(appended: Sequence[Message]) -> None:
    for message in appended:
        if message["role"] not in ALLOWED_APPEND_ROLES:
            raise MessageValidationError(
                f"role {message['role']!r} cannot be appended after a generated turn; "
                f"allowed: {sorted(ALLOWED_APPEND_ROLES)}"
            )


def _longest_emitted_prefix(stored_ids: Sequence[int], close_ids: Sequence[int]) -> int:
    """Largest j such that `stored_ids` ends with `close_ids[:j]`."""
    for j in range(min(len(close_ids), len(stored_ids)), 0, -1):
        if list(stored_ids[-j:]) == list(close_ids[:j]):
            return j
    return 0


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return min(len(a), len(b))
