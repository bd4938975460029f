"""Standalone session server.

    python -m miles_runner.session.server (--engine-url URL ... | --router-url URL) --model-path DIR --port P [flags]

Inside a run the executor starts this same command from the plan; the flags map one to one onto
`SessionServerConfig`. Repeat --engine-url to spread the sessions over several engines.

The run's key: `--api-key-env NAME` reads it from the environment variable NAME (never from argv, which local
users can read in /proc); agents must then send `Authorization: Bearer <key>` (GET /health stays open) and the
server sends it to the engines too. `--api-key` is the engine's key alone (upstream), kept for callers that
key only the engine.

SIGTERM: new turns are refused (503), in-flight turns are aborted on their engines so their requests end at
once, and uvicorn waits at most SHUTDOWN_GRACE_S for open requests (a hung engine cannot hold the server for
the 600 s upstream timeout).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket

import uvicorn
from fastapi import FastAPI

from miles_runner.core.tito_families import TITO_FAMILIES
from miles_runner.procs.heap import freeze_startup_heap
from miles_runner.session.app import create_app, stop_turns
from miles_runner.session.config import SessionServerConfig
from miles_runner.session.messages import MATCHERS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m miles_runner.session.server",
        description="Session server for agentic rollouts (token-in/token-out proxy in front of SGLang).",
        allow_abbrev=False,
    )
    upstream = p.add_mutually_exclusive_group(required=True)
    upstream.add_argument(
        "--engine-url", action="append", help="an SGLang engine; repeat it to spread the sessions over several"
    )
    upstream.add_argument(
        "--router-url", help="an sglang-router: each session is pinned to one of its workers (session/upstream.py)"
    )
    p.add_argument("--model-path", required=True, help="HF model dir: tokenizer, chat template, config.json")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--version", choices=["v1", "v2"], default="v1", help="v1 linear, v2 append-only tree")
    p.add_argument("--lora-name", help="adapter name sent as lora_path on every turn (overrides the agent)")
    p.add_argument("--routed-experts", action="store_true", help="request MoE routing (R3) on every turn")
    p.add_argument(
        "--addition-r3",
        action="store_true",
        help="request only the R3 rows after each checkpoint (implies --routed-experts; in_place pause)",
    )
    p.add_argument("--max-trim-tokens", type=int, default=0)
    p.add_argument("--tito-model", choices=sorted(TITO_FAMILIES), default="default", help="TITO family (tito.py)")
    p.add_argument("--message-matcher", choices=sorted(MATCHERS), default="strict", help="replay matching")
    p.add_argument("--upstream-timeout", type=float, default=600.0, help="seconds per engine call")
    p.add_argument("--api-key", help="bearer token the engine expects (upstream only; see --api-key-env)")
    p.add_argument(
        "--api-key-env",
        metavar="NAME",
        help="environment variable holding the run's key: required from agents and sent to the engines",
    )
    p.add_argument("--max-sessions", type=int, default=1024, help="open sessions at most (429 beyond)")
    p.add_argument("--max-age", type=float, default=3600.0, help="seconds a session lives (404 after)")
    p.add_argument("--instance-id", help="reported by GET /health")
    p.add_argument("--num-layers", type=int, help="R3 layers (default: num_hidden_layers of config.json)")
    p.add_argument("--log-level", default="warning")
    return p


def config_from_args(args: argparse.Namespace) -> SessionServerConfig:
    run_key = read_key(args.api_key_env) if args.api_key_env else None
    return SessionServerConfig(
        engine_url=args.router_url or args.engine_url[0],
        behind_router=args.router_url is not None,
        engine_urls=tuple(args.engine_url or ()),
        model_path=args.model_path,
        version=args.version,
        lora_name=args.lora_name,
        return_routed_experts=args.routed_experts or args.addition_r3,
        use_addition_r3=args.addition_r3,
        max_trim_tokens=args.max_trim_tokens,
        tito_model=args.tito_model,
        message_matcher=args.message_matcher,
        upstream_timeout_s=args.upstream_timeout,
        upstream_api_key=args.api_key or run_key,
        api_key=run_key,
        max_sessions=args.max_sessions,
        max_age_s=args.max_age,
        host=args.host,
        port=args.port,
        instance_id=args.instance_id,
        num_layers=args.num_layers,
    )


def read_key(env_name: str) -> str:
    key = os.environ.get(env_name, "")
    if not key:
        raise SystemExit(f"--api-key-env names {env_name}, which is unset or empty; export the run's key in it")
    return key


SHUTDOWN_GRACE_S = 5


class SessionServer(uvicorn.Server):
    """uvicorn that, on SIGTERM, aborts the in-flight turns before it waits (bounded) for open requests."""

    def __init__(self, app: FastAPI, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.app = app

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await asyncio.wait_for(stop_turns(self.app), SHUTDOWN_GRACE_S)
        except TimeoutError:
            logging.getLogger(__name__).warning("aborting the in-flight turns took over %g s", SHUTDOWN_GRACE_S)
        await super().shutdown(sockets)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    if config.tito_model == "default":  # docs/system.md §1.2 rule 4: a warning, not an error
        logging.getLogger(__name__).warning(
            "tito_model default: the model's own chat template with a best-effort append rule; a template that "
            "renders earlier turns differently once a message is appended makes input_ids diverge from it"
        )
    app = create_app(config)
    settings = uvicorn.Config(
        app, host=config.host, port=config.port, log_level=args.log_level, timeout_graceful_shutdown=SHUTDOWN_GRACE_S
    )
    freeze_startup_heap()
    SessionServer(app, settings).run()


if __name__ == "__main__":
    main()
