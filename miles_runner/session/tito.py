"""Token-in/token-out: turn chat messages into the token ids the session sends, reusing what it stored.

The stored ids (prompt + what the model generated) always win: a later turn appends only the tokens of the
new suffix, so the engine sees exactly the sequence the policy produced, not a re-tokenization of it.

A TITO family (`session.tito_model`, miles' TITOTokenizer subclasses) fixes how that suffix is made:
- `default`: the model's own chat template; the suffix is the text the template adds after the stored turns,
  preceded by whatever part of the assistant turn's closing text the engine did not emit.
- `qwen3`: miles' fixed Qwen3 template (templates/qwen3_fixed.jinja, with clear_thinking=false so past reasoning
  renders append-only); the suffix is rendered after a dummy system + assistant prefix, and a stored turn that
  ends with <|im_end|> gets the newline the model does not generate.
- `glm47`: GLM-4.7's own template with clear_thinking=false; <|user|> and <|observation|> both stop a turn and
  open the next message, so a stored turn ending with one loses it (the suffix opens the next message).
A family pins its template kwargs (a request asking for another value is a 400) and needs its special tokens in
the model's tokenizer (else the server does not start).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

from jinja2 import TemplateError
from transformers.utils.chat_template_utils import render_jinja_template

from miles_runner.core.tito_families import TITO_FAMILIES, TitoFamily, tito_family
from miles_runner.session.errors import MessageValidationError
from miles_runner.session.messages import Message, template_view

# Roles an agent may append after a generated assistant turn under the default family (observations and
# instructions, never assistant text the policy did not generate). The named families allow assistant too.
ALLOWED_APPEND_ROLES = frozenset({"user", "tool", "system"})
ALL_APPEND_ROLES = frozenset({"user", "tool", "system", "assistant"})
TEMPLATES = Path(__file__).with_name("templates")
_SENTINEL = "\x00miles-session-sentinel\x00"
_DUMMY_SYSTEM: Message = {"role": "system", "content": "dummy system"}


class TitoTokenizer:
    """The `default` family; the named families below change the template, kwargs, roles and the merge."""

    spec: ClassVar[TitoFamily] = TITO_FAMILIES["default"]

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._encode = prompt_encoder(tokenizer)
        missing = [t for t in self.spec.required_tokens if t not in tokenizer.get_vocab()]
        if missing:
            raise ValueError(
                f"tito_model {self.family} needs the tokens {missing}, which this model's tokenizer does not have; "
                "use the family of this model, or tito_model=default"
            )
        template = self.spec.template_file
        self.chat_template = (TEMPLATES / template).read_text() if template else None  # None: the model's own
        self.allowed_append_roles = ALL_APPEND_ROLES if self.spec.append_assistant else ALLOWED_APPEND_ROLES
        self._own_parameters = frozenset(inspect.signature(tokenizer.apply_chat_template).parameters) - {"kwargs"}

    @classmethod
    def from_model_path(cls, model_path: str | Path, family: str = "default") -> TitoTokenizer:
        from transformers import AutoTokenizer

        return FAMILY_CLASSES[tito_family(family).name](AutoTokenizer.from_pretrained(str(model_path)))

    @property
    def family(self) -> str:
        return self.spec.name

    def template_kwargs(self, request_kwargs: dict[str, Any]) -> dict[str, Any]:
        """The request's chat_template_kwargs with the family's pinned ones (a different value is a 400)."""
        for key, value in self.spec.pinned_kwargs.items():
            if key in request_kwargs and request_kwargs[key] != value:
                raise MessageValidationError(
                    f"chat_template_kwargs {key}={request_kwargs[key]!r} conflicts with tito_model "
                    f"{self.family}, which renders with {key}={value!r}"
                )
        return {**request_kwargs, **self.spec.pinned_kwargs}

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: list[dict] | None,
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any],
    ) -> str:
        """`tokenizer.apply_chat_template(messages, tokenize=False, ...)`, as SGLang renders a chat request."""
        kwargs = self.template_kwargs(template_kwargs)
        try:
            if kwargs.keys() & self._own_parameters:  # e.g. tokenize, documents: SGLang passes them on to the method
                return self.tokenizer.apply_chat_template(
                    template_view(messages),
                    tools=tools,
                    add_generation_prompt=add_generation_prompt,
                    tokenize=False,
                    chat_template=self.chat_template,
                    **kwargs,
                )
            return self._render_plain(messages, tools, add_generation_prompt, kwargs)
        except (TemplateError, TypeError, ValueError, KeyError) as error:
            # A template that cannot render the request is the request's problem (a 400), not a crash.
            raise MessageValidationError(f"the chat template cannot render the messages: {error}") from error

    def _render_plain(
        self, messages: Sequence[Message], tools: list[dict] | None, add_generation_prompt: bool, kwargs: dict[str, Any]
    ) -> str:
        """apply_chat_template less its first pass, which turns message objects into dicts and drops None-valued keys:
        ours are plain JSON already (messages.py), and that walk is a large part of a render, three of which a turn
        makes (merge_tokens). What the template sees still goes through render_jinja_template's sanitising copy; the two
        are held equal by tests/session/test_tito_render.py."""
        conversation = [{key: value for key, value in m.items() if value is not None} for m in template_view(messages)]
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation.")
        [text], _ = render_jinja_template(
            [conversation],
            tools=tools,
            chat_template=self.tokenizer.get_chat_template(self.chat_template, tools),
            add_generation_prompt=add_generation_prompt,
            **{**self.tokenizer.special_tokens_map, **kwargs},
        )
        return text

    def encode(self, text: str) -> list[int]:
        """`tokenizer.encode(text, add_special_tokens=False)`, as SGLang tokenizes a prompt."""
        return self._encode(text)

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
        check_append_roles(appended, self.allowed_append_roles)
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


def prompt_encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    """`tokenizer.encode(text, add_special_tokens=False)`, on the Rust tokenizer alone where it has one and nothing
    is set on it that transformers' wrapper would reset first (truncation, padding, how special tokens split).
    Why: the wrapper costs more than encoding a turn's suffix; a session turn encodes twice, each time on caches
    gone cold while the engine generated."""
    backend = getattr(tokenizer, "backend_tokenizer", None)

    def encode(text: str) -> list[int]:
        if backend is None or _wrapper_would_reset(tokenizer, backend):
            return tokenizer.encode(text, add_special_tokens=False)
        return backend.encode(text, add_special_tokens=False).ids

    return encode


def _wrapper_would_reset(tokenizer: Any, backend: Any) -> bool:
    split_special = bool(getattr(tokenizer, "split_special_tokens", False))
    return bool(backend.truncation or backend.padding) or backend.encode_special_tokens != split_special


class FixedTemplateFamily(TitoTokenizer):
    """miles' named-family merge: the appended messages (and the next generation prompt) are rendered after a
    dummy system + assistant prefix, so the stored turns are never re-rendered; `join` handles the boundary."""

    def merge_tokens(
        self,
        stored_messages: Sequence[Message],
        stored_ids: Sequence[int],
        appended: Sequence[Message],
        tools: list[dict] | None,
        template_kwargs: dict[str, Any],
    ) -> list[int]:
        check_append_roles(appended, self.allowed_append_roles)
        dummy_assistant = {
            "role": "assistant",
            "content": "",
            "reasoning_content": " ",
            "tool_calls": stored_messages[-1].get("tool_calls") or [],
        }
        prefix = [_DUMMY_SYSTEM, dummy_assistant]
        without = self.render(prefix, tools=tools, add_generation_prompt=False, template_kwargs=template_kwargs)
        with_appended = self.render(
            [*prefix, *appended], tools=tools, add_generation_prompt=True, template_kwargs=template_kwargs
        )
        if not with_appended.startswith(without):
            raise MessageValidationError(
                f"tito_model {self.family} cannot render the appended roles {[m['role'] for m in appended]} "
                "as an extension of the conversation"
            )
        return self.join(list(stored_ids), self.encode(with_appended[len(without) :]))

    def join(self, stored_ids: list[int], suffix_ids: list[int]) -> list[int]:
        return stored_ids + suffix_ids

    def token_id(self, token: str) -> int:
        return self.tokenizer.convert_tokens_to_ids(token)


class Qwen3Tito(FixedTemplateFamily):
    spec = TITO_FAMILIES["qwen3"]

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        newline = self.encode("\n")
        if len(newline) != 1:
            raise ValueError(f"tito_model qwen3 needs a one-token newline; this tokenizer spells it {newline}")
        self.newline_id, self.im_end_id = newline[0], self.token_id("<|im_end|>")

    def join(self, stored_ids: list[int], suffix_ids: list[int]) -> list[int]:
        # The template writes "<|im_end|>\n" after every message; the model stops at <|im_end|>.
        if stored_ids and stored_ids[-1] == self.im_end_id:
            stored_ids = [*stored_ids, self.newline_id]
        return stored_ids + suffix_ids


class Glm47Tito(FixedTemplateFamily):
    spec = TITO_FAMILIES["glm47"]

    def join(self, stored_ids: list[int], suffix_ids: list[int]) -> list[int]:
        # <|user|> and <|observation|> end a generated turn and open the next message, which the suffix opens.
        if stored_ids and stored_ids[-1] in (self.token_id("<|user|>"), self.token_id("<|observation|>")):
            stored_ids = stored_ids[:-1]
        return stored_ids + suffix_ids


FAMILY_CLASSES: dict[str, type[TitoTokenizer]] = {c.spec.name: c for c in (TitoTokenizer, Qwen3Tito, Glm47Tito)}


def check_append_roles(appended: Sequence[Message], allowed: frozenset[str] = ALLOWED_APPEND_ROLES) -> None:
    for message in appended:
        if message["role"] not in allowed:
            raise MessageValidationError(
                f"role {message['role']!r} cannot be appended after a generated turn; allowed: {sorted(allowed)}"
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
