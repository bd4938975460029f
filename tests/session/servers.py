"""Real servers on loopback for the session tests: the embedded engine (a subprocess), session servers
(uvicorn in a thread, so tests can reach their state), and the fault injectors, the only fakes: pass-through
proxies in front of the engine that hang or are switched off (`FaultInjectingUpstream`) or fail at random in
named ways (`RandomFaultUpstream`, seeded)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from pathlib import Path

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from miles_runner.procs.ports import free_port
from miles_runner.procs.process import ManagedProcess
from miles_testkit.launch import embedded_engine_argv, start_engine
from miles_testkit.servers import ThreadedServer

# The random tiny model rarely emits <|im_end|>; stopping on every even token id ends most turns with
# finish_reason "stop" after a few tokens (a turn cut by max_tokens is TRUNCATED and ends sample merging).
STOP_TOKEN_IDS = list(range(0, 400, 2))
ADAPTER_NAME = "miles_lora"
SLOT_NAME = "__miles_slot_0"


def make_test_adapter(model_dir: Path, out_dir: Path) -> Path:
    """A PEFT LoRA adapter with random (non-zero) B matrices, so it visibly changes the model's outputs."""
    if (out_dir / "adapter_config.json").is_file():
        return out_dir
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=8, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False
    )
    get_peft_model(model, config).save_pretrained(out_dir)
    return out_dir


def start_embedded_engine(
    model_dir: Path, adapter_dir: Path, log_dir: Path, *, api_key: str | None = None
) -> tuple[ManagedProcess, str]:
    port = free_port()
    argv = embedded_engine_argv(
        model_dir,
        port,
        "--enable-return-routed-experts",
        "--enable-lora",
        "--lora-paths",
        f"{ADAPTER_NAME}={adapter_dir}",
        f"{SLOT_NAME}={adapter_dir}",
    )
    if api_key:
        argv += ["--api-key", api_key]
    process = start_engine(argv, port=port, log_path=log_dir / "engine.log", timeout_s=300)
    return process, f"http://127.0.0.1:{port}"


class FaultInjectingUpstream:
    """Fault injection only: forwards every call to the engine, unless told to hang or switched off."""

    def __init__(self, engine_url: str) -> None:
        self.engine_url = engine_url
        self.hanging = False  # while set, requests wait (past the session server's upstream timeout)
        self.received: list[str] = []  # the path of every request that arrived, in order
        self._server = ThreadedServer(self._build_app())
        self.url = self._server.url

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.api_route("/{path:path}", methods=["GET", "POST"])
        async def forward(path: str, request: Request) -> Response:
            self.received.append(f"/{path}")
            while self.hanging:
                await asyncio.sleep(0.05)
            async with httpx.AsyncClient(base_url=self.engine_url, timeout=60, trust_env=False) as http:
                upstream = await http.request(
                    request.method,
                    f"/{path}",
                    content=await request.body(),
                    headers={"content-type": request.headers.get("content-type", "application/json")},
                )
            return Response(upstream.content, upstream.status_code, media_type=upstream.headers.get("content-type"))

        return app

    def start(self) -> FaultInjectingUpstream:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop()


class RandomFaultUpstream:
    """Fault injection only (seeded): a pass-through proxy to the engine whose /generate fails at random in one
    of FAULTS ways; every other path passes. `injected` counts the faults by kind."""

    FAULTS = ("engine_500", "engine_503_text", "bad_json_200", "no_meta_info_200", "reply_lost", "cut_body", "hang")

    def __init__(self, engine_url: str, *, seed: int, fault_rate: float, hang_s: float) -> None:
        self.engine_url = engine_url
        self.rng = random.Random(seed)
        self.fault_rate, self.hang_s = fault_rate, hang_s
        self.injected: Counter[str] = Counter()
        self._server = ThreadedServer(self._build_app())
        self.url = self._server.url

    def _build_app(self) -> FastAPI:
        app = FastAPI()
        http = httpx.AsyncClient(base_url=self.engine_url, timeout=60, trust_env=False)

        @app.api_route("/{path:path}", methods=["GET", "POST"])
        async def forward(path: str, request: Request) -> Response:
            fault = self._draw() if path == "generate" else None
            if fault is not None:
                self.injected[fault] += 1
            if fault == "hang":
                await asyncio.sleep(self.hang_s)
            if fault in ("engine_500", "hang"):
                return JSONResponse({"error": {"message": f"injected fault: {fault}"}}, status_code=500)
            if fault == "engine_503_text":
                return PlainTextResponse("injected fault: overloaded", status_code=503)
            if fault == "bad_json_200":
                return Response(b'{"text": "injected fault', media_type="application/json")
            upstream = await http.request(
                request.method, f"/{path}", content=await request.body(), headers={"content-type": "application/json"}
            )
            if fault == "reply_lost":  # the engine generated, the reply never arrived
                return JSONResponse({"error": {"message": "injected fault: reply lost"}}, status_code=502)
            if fault == "no_meta_info_200":
                return JSONResponse({k: v for k, v in upstream.json().items() if k != "meta_info"})
            if fault == "cut_body":  # headers and half the body, then the connection drops
                return StreamingResponse(_cut(upstream.content), media_type="application/json")
            return Response(upstream.content, upstream.status_code, media_type=upstream.headers.get("content-type"))

        return app

    def _draw(self) -> str | None:
        return self.rng.choice(self.FAULTS) if self.rng.random() < self.fault_rate else None

    def __enter__(self) -> RandomFaultUpstream:
        self._server.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.stop()


async def _cut(content: bytes):
    yield content[: len(content) // 2]
    raise ConnectionResetError("injected fault: connection dropped mid-body")


def new_session(server: ThreadedServer, **body) -> str:
    response = httpx.post(f"{server.url}/sessions", json=body or None, trust_env=False)
    response.raise_for_status()
    return response.json()["session_id"]


def get_session(server: ThreadedServer, session_id: str) -> dict:
    response = httpx.get(f"{server.url}/sessions/{session_id}", trust_env=False)
    response.raise_for_status()
    return response.json()


def chat(server: ThreadedServer, session_id: str, messages: list[dict], **fields) -> httpx.Response:
    body = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": 16,
        "temperature": 0,
        "stop_token_ids": STOP_TOKEN_IDS,
        **fields,
    }
    return httpx.post(
        f"{server.url}/sessions/{session_id}/v1/chat/completions", json=body, timeout=120, trust_env=False
    )


def openai_client(server: ThreadedServer, session_id: str):
    import openai

    return openai.OpenAI(
        base_url=f"{server.url}/sessions/{session_id}/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.Client(trust_env=False, timeout=120),
    )
