"""A live progress display (iteration, rollout, training) on a terminal; plain log lines without one."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class Progress:
    def __init__(self, total_steps: int, *, mode: str = "auto", stream: TextIO | None = None, start_step: int = 0):
        self.stream = stream or sys.stdout
        self.total = total_steps
        self.rich = mode == "rich" or (mode == "auto" and self.stream.isatty())
        self._live = None
        self._start = time.monotonic()
        self.step, self.phase = start_step, "starting"
        if self.rich:
            from rich.console import Console
            from rich.live import Live

            self._live = Live(self._render(), console=Console(file=self.stream), refresh_per_second=4)
            self._live.start()

    def phase_started(self, step: int, phase: str) -> None:
        """`phase` is rollout, train, sync or checkpoint."""
        self.step, self.phase = step, phase
        if self._live:
            self._live.update(self._render())

    def _counted(self, step: int) -> str:
        """ "step 3/40", or with no known total (total 0: a multi-LoRA run iterates until every adapter has taken its
        own steps) "iteration 3"."""
        return f"step {step}/{self.total}" if self.total else f"iteration {step}"

    def step_done(self, step: int, metrics: dict[str, Any]) -> None:
        self.step, self.phase = step + 1, "done"
        line = f"{self._counted(step + 1)} " + " ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items()
        )
        if self._live:
            self._live.console.print(line)
            self._live.update(self._render())
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self._live:
            self._live.stop()
            self._live = None

    def _render(self) -> Any:
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        table = Table.grid(padding=(0, 1))
        elapsed = time.monotonic() - self._start
        table.add_row(
            ProgressBar(total=self.total or None, completed=self.step, width=40),
            self._counted(self.step),
            f"[{self.phase}]",
            f"{elapsed:.0f}s",
        )
        return table
