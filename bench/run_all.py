"""`make bench`: run every benchmark module in bench/ that has a main(), one after another."""

from __future__ import annotations

import importlib
import pkgutil
import sys

import bench

SKIP = {"report", "run_all"}


def main() -> None:
    names = sorted(m.name for m in pkgutil.iter_modules(bench.__path__) if m.name not in SKIP)
    for name in names:
        module = importlib.import_module(f"bench.{name}")
        if hasattr(module, "main"):
            print(f"== bench.{name}", flush=True)
            sys.argv = [f"bench.{name}"]
            module.main()


if __name__ == "__main__":
    main()
