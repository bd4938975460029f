"""Real servers on loopback for the session tests: the embedded engine (a subprocess), session servers
(uvicorn in a thread, so tests can reach their state), and `FaultInjectingUpstream`, the one fake: a pass-through
proxy in front of the engine that can hang or be switched off to inject upstream faults."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx
from fastapi import FastAPI, Request, Response

from miles_runner.procs.ports import free_port
from miles_runner.procs.process import ManagedProcess
from miles_testkit.launch import start_engine
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


def start_embedded_engine(model_dir: Path, adapter_dir: Path, log_dir: Path) -> tuple[ManagedProcess, str]:
    port = free_port()
    argv = [
        sys.executable, "-m", "miles_runner.embedded_engine",
        "--model-path", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
        "--enable-return-routed-experts", "--enable-lora",
        "--lora-paths", f"{ADAPTER_NAME}={adapter_dir}", f"{SLOT_NAME}={adapter_dir}",
    ]  # fmt: skip
    process = start_engine(argv, port=port, log_path=log_dir / "engine.log", timeout_s=300)
    return process, f"http://127.0.0.1:{port}"


class FaultInjectingUpstream:
    """Fault injection only: forwards every call to the engine, unless told to hang or switched off."""

    def __init__(self, engine_url: str) -> None:
        self.engine_url = engine_url
        self.hanging = False  # while set, requests wait (past the session server's upstream timeout)
        self._server = ThreadedServer(self._build_app())
        self.url = self._server.url

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.api_route("/{path:path}", methods=["GET", "POST"])
        async def forward(path: str, request: Request) -> Response:
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
