"""v2 samples: one per leaf of the session tree, then the default picker and postprocessor (docs/system.md §2.6)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from miles_runner.session.samples import AssemblyOptions, Decode, Sample, build_sample
from miles_runner.session.tree import TrajectoryNode, TreeTrajectory

SERVER_METADATA_KEYS = ("accumulated_token_ids", "tito_session_mismatch", "leaf")


@dataclass
class LeafSample:
    leaf: TrajectoryNode
    path: list[TrajectoryNode]
    sample: Sample


def build_leaf_samples(
    tree: TreeTrajectory, options: AssemblyOptions, decode: Decode
) -> tuple[list[LeafSample], str | None]:
    """Each root->leaf chain assembled on its own (compute, truncate, merge); or ([], empty_reason)."""
    if not tree.nodes:
        return [], "no_records"
    built = []
    for leaf in tree.leaves():
        path = tree.path(leaf.node_id)
        sample, _ = build_sample([node.record for node in path], leaf.token_ids, options, decode)
        if sample is None:
            continue
        sample.metadata = {
            "accumulated_token_ids": leaf.token_ids,
            "leaf": {
                "node_id": leaf.node_id,
                "parent": leaf.parent,
                "path_node_ids": [node.node_id for node in path],
                "response_id": leaf.response_id,
            },
        }
        built.append(LeafSample(leaf, path, sample))
    return built, None if built else "all_truncated"


def drop_retries(leaves: list[LeafSample]) -> list[LeafSample]:
    """Drop leaves superseded by a later sibling (a retry); longest paths first, then the newest."""
    latest_child: dict[int | None, int] = {}
    for item in leaves:
        parent = item.leaf.parent
        latest_child[parent] = max(latest_child.get(parent, -1), item.leaf.seq)
    survivors = [item for item in leaves if item.leaf.seq == latest_child[item.leaf.parent]]
    return sorted(survivors, key=lambda item: (len(item.path), item.leaf.node_id), reverse=True)


def postprocess(kept: list[LeafSample], agent_metadata: dict[str, Any]) -> list[Sample]:
    """Each node's completion trains in one sample only; agent metadata and reward reach every sample."""
    _assign_loss_ownership(kept)
    agent = {key: value for key, value in agent_metadata.items() if key not in SERVER_METADATA_KEYS}
    for item in kept:
        item.sample.metadata = {**agent, **item.sample.metadata}
        if "reward" in agent_metadata:
            item.sample.reward = agent_metadata["reward"]
    return [item.sample for item in kept]


def _assign_loss_ownership(kept: list[LeafSample]) -> None:
    """A shared ancestor's completion stays trainable only in the earliest kept leaf (by node id)."""
    owned: set[int] = set()
    for item in sorted(kept, key=lambda item: item.leaf.node_id):
        for node in item.path:
            if node.node_id in owned:
                _mask_span(item.sample, *node.completion_span)
            owned.add(node.node_id)


def _mask_span(sample: Sample, start: int, end: int) -> None:
    offset = sample.prompt_length
    lo, hi = max(start - offset, 0), min(end - offset, sample.response_length)
    if lo < hi:
        sample.loss_mask[lo:hi] = [0] * (hi - lo)
