"""`python -m miles_runner.slurm.free_ports N`: N distinct free loopback ports, space-separated (the job script's
per-job Ray ports, picked on the node itself)."""

from __future__ import annotations

import sys

from miles_runner.procs.ports import free_port


def distinct_free_ports(count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        if (port := free_port("0.0.0.0")) not in ports:
            ports.append(port)
    return ports


if __name__ == "__main__":
    print(" ".join(map(str, distinct_free_ports(int(sys.argv[1]) if len(sys.argv) > 1 else 1))))
