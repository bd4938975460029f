"""`python -m miles_runner.slurm.free_ports N`: N distinct free ports on every interface, space-separated (the job
script's per-job Ray ports, picked on the node itself)."""

from __future__ import annotations

import sys

from miles_runner.procs.ports import free_ports

if __name__ == "__main__":
    print(" ".join(map(str, free_ports(int(sys.argv[1]) if len(sys.argv) > 1 else 1, "0.0.0.0"))))
