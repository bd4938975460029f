"""v2 session state: an append-only forest of generated turns; retries and branches become siblings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from miles_runner.session.errors import TreeFullError, TruncatedGenerationError
from miles_runner.session.linear import check_checkpoint_prefix
from miles_runner.session.messages import Matcher, Message, strict_matches
from miles_runner.session.records import SessionRecord
from miles_runner.session.tito import TitoTokenizer

MAX_NODES = 1024


@dataclass
class TrajectoryNode:
    node_id: int  # also the commit sequence number: ids grow in commit order
    parent: int | None
    delta_messages: list[Message]  # the request tail this turn appended, then the assistant reply
    path_messages: list[Message]  # root -> node
    token_ids: list[int]  # root -> node: prompt + completion
    completion_span: tuple[int, int]
    committed_at: float
    response_id: str | None
    record: SessionRecord
    finish_reason: str | None
    children: list[int] = field(default_factory=list)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    @property
    def seq(self) -> int:
        return self.node_id


@dataclass(frozen=True)
class TreeTurnPlan:
    parent: int | None  # captured when the request was positioned; the commit attaches here
    request_messages: list[Message]
    prompt_ids: list[int]
    checkpoint_ids: list[int]


@dataclass
class TreeTrajectory:
    nodes: list[TrajectoryNode] = field(default_factory=list)
    active_leaf: int | None = None
    # Whether a replayed message is the stored one (session.message_matcher); the stored one is kept.
    matcher: Matcher = strict_matches

    @property
    def records(self) -> list[SessionRecord]:
        return [node.record for node in self.nodes]

    @property
    def token_ids(self) -> list[int]:
        return [] if self.active_leaf is None else self.nodes[self.active_leaf].token_ids

    def find_attach_point(self, request: list[Message]) -> int | None:
        """Deepest node whose root->node conversation is a prefix of the request; ties go to the later."""
        best: TrajectoryNode | None = None
        frontier = [node for node in self.nodes if node.parent is None and _extends(node, request, self.matcher)]
        while frontier:
            node = frontier.pop()
            if best is None or (len(node.path_messages), node.seq) > (len(best.path_messages), best.seq):
                best = node
            frontier += [self.nodes[c] for c in node.children if _extends(self.nodes[c], request, self.matcher)]
        return None if best is None else best.node_id

    def plan_turn(
        self,
        request_messages: list[Message],
        tools: list[dict] | None,
        template_kwargs: dict[str, Any],
        tito: TitoTokenizer,
    ) -> TreeTurnPlan:
        self._check_capacity()
        parent_id = self.find_attach_point(request_messages)
        self.active_leaf = parent_id
        if parent_id is None:
            return TreeTurnPlan(
                None, request_messages, tito.first_turn_ids(request_messages, tools, template_kwargs), []
            )
        parent = self.nodes[parent_id]
        if parent.truncated:
            raise TruncatedGenerationError(
                f"the request extends node {parent_id}, whose generation stopped at the length limit; "
                "a truncated turn cannot be continued (retry it instead)"
            )
        prompt_ids = tito.merge_tokens(
            parent.path_messages,
            parent.token_ids,
            request_messages[len(parent.path_messages) :],
            tools,
            template_kwargs,
        )
        return TreeTurnPlan(parent_id, request_messages, prompt_ids, parent.token_ids)

    def commit(
        self,
        plan: TreeTurnPlan,
        completion_ids: list[int],
        assistant: Message,
        record: SessionRecord,
        max_trim_tokens: int,
    ) -> bool:
        """Append the turn under the parent captured by the plan (concurrent turns become siblings)."""
        self._check_capacity()
        full_ids = [*plan.prompt_ids, *completion_ids]
        check_checkpoint_prefix(plan.checkpoint_ids, full_ids, max_trim_tokens)
        parent_messages = [] if plan.parent is None else self.nodes[plan.parent].path_messages
        delta = [*plan.request_messages[len(parent_messages) :], assistant]
        choice = record.choice
        node = TrajectoryNode(
            node_id=len(self.nodes),
            parent=plan.parent,
            delta_messages=delta,
            path_messages=[*parent_messages, *delta],
            token_ids=full_ids,
            completion_span=(len(plan.prompt_ids), len(full_ids)),
            committed_at=record.timestamp,
            response_id=record.response.get("id"),
            record=record,
            finish_reason=choice.get("finish_reason"),
        )
        self.nodes.append(node)
        if plan.parent is not None:
            self.nodes[plan.parent].children.append(node.node_id)
        self.active_leaf = node.node_id
        return True

    def path(self, node_id: int) -> list[TrajectoryNode]:
        """Nodes from the root down to `node_id`."""
        path: list[TrajectoryNode] = []
        current: int | None = node_id
        while current is not None:
            path.append(self.nodes[current])
            current = self.nodes[current].parent
        return path[::-1]

    def leaves(self) -> list[TrajectoryNode]:
        return [node for node in self.nodes if not node.children]

    def describe(self) -> dict[str, Any]:
        """The `tree` entry of the session metadata."""
        return {
            "nodes": [
                {
                    "id": node.node_id,
                    "parent": node.parent,
                    "seq": node.seq,
                    "truncated": node.truncated,
                    "committed_at": node.committed_at,
                    "completion_span": list(node.completion_span),
                    "num_tokens": len(node.token_ids),
                    "response_id": node.response_id,
                }
                for node in self.nodes
            ],
            "leaves": [
                {"node_id": leaf.node_id, "path_node_ids": [n.node_id for n in self.path(leaf.node_id)]}
                for leaf in self.leaves()
            ],
        }

    def _check_capacity(self) -> None:
        if len(self.nodes) >= MAX_NODES:
            raise TreeFullError(f"the session tree already holds {MAX_NODES} nodes; start a new session")


def _extends(node: TrajectoryNode, request: list[Message], matcher: Matcher) -> bool:
    """The request contains the node's whole conversation (a node counts only once its delta is consumed)."""
    size = len(node.path_messages)
    start = size - len(node.delta_messages)
    return size <= len(request) and all(map(matcher, node.delta_messages, request[start:size]))
