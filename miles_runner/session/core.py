"""The session server's logic, free of HTTP: sessions, one turn in three phases, metadata and samples.

A turn is: (1) under the session lock, plan it (rollback, TITO ids, R3 offset); (2) without the lock, call
the engine; (3) under the lock again, commit it unless the session closed. A v1 session takes one turn at a
time (a second one while a turn is in flight is a 409: it could only replace the other); v2 turns run
concurrently and all become nodes of the tree.

Limits: at most `max_sessions` open sessions (429 beyond); a session older than `max_age_s` is gone (404),
its in-flight turns aborted and its engine pin released. DELETE, expiry and shutdown abort a session's
in-flight turns on its engine by their rids (request.py gives every turn one).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from miles_runner.session.codec import encode_samples
from miles_runner.session.config import AdapterSlot, SessionServerConfig
from miles_runner.session.errors import (
    SessionNotFoundError,
    ShuttingDownError,
    TooManySessionsError,
    TurnInProgressError,
    UpstreamResponseError,
)
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
from miles_runner.sglang_client.chat_as_generate import chat_completion, generate_body
from miles_runner.sglang_client.client import EngineError, EngineUnavailable

CHAT_PATH = "/v1/chat/completions"
ABORT_WINDOW_S, ABORT_RETRY_S = 3.0, 0.2
log = logging.getLogger(__name__)


@dataclass
class Session:
    session_id: str
    state: LinearTrajectory | TreeTrajectory
    adapter: AdapterSlot | None = None
    closing: bool = False
    created_at: float = field(default_factory=time.monotonic)
    # The rids of the turns being generated (v1: at most one): what DELETE, expiry and shutdown abort.
    in_flight: set[str] = field(default_factory=set)
    # Guards the state; never held across the engine call, so a slow turn does not block GET or DELETE.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass(frozen=True)
class ChatResult:
    response: dict[str, Any]
    stream: bool


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
        self.stopping = False

    # ---- lifecycle -----------------------------------------------------------------------------------

    async def create(self, adapter: AdapterSlot | None = None) -> Session:
        if self.stopping:
            raise ShuttingDownError("the session server is shutting down")
        await self.expire_old_sessions()
        if len(self.sessions) >= self.config.max_sessions:
            raise TooManySessionsError(
                f"the session server already holds {len(self.sessions)} open sessions "
                f"(session.max_sessions={self.config.max_sessions}); delete finished sessions or raise "
                "session.max_sessions"
            )
        trajectory = TreeTrajectory if self.config.version == "v2" else LinearTrajectory
        session = Session(uuid.uuid4().hex, trajectory(matcher=self.matcher), adapter)
        self.sessions[session.session_id] = session
        return session

    def get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None or session.closing or self._expired(session):
            raise SessionNotFoundError(f"session {session_id} not found")
        return session

    async def delete(self, session_id: str) -> None:
        await self._close(self.get(session_id))

    async def expire_old_sessions(self) -> None:
        """Close every session older than max_age_s (their GETs already answer 404): frees what they hold."""
        for session in [s for s in self.sessions.values() if self._expired(s) and not s.closing]:
            log.info("session %s expired after session.max_age_s=%g s", session.session_id, self.config.max_age_s)
            await self._close(session)

    async def shutdown(self) -> None:
        """Refuse new sessions and turns, and abort every in-flight turn so its request ends now."""
        self.stopping = True
        await asyncio.gather(*(self._abort_turns(s) for s in list(self.sessions.values())))

    def _expired(self, session: Session) -> bool:
        return time.monotonic() - session.created_at > self.config.max_age_s

    async def _close(self, session: Session) -> None:
        session.closing = True
        await self._abort_turns(session)
        async with session.lock:  # a phase in progress finishes first
            self.sessions.pop(session.session_id, None)
            self.upstream.release(session.session_id)

    async def _abort_turns(self, session: Session) -> None:
        """abort_request on the session's engine for each in-flight turn: the engine ends it (finish_reason
        abort) and the turn answers 404/503 instead of waiting for its generation to finish. Repeated while a
        turn is still in flight (an abort that reaches the engine before the turn does is a no-op), for at most
        ABORT_WINDOW_S: a hung engine cannot hold DELETE or shutdown; its turn then ends by its own timeout."""
        try:
            async with asyncio.timeout(ABORT_WINDOW_S):
                while session.in_flight:
                    for rid in list(session.in_flight):
                        await self._abort_turn(session.session_id, rid)
                    await asyncio.sleep(ABORT_RETRY_S)
        except TimeoutError:
            log.warning("session %s: turns %s still in flight after abort", session.session_id, session.in_flight)

    async def _abort_turn(self, session_id: str, rid: str) -> None:
        try:
            await (await self.upstream.engine(session_id)).abort_request(rid)
        except (EngineError, EngineUnavailable) as error:
            log.warning("could not abort turn %s of session %s: %s", rid, session_id, error)

    # ---- one turn ------------------------------------------------------------------------------------

    async def chat_completions(self, session_id: str, body: dict[str, Any]) -> ChatResult:
        """Raises SessionError, or EngineError for a non-2xx engine reply (passed through unrecorded)."""
        session = self.get(session_id)
        async with session.lock:
            self._check_open(session)
            if session.in_flight and isinstance(session.state, LinearTrajectory):
                raise TurnInProgressError(
                    f"session {session_id} already has a turn in flight; a v1 session is one conversation and "
                    "takes one turn at a time (wait for the reply, or use session.version=v2 for branches)"
                )
            request, stream, plan = self._plan_turn(session, body)
            session.in_flight.add(request["rid"])
        try:
            requested_at = time.time()
            response = await self._generate(session_id, request)
            completion_ids, assistant = extract_completion(response)
            record = SessionRecord(time.time(), requested_at, "POST", CHAT_PATH, request, response, 200)
            async with session.lock:
                self._check_open(session)  # closed meanwhile: the turn was aborted and is not recorded
                committed = session.state.commit(
                    plan,  # type: ignore[arg-type]  # the plan this trajectory made (_plan_turn), of its kind
                    completion_ids,
                    assistant,
                    record,
                    self.config.max_trim_tokens,
                )
        finally:
            session.in_flight.discard(request["rid"])
        if not committed:  # cannot happen while v1 turns are exclusive; never answer 200 for a lost turn
            raise TurnInProgressError(f"session {session_id} changed during the turn; it was not recorded")
        return ChatResult(response, stream)

    def _check_open(self, session: Session) -> None:
        if self.stopping:
            raise ShuttingDownError("the session server is shutting down; the turn was aborted")
        if session.closing or self._expired(session):
            raise SessionNotFoundError(f"session {session.session_id} not found")

    async def _generate(self, session_id: str, chat: dict[str, Any]) -> dict[str, Any]:
        """The turn's chat reply (recorded with `chat` as the turn's request)."""
        wire = generate_body(chat, model_defaults=self.sampling_defaults)
        try:
            # Native /generate straight to the session's pinned engine, not chat through the router: sglang-router
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
