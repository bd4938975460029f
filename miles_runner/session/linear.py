"""v1 session state: one linear trajectory, one checkpoint per generated turn, a one-turn rollback."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from miles_runner.session.errors import MessageValidationError, TokenizationError
from miles_runner.session.messages import Matcher, Message, matching_prefix_len, strict_matches
from miles_runner.session.records import SessionRecord
from miles_runner.session.tito import TitoTokenizer, common_prefix_len

MAX_ASSISTANT_ROLLBACK_STEPS = 1


@dataclass(frozen=True)
class LinearTurnPlan:
    """Decided under the lock before the upstream call; applied only if nothing committed meanwhile."""

    base_index: int  # checkpoint the request builds on, -1 for none
    request_messages: list[Message]
    prompt_ids: list[int]
    checkpoint_ids: list[int]
    commit_count: int


@dataclass
class LinearTrajectory:
    messages: list[Message] = field(default_factory=list)
    records: list[SessionRecord] = field(default_factory=list)
    checkpoints: list[list[int]] = field(default_factory=list)
    checkpoint_message_ends: list[int] = field(default_factory=list)
    # Bumped by every commit: a plan made against an older state must not be applied (the v1 guard).
    commit_count: int = 0
    # Whether a replayed message is the stored one (session.message_matcher); the stored one is kept.
    matcher: Matcher = strict_matches

    @property
    def token_ids(self) -> list[int]:
        return self.checkpoints[-1] if self.checkpoints else []

    @property
    def num_assistant(self) -> int:
        return len(self.checkpoints)

    def plan_turn(
        self,
        request_messages: list[Message],
        tools: list[dict] | None,
        template_kwargs: dict[str, Any],
        tito: TitoTokenizer,
    ) -> LinearTurnPlan:
        base = self._base_checkpoint(request_messages)
        if base < 0:
            prompt_ids = tito.first_turn_ids(request_messages, tools, template_kwargs)
            checkpoint: list[int] = []
        else:
            end = self.checkpoint_message_ends[base]
            checkpoint = self.checkpoints[base]
            prompt_ids = tito.merge_tokens(
                self.messages[:end], checkpoint, request_messages[end:], tools, template_kwargs
            )
        return LinearTurnPlan(base, request_messages, prompt_ids, checkpoint, self.commit_count)

    def _base_checkpoint(self, request_messages: list[Message]) -> int:
        match_len = matching_prefix_len(self.messages, request_messages, self.matcher)
        if match_len == len(self.messages):
            return self.num_assistant - 1
        base = max((i for i, end in enumerate(self.checkpoint_message_ends) if end <= match_len), default=-1)
        discarded = self.num_assistant - (base + 1)
        if discarded > MAX_ASSISTANT_ROLLBACK_STEPS:
            raise MessageValidationError(
                f"the request diverges from the stored conversation at message {match_len}, which would "
                f"discard {discarded} generated turns; a v1 session rolls back at most "
                f"{MAX_ASSISTANT_ROLLBACK_STEPS} (use session=v2 for branching)"
            )
        return base

    def commit(
        self,
        plan: LinearTurnPlan,
        completion_ids: list[int],
        assistant: Message,
        record: SessionRecord,
        max_trim_tokens: int,
    ) -> bool:
        """Apply a finished turn; False (state untouched) if another turn committed since the plan."""
        if plan.commit_count != self.commit_count:
            return False
        full_ids = [*plan.prompt_ids, *completion_ids]
        check_checkpoint_prefix(plan.checkpoint_ids, full_ids, max_trim_tokens)
        kept = plan.base_index + 1
        stored_end = self.checkpoint_message_ends[plan.base_index] if kept else 0
        self.messages = [*self.messages[:stored_end], *plan.request_messages[stored_end:], assistant]
        self.checkpoints = [*self.checkpoints[:kept], full_ids]
        self.checkpoint_message_ends = [*self.checkpoint_message_ends[:kept], len(plan.request_messages) + 1]
        self.records = [*self.records[:kept], record]
        self.commit_count += 1
        return True


def check_checkpoint_prefix(checkpoint: list[int], full_ids: list[int], max_trim_tokens: int) -> None:
    matched = common_prefix_len(checkpoint, full_ids)
    if matched < len(checkpoint) - max_trim_tokens:
        raise TokenizationError(
            f"the stored checkpoint ({len(checkpoint)} tokens) is not a prefix of prompt+completion: they "
            f"differ at token {matched}, more than max_trim_tokens={max_trim_tokens} from its end"
        )
