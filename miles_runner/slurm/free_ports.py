"""`python -m miles_runner.slurm.free_ports N [--plan PLAN_YAML]`: N distinct free ports on every interface,
space-separated (the job script's per-job Ray ports, picked on the node itself at every attempt).

With `--plan`, none of them is a port the job's plan binds later (its servers start after Ray): the plan's ports
are fixed at submission and free when the job starts, so an unguarded pick could hand one to Ray.
"""

from __future__ import annotations

import argparse

from miles_runner.plan.model import plan_ports
from miles_runner.plan.record import read_plan
from miles_runner.procs.ports import free_ports


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m miles_runner.slurm.free_ports")
    parser.add_argument("count", type=int, nargs="?", default=1)
    parser.add_argument("--plan", help="a plan.yaml whose ports are left out")
    args = parser.parse_args(argv)
    avoid = plan_ports(read_plan(args.plan)) if args.plan else set()
    print(" ".join(map(str, free_ports(args.count, "0.0.0.0", avoid=avoid))))


if __name__ == "__main__":
    main()
