"""FAKE stand-in for one node rank of `python -m sglang.launch_server --nnodes N --node-rank R` (no SGLang, no
GPU): enough of SGLang 0.5.23's multi-node start-up to test where the executor starts each rank and with what.

It prints one JSON line (its argv and CUDA_VISIBLE_DEVICES) to its log, then meets the other ranks the way the
real ones do, at rank 0's `--dist-init-addr` (rank 0 listens there and waits for the N-1 others; each rank > 0
connects), and then serves /health on its own --host/--port: rank 0 as the engine's HTTP server, ranks > 0 as
SGLang's stand-in health server (utils.common.launch_dummy_health_check_server). Nothing else is served.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from http.server import BaseHTTPRequestHandler, HTTPServer


def flag(name: str) -> str:
    return sys.argv[sys.argv.index(name) + 1]


def meet(rank: int, nnodes: int, dist_init_addr: str) -> list[socket.socket]:
    host, port = dist_init_addr.rsplit(":", 1)
    if rank == 0:
        server = socket.create_server((host, int(port)))
        return [server.accept()[0] for _ in range(nnodes - 1)]
    while True:
        try:
            return [socket.create_connection((host, int(port)), timeout=5)]
        except OSError:  # rank 0 is not listening yet
            time.sleep(0.1)


class Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    print(
        json.dumps({"argv": sys.argv[1:], "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}), flush=True
    )
    peers = meet(int(flag("--node-rank")), int(flag("--nnodes")), flag("--dist-init-addr"))
    print(f"met {len(peers)} peer(s)", flush=True)
    HTTPServer((flag("--host"), int(flag("--port"))), Health).serve_forever()


if __name__ == "__main__":
    main()
