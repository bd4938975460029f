"""How long `miles-run +recipe=tiny_multi_lora --plan` takes (target: well under 1.5 s), and what it imports.

The largest recipe this release runs (three adapters, disaggregated); the GPU recipes are refused until their
Megatron trainer is built, which would time the refusal instead of the whole path.

    python -m bench.plan_speed [--runs N]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

from bench.report import write_result

HEAVY = ("torch", "ray", "transformers", "sglang", "peft")
IMPORT_PROBE = (
    "import sys; from miles_runner.cli.main import main; main(['+recipe=tiny_multi_lora', '--plan', "
    "'run.output_root={root}']); print('HEAVY=' + ','.join(m for m in {heavy} if m in sys.modules))"
)


def time_plan(root: str) -> float:
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "miles_runner.cli", "+recipe=tiny_multi_lora", "--plan", f"run.output_root={root}"],
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=9)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        time_plan(root)  # warm the page cache and bytecode
        seconds = sorted(time_plan(root) for _ in range(args.runs))
        probe = IMPORT_PROBE.format(root=root, heavy=HEAVY)
        imported = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    marker = imported.stdout.rpartition("HEAVY=")[2].strip()
    heavy = [m for m in marker.split(",") if m]
    figures = {
        "runs": args.runs,
        "median_s": statistics.median(seconds),
        "min_s": seconds[0],
        "max_s": seconds[-1],
        "heavy_modules_imported": heavy,
    }
    summary = [
        "`miles-run +recipe=tiny_multi_lora --plan` (whole process, compose + checks + plan + files):",
        f"- median {figures['median_s']:.3f} s over {args.runs} runs (min {seconds[0]:.3f}, max {seconds[-1]:.3f});"
        " target: well under 1.5 s",
        f"- heavy modules imported: {heavy or 'none'} (of {', '.join(HEAVY)})",
    ]
    print("\n".join(summary))
    write_result("plan_speed", figures, summary)


if __name__ == "__main__":
    main()
