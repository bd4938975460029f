"""The session server's logic, free of HTTP: sessions, one turn in three phases, metadata and samples.

A turn is: (1) under the session lock, plan it (rollback, TITO ids, R3 offset); (2) without the lock, call
the engine; (3) under the lock again, commit it unless the session closed or (v1) another turn won.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from miles_runner.engine.chat_as_generate import chat_completion, generate_body
from miles_runner.engine.client import EngineUnavailable
from miles_runner.session.codec import encode_samples
from miles_runner.session.config import AdapterSlot, SessionServerConfig
from miles_runner.session.errors import SessionNotFoundError, UpstreamResponseError
from miles_runner.session.linear import LinearTrajectory, LinearTurnPlan
from miles_runner.session.messages import normalize_messages, resolve_matcher
from miles_runner.session.r3 import addition_r3_start_len
from miles_runner.session.records import SessionRecord
from miles_runner.session.request import extract_completion, prepare_chat_request
from miles_runner.session.samples import AssemblyOptions, build_sample
from miles_runner.session.tito import TitoTokenizer
from miles_runner.session.tree import TreeTrajectory, TreeTurnPlan
from miles_runner.session.tree_samples import build_leaf_samples, drop_retries, postprocess
from miles_runner.session.upstream import SessionUpstream

CHAT_PATH = "/v1/chat/completions"


@dataclass
class Session:
    session_id: str
    state: LinearTrajectory | TreeTrajectory
    adapter: AdapterSlot | None = None
    closing: bool = False
    # Guards the state; never held across the engine call, so a slow turn does not block GET or DELETE.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass(frozen=True)
class ChatResult:
    response: dict[str, Any]
    stream: bool
    committed: bool


class SessionCore:
    def __init__(
        self,
        config: SessionServerConfig,
        tito: TitoTokenizer,
        upstream: SessionUpstream,
        num_layers: int,
        sampling_defaults: dict[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.tito = tito
        self.upstream = upstream
        self.num_layers = num_layers
        self.sampling_defaults = sampling_defaults or {}  # the model's generation_config values chat falls back to
        self.sessions: dict[str, Session] = {}
        self.matcher = resolve_matcher(config.message_matcher)

    # ---- lifecycle -----------------------------------------------------------------------------------

    def create(self, adapter: AdapterSlot | None = None) -> Session:
        trajectory = TreeTrajectory if self.config.version == "v2" else LinearTrajectory
        state = trajectory(matcher=self.matcher)
        session = Session(uuid.uuid4().hex, state, adapter)
        self.sessions[session.session_id] = session
        return session

    def get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None or session.closing:
            raise SessionNotFoundError(f"session {session_id} not found")
        return session

    async def delete(self, session_id: str) -> None:
        session = self.get(session_id)
        session.closing = True
        async with session.lock:  # a phase in progress finishes first
            self.sessions.pop(session_id, None)
            self.upstream.release(session_id)

    # ---- one turn ------------------------------------------------------------------------------------

    async def chat_completions(self, session_id: str, body: dict[str, Any]) -> ChatResult:
        """Raises SessionError, or EngineError for a non-2xx engine reply (passed through unrecorded)."""
        session = self.get(session_id)
        async with session.lock:
            if session.closing:
                raise SessionNotFoundError(f"session {session_id} not found")
            request, stream, plan = self._plan_turn(session, body)
        requested_at = time.time()
        response = await self._generate(session_id, request)
        completion_ids, assistant = extract_completion(response)
        record = SessionRecord(time.time(), requested_at, "POST", CHAT_PATH, request, response, 200)
        async with session.lock:
            committed = not session.closing and session.state.commit(
                plan, completion_ids, assistant, record, self.config.max_trim_tokens
            )
        return ChatResult(response, stream, committed)

    async def _generate(self, session_id: str, chat: dict[str, Any]) -> dict[str, Any]:
        """The turn's chat reply (recorded with `chat` as the turn's request)."""
        wire = generate_body(chat, model_defaults=self.sampling_defaults)
        try:
            # Native /generate straight to the session's pinned worker, not chat through the router: sglang-router
            # 0.3.2 rebuilds request bodies and drops input_ids, return_meta_info, R3, rid and extra_key
            # (upstream.py); SGLang itself builds its chat reply from this same native result.
            native = await self.upstream.generate(session_id, wire)
        except EngineUnavailable as error:
            raise UpstreamResponseError(f"backend transport error: {error}") from error
        if not isinstance(native, dict) or not isinstance(native.get("meta_info"), dict):
            raise UpstreamResponseError(f"the /generate reply is not one result with meta_info: {native!r:.200}")
        return chat_completion([native], model=chat.get("model", "default"), logprobs=True, return_meta_info=True)

    def _plan_turn(
        self, session: Session, body: dict[str, Any]
    ) -> tuple[dict[str, Any], bool, LinearTurnPlan | TreeTurnPlan]:
        upstream, stream = prepare_chat_request(body, self.config, session.adapter)
        messages = normalize_messages(upstream.get("messages"))
        tools = upstream.get("tools")
        template_kwargs = upstream.get("chat_template_kwargs") or {}
        plan = session.state.plan_turn(messages, tools, template_kwargs, self.tito)
        upstream["input_ids"] = plan.prompt_ids
        if self.config.use_addition_r3 and upstream.get("return_routed_experts"):
            upstream["routed_experts_start_len"] = addition_r3_start_len(plan.checkpoint_ids, plan.prompt_ids)
        return upstream, stream, plan

    # ---- metadata and samples --------------------------------------------------------------------------

    def describe(self, session: Session) -> dict[str, Any]:
        return {
            "session_id": session.session_id,
            "records": [record.to_dict() for record in session.state.records],
            "metadata": self.metadata(session),
        }

    def metadata(self, session: Session) -> dict[str, Any]:
        """Shared by GET /sessions/{id} and /samples."""
        state = session.state
        metadata: dict[str, Any] = {
            "accumulated_token_ids": state.token_ids,
            "max_trim_tokens": self.config.max_trim_tokens,
        }
        mismatch = self._mismatch(state)
        if mismatch is not None:
            metadata["tito_session_mismatch"] = [mismatch]
        if isinstance(state, TreeTrajectory):
            metadata["tree"] = state.describe()
        return metadata

    def _mismatch(self, state: LinearTrajectory | TreeTrajectory) -> dict[str, int] | None:
        if isinstance(state, TreeTrajectory):
            if state.active_leaf is None:
                return None
            node = state.nodes[state.active_leaf]
            messages, record = node.path_messages, node.record
        else:
            if not state.records:
                return None
            messages, record = state.messages, state.records[-1]
        template_kwargs = record.request.get("chat_template_kwargs") or {}
        return self.tito.mismatch(messages, state.token_ids, record.request.get("tools"), template_kwargs)

    def collect_samples(self, session: Session, max_seq_len: int | None, agent_metadata: dict[str, Any]) -> bytes:
        """The safetensors reply of /samples; a ValueError means the records cannot make a sample (422)."""
        options = AssemblyOptions(
            max_trim_tokens=self.config.max_trim_tokens,
            use_addition_r3=self.config.use_addition_r3,
            num_layers=self.num_layers,
            max_seq_len=max_seq_len,
        )
        metadata = self.metadata(session)
        state = session.state
        if isinstance(state, TreeTrajectory):
            leaves, empty_reason = build_leaf_samples(state, options, self.tito.decode)
            samples = postprocess(drop_retries(leaves), agent_metadata)
            metadata["agent"] = agent_metadata
            return encode_samples(samples, metadata, empty_reason, with_reward=True)
        sample, empty_reason = build_sample(state.records, state.token_ids, options, self.tito.decode)
        return encode_samples([sample] if sample else [], metadata, empty_reason)
