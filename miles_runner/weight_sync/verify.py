"""Every adapter push is verified: a push that silently does nothing (an adapter never updated, a dropped shard)
stops the run before the trainer trains further.

Two checks, both named in the plan's `verify` row:
- versions (always): after a push every engine, asked itself rather than through the router, reports the pushed
  weight version (AdapterSync.push runs it).
- logprob gap (plan.weight_sync.verify): right after the push every engine scores the push probe under the pushed
  adapter, and the mean |trainer - engine| logprob must stay within plan.weight_sync.max_logprob_gap (probe.py): an
  engine serving other weights than the pushed ones (a frozen adapter, a lost shard) shows there even when its
  version is right.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from miles_runner.sglang_client.client import EngineClient


class SyncVerificationError(RuntimeError):
    """A push the engines did not take: the run stops here and trains on nothing generated after it."""


async def check_engine_versions(clients: Sequence[EngineClient], version: int) -> None:
    """Raise SyncVerificationError naming every engine that does not report `version`."""
    versions = await asyncio.gather(*(client.weight_version() for client in clients))
    wrong = [f"engine {c.base_url} reports {v!r}" for c, v in zip(clients, versions, strict=True) if v != str(version)]
    if wrong:
        raise SyncVerificationError(
            f"the push of weight version {version} did not reach every engine: " + "; ".join(wrong)
        )
