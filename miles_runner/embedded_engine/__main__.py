"""``python -m miles_runner.embedded_engine --model-path DIR [--host H] [--port P] ...`` (see args.py)."""

from __future__ import annotations

import logging

import uvicorn

from miles_runner.embedded_engine.app import create_app
from miles_runner.embedded_engine.args import log_ignored_flags, parse_args
from miles_runner.embedded_engine.engine import EmbeddedEngine
from miles_runner.procs.heap import freeze_startup_heap

# Requests get aborted on SIGTERM, so open connections finish at once; this only bounds stragglers.
GRACEFUL_SHUTDOWN_S = 3


class _EngineServer(uvicorn.Server):
    """Uvicorn server that, on SIGTERM/SIGINT, first aborts in-flight generations so shutdown is quick."""

    def __init__(self, config: uvicorn.Config, engine) -> None:
        super().__init__(config)
        self._engine = engine

    def handle_exit(self, sig, frame) -> None:
        self._engine.begin_shutdown()
        super().handle_exit(sig, frame)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log_ignored_flags(args)

    import torch

    # One intra-op thread: the matrices are tiny, and with two OpenMP threads every op waits at a barrier for
    # a second core that other processes share, so one busy core stalls every token. Concurrency comes from
    # batching instead.
    torch.set_num_threads(1)
    torch.manual_seed(args.random_seed)

    engine = EmbeddedEngine(args)
    config = uvicorn.Config(
        create_app(engine),
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    freeze_startup_heap()
    _EngineServer(config, engine).run()


if __name__ == "__main__":
    main()
