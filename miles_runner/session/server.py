"""Standalone session server.

    python -m miles_runner.session.server (--engine-url URL ... | --router-url URL) --model-path DIR --port P [flags]

Inside a run the executor starts this same command from the plan; the flags map one to one onto
`SessionServerConfig`. Repeat --engine-url to spread the sessions over several engines.
"""

from __future__ import annotations

import argparse
import logging

from miles_runner.core.tito_families import TITO_FAMILIES
from miles_runner.session.app import create_app
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
    p.add_argument("--api-key", help="bearer token the engine expects")
    p.add_argument("--instance-id", help="reported by GET /health")
    p.add_argument("--num-layers", type=int, help="R3 layers (default: num_hidden_layers of config.json)")
    p.add_argument("--log-level", default="warning")
    return p


def config_from_args(args: argparse.Namespace) -> SessionServerConfig:
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
        upstream_api_key=args.api_key,
        host=args.host,
        port=args.port,
        instance_id=args.instance_id,
        num_layers=args.num_layers,
    )


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    if config.tito_model == "default":  # spec §1.2 rule 4: a warning, not an error
        logging.getLogger(__name__).warning(
            "tito_model default: the model's own chat template with a best-effort append rule; a template that "
            "renders earlier turns differently once a message is appended makes input_ids diverge from it"
        )
    uvicorn.run(create_app(config), host=config.host, port=config.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
