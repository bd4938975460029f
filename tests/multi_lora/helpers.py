"""Builders for the multi-LoRA tests: configs, limits, groups, a loopback server, and the one stand-in for an
engine's /generate (`DeterministicGenerator`, an in-process generate function that records what it posts)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request

from miles_runner.core.adapters import AdapterLimits
from miles_runner.multi_lora.buffers import Group
from miles_runner.multi_lora.cache import AdaptersCache
from miles_runner.multi_lora.config import AdapterDefaults, AdapterRunConfig
from miles_runner.multi_lora.producer import request_fields
from miles_runner.multi_lora.registry import AdapterRun, RegistrySnapshot
from miles_runner.procs.ports import free_port
from miles_runner.session.samples import Sample, SampleStatus

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
LIMITS = AdapterLimits(
    max_slots=2,
    max_lora_rank=8,
    target_modules=TARGETS,
    max_adapter_global_batch_size=64,
    dp_size=1,
    tasks=("arith", "reverse", "count"),
    rewards=("exact_match",),
)


def defaults(save_root: str = "/tmp/miles-multi-lora-tests") -> AdapterDefaults:
    return AdapterDefaults(
        rank=8,
        alpha=16.0,
        target_modules=TARGETS,
        lr=1e-3,
        rollout_batch_size=4,
        n_samples_per_prompt=2,
        task="arith",
        reward="exact_match",
        save_root=save_root,
    )


def config(name: str = "a", **overrides: Any) -> AdapterRunConfig:
    values: dict[str, Any] = {
        "task": "arith",
        "reward": "exact_match",
        "rank": 8,
        "alpha": 16.0,
        "target_modules": TARGETS,
        "lr": 1e-3,
        "rollout_batch_size": 4,
        "n_samples_per_prompt": 2,
        "save": f"/tmp/save/{name}",
    }
    return AdapterRunConfig(**{**values, **overrides})


def run(
    name: str, slot: int, *, version: int = 1, accumulated: int = 0, registration: str = "", **cfg: Any
) -> AdapterRun:
    return AdapterRun(
        name=name,
        config=config(name, **cfg),
        slot=slot,
        version=version,
        accumulated_groups=accumulated,
        registration_id=registration or f"reg-{name}",
    )


def snapshot(*active: AdapterRun, retiring: tuple[AdapterRun, ...] = ()) -> RegistrySnapshot:
    return RegistrySnapshot(active={r.name: r for r in active}, retiring={r.name: r for r in retiring})


def sample(tokens: list[int] | None = None, status: SampleStatus = SampleStatus.COMPLETED) -> Sample:
    tokens = tokens or [1, 2, 3]
    return Sample(
        tokens=tokens,
        response_length=1,
        loss_mask=[1],
        rollout_log_probs=[-0.5],
        rollout_routed_experts=None,
        status=status,
    )


def group(of: AdapterRun, index: int, *, version: int | None = None, registration: str | None = None) -> Group:
    """A finished group of `of`'s n samples, stamped like the producer stamps it (overridable)."""
    samples = [sample() for _ in range(of.config.n_samples_per_prompt)]
    return Group(
        of.name,
        index,
        samples,
        of.slot,
        of.version if version is None else version,
        of.registration_id if registration is None else registration,
    )


@dataclass
class DeterministicGenerator:
    """An in-process generate function: n samples per prompt, tokens derived from the prompt, no model.

    Like a real generate function, it asks `request_fields` right before each would-be POST and marks the
    sample ABORTED without posting when that says no; it records the fields of every request it posts.
    Requests wait at `before_post` and `after_post` while those events are clear (to hold them in flight)."""

    cache: AdaptersCache
    posted: list[dict[str, str]] = field(default_factory=list)
    before_post: asyncio.Event = field(default_factory=asyncio.Event)
    after_post: asyncio.Event = field(default_factory=asyncio.Event)
    abort_all: bool = False

    def __post_init__(self) -> None:
        self.before_post.set()
        self.after_post.set()

    async def __call__(self, of: AdapterRun, prompt: int) -> list[Sample]:
        return list(await asyncio.gather(*(self._one(of, prompt, k) for k in range(of.config.n_samples_per_prompt))))

    async def _one(self, of: AdapterRun, prompt: int, k: int) -> Sample:
        await self.before_post.wait()
        fields = await request_fields(self.cache, of)
        if fields is None:
            return sample(status=SampleStatus.ABORTED)
        self.posted.append(fields)
        await self.after_post.wait()
        return sample([prompt, k, 7], SampleStatus.ABORTED if self.abort_all else SampleStatus.COMPLETED)


async def eventually(condition, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def serve(*apps: FastAPI) -> AsyncIterator[list[str]]:
    """Serve each app with uvicorn on its own loopback port in this event loop; yields their URLs; all are
    stopped together at exit."""
    servers = [
        uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning")) for app in apps
    ]
    tasks = [asyncio.create_task(server.serve()) for server in servers]
    try:
        while not all(server.started for server in servers):
            for task in tasks:
                if task.done():
                    task.result()
            await asyncio.sleep(0.01)
        yield [f"http://127.0.0.1:{server.config.port}" for server in servers]
    finally:
        for server in servers:
            server.should_exit = True
        await asyncio.gather(*tasks, return_exceptions=True)


def abort_recorder() -> tuple[FastAPI, list[dict[str, Any]]]:
    """A stand-in engine that only records the /abort_request bodies it receives (named as the fake it is)."""
    app, received = FastAPI(), []

    @app.post("/abort_request")
    async def abort_request(request: Request) -> dict[str, Any]:
        received.append(await request.json())
        return {}

    return app, received
