"""`python -m miles_runner.slurm.wait_nodes`: the job script's wait until every node's Ray has joined.

Node K has joined when a live Ray node offers miles_node_K. Past the timeout the job fails with a diagnostic
naming each missing node (its index, host and Ray log), never a silent hang; RUN_DIR/result.json says failed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from miles_runner.core.cluster_nodes import node_resource
from miles_runner.core.faults import EXPECT_MISSING_NODE, warn_fault_switches
from miles_runner.tracking.job_result import FAILED, write_result

EXIT_NODES_MISSING = 4
POLL_S = 1.0


def joined_nodes(expected: int) -> set[int]:
    """Indexes of the plan nodes whose Ray is alive now (raises while the head cannot be reached)."""
    import ray

    if not ray.is_initialized():
        ray.init(address="auto", log_to_driver=False, logging_level="ERROR")
    offered = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    return {k for k in range(expected) if any(node_resource(k) in resources for resources in offered)}


def wait_for_nodes(expected: int, timeout_s: float) -> set[int]:
    """The nodes that joined when all did or the time ran out, whichever comes first."""
    deadline, joined = time.monotonic() + timeout_s, set()
    while time.monotonic() < deadline:
        try:
            joined = joined_nodes(expected)
        except Exception:  # the head is not up yet: Ray refuses the connection
            joined = set()
        if len(joined) == expected:
            break
        time.sleep(POLL_S)
    return joined


def missing_report(expected: int, joined: set[int], hosts: list[str], job_dir: Path, timeout_s: float) -> str:
    lines = [
        f"miles: {expected - len(joined)} of the job's {expected} Ray nodes did not join within {timeout_s:g} s "
        f"(hydra.launcher.nodes_timeout_s):"
    ]
    for k in sorted(set(range(expected)) - joined):
        where = (
            f"on host {hosts[k]}; its Ray log: {job_dir / 'logs' / f'ray-node-{k}.log'}"
            if k < len(hosts)
            else f"not in the allocation ({len(hosts)} node(s): {' '.join(hosts)})"
        )
        lines.append(f"  missing: plan node {k} ({node_resource(k)}) {where}")
    lines.append(f"  joined: {', '.join(f'plan node {k}' for k in sorted(joined)) or 'none'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m miles_runner.slurm.wait_nodes", description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--hosts", default="", help="the allocation's hosts, in node order")
    parser.add_argument("--job-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    expected = args.nodes + (1 if EXPECT_MISSING_NODE in warn_fault_switches() else 0)
    started = time.monotonic()
    joined = wait_for_nodes(expected, args.timeout)
    if len(joined) == expected:
        print(f"miles: all {expected} Ray nodes joined in {time.monotonic() - started:.1f} s", flush=True)
        return 0
    print(missing_report(expected, joined, args.hosts.split(), args.job_dir, args.timeout), file=sys.stderr, flush=True)
    write_result(args.job_dir, FAILED, EXIT_NODES_MISSING, time.monotonic() - started)
    return EXIT_NODES_MISSING


if __name__ == "__main__":
    sys.exit(main())
