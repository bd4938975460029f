"""`make bench-peers`: N runs of TRL and miles-run on each row, then BENCHMARKS.md and the reward plot.

    python -m bench.peers.run [--runs 3] [--steps 10] [--rows single_turn agentic] [--trl-threads 1]
                              [--peers-python PATH] [--out BENCHMARKS.md] [--results bench/results]

Run by the main venv; the TRL side runs in the peers venv (``--peers-python``, .venv-peers by `make bench-peers`).
Within a run the two sides of a row run back to back, so a run's ratio compares the same machine load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from bench.peers.miles_side import run_miles
from bench.peers.records import SideRun
from bench.peers.report import RESULTS_DIR, RESULTS_JSON, Runs, machine, main_versions, write_report
from bench.peers.work import ROWS, PeerWork, Row, Work, miles_overrides, peer_work
from miles_runner.config.compose import compose
from miles_runner.executors.local import LocalExecutor
from miles_runner.plan.compile import compile_plan
from miles_runner.plan.model import Plan

REPO = Path(__file__).resolve().parents[2]


def compile_row(work: Work, row: Row) -> Plan:
    """The plan miles-run will run for `row` (the same overrides; ports and logging do not change the work)."""
    return compile_plan(compose(miles_overrides(work, row)))


def build_model(plan: Plan, scratch: Path) -> None:
    """Build the plan's model folder before TRL loads it, as miles-run's executor does (the same code)."""
    LocalExecutor(plan, scratch).prepare_model()


def run_trl(python: str, peer: PeerWork, scratch: Path, threads: int, timeout_s: float = 900) -> tuple[SideRun, dict]:
    work_file, out_file = scratch / f"trl_{peer.row}.json", scratch / f"trl_{peer.row}.out.json"
    work_file.write_text(peer.to_json())
    command = [python, "-m", "bench.peers.trl_side", str(work_file), str(out_file), str(threads)]
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1"}  # rollout_func's "experimental" warning
    started = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    process_s = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"the TRL side exited {done.returncode}: {' '.join(command)}\n{done.stderr[-3000:]}")
    out = json.loads(out_file.read_text())
    run = SideRun.from_dict(out["run"])
    run.process_s, run.command = process_s, command
    return run, out["versions"]


def shown(arg: str, scratch: Path) -> str:
    """A command-line argument as a reader would type it: paths relative to the checkout, the scratch folder as
    $SCRATCH."""
    return arg.replace(str(scratch), "$SCRATCH").replace(f"{REPO}/", "")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each side and row (default 3)")
    parser.add_argument("--steps", type=int, default=10, help="training steps per run (>= 2; the first is warm-up)")
    parser.add_argument("--rows", nargs="+", choices=sorted(ROWS), default=list(ROWS))
    parser.add_argument("--peers-python", default=str(REPO / ".venv-peers" / "bin" / "python"))
    # miles-run gives each of its processes one intra-op thread (engine, trainer ranks); TRL's one process gets
    # the same by default. 0: torch's default, one per core (far slower when other processes share the cores).
    parser.add_argument("--trl-threads", type=int, default=1, help="torch threads of the TRL process (0: default)")
    parser.add_argument("--out", type=Path, default=REPO / "BENCHMARKS.md")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="where peers.json and the plot go")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.runs < 1:
        parser.error("--steps must be >= 2 (the first step is warm-up, left out) and --runs >= 1")
    if not Path(args.peers_python).exists():
        parser.error(f"--peers-python {args.peers_python} does not exist: `make bench-peers` builds .venv-peers")
    return args


def measure(args: argparse.Namespace, work: Work, rows: list[Row], scratch: Path) -> tuple[Runs, dict, dict]:
    """Every run of every row, both sides back to back; also each row's PeerWork and the peers venv's versions."""
    peers = {row.name: peer_work(compile_row(work, row), row) for row in rows}
    build_model(compile_row(work, rows[0]), scratch)
    runs: Runs = []
    peer_versions: dict = {}
    for index in range(args.runs):
        sides: dict[str, dict[str, SideRun]] = {}
        for row in rows:
            trl, peer_versions = run_trl(args.peers_python, peers[row.name], scratch, args.trl_threads)
            miles = run_miles(work, row, scratch / f"miles_{index}_{row.name}")
            for run in (trl, miles):
                run.command = [shown(arg, scratch) for arg in run.command]
            sides[row.name] = {"trl": trl, "miles": miles}
            print(
                f"run {index + 1}/{args.runs} {row.name}: TRL {trl.median():.3f} s/step, "
                f"miles {miles.median():.3f} s/step",
                flush=True,
            )
        runs.append(sides)
    return runs, peers, peer_versions


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    work, rows = Work(steps=args.steps), [ROWS[name] for name in args.rows]
    started, load_before = time.time(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as folder:
        runs, peers, peer_versions = measure(args, work, rows, Path(folder))
    context = {
        "machine": {**machine(load_before), "load_after": [round(x, 2) for x in os.getloadavg()]},
        "trl_threads": args.trl_threads,
        "started": started,
        "work": asdict(work),
        "peers": {k: asdict(v) for k, v in peers.items()},
        "versions": {"main": main_versions(), "peers": peer_versions},
    }
    write_report(runs, context, args.out, args.results)
    print(f"wrote {args.out} and {args.results / RESULTS_JSON.name}")


if __name__ == "__main__":
    main()
