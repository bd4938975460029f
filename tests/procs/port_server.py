"""`python -m tests.procs.port_server PORT [--requests FILE] [--in-child] [--bind-after S]`: an HTTP server on
127.0.0.1:PORT that answers 200 to every GET and appends each request line to FILE (tests/procs/test_port_owner.py).

--in-child: the server runs in a child process of this one, as SGLang's and the router's may. --bind-after: it binds
only after S seconds, as a server loading a model does. A port it cannot bind ends it with exit code 3, after the
error (errno's "Address already in use").
"""

import argparse
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

BIND_FAILED = 3


def handler(requests: Path | None) -> type[BaseHTTPRequestHandler]:
    class Recorder(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if requests is not None:
                with requests.open("a") as out:
                    out.write(f"{self.command} {self.path}\n")
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Recorder


def serve(port: int, requests: Path | None) -> None:
    try:
        server = HTTPServer(("127.0.0.1", port), handler(requests))
    except OSError as error:
        print(f"cannot bind 127.0.0.1:{port}: {error}", flush=True)
        raise SystemExit(BIND_FAILED) from error
    print(f"serving on 127.0.0.1:{port}", flush=True)
    server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("--requests", type=Path)
    parser.add_argument("--in-child", action="store_true")
    parser.add_argument("--bind-after", type=float, default=0.0)
    args = parser.parse_args()
    if args.in_child:
        own = [a for a in sys.argv[1:] if a != "--in-child"]
        raise SystemExit(subprocess.call([sys.executable, "-m", "tests.procs.port_server", *own]))
    time.sleep(args.bind_after)
    serve(args.port, args.requests)


if __name__ == "__main__":
    main()
