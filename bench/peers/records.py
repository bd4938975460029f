"""What one side's run measured, in one shape for both sides (and both venvs: stdlib only).

A step's ``wall_s`` is the time from the end of the previous step to the end of this one, on both sides (miles:
its "step k/N" lines; TRL: ``on_step_end``), so everything a step costs is in it. The first step has no previous
one and carries the warm-up (first forward passes, lazy imports): ``steady`` leaves it out.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class StepRecord:
    step: int
    wall_s: float | None  # None for the first step (no previous step end)
    reward: float
    # The breakdown. miles: its metrics.jsonl. TRL: rollout = its `_generate`, train = the rest of the step body.
    rollout_s: float | None = None
    train_s: float | None = None
    sync_s: float | None = None  # miles: the adapter push and the probe right after it; TRL: none (0)

    @property
    def other_s(self) -> float | None:
        parts = (self.wall_s, self.rollout_s, self.train_s, self.sync_s)
        return None if None in parts else self.wall_s - self.rollout_s - self.train_s - self.sync_s


@dataclass
class SideRun:
    side: str  # "miles" | "trl"
    row: str
    process_s: float  # the whole process, start to exit
    steps: list[StepRecord] = field(default_factory=list)
    command: list[str] = field(default_factory=list)
    note: str = ""

    def steady(self) -> list[StepRecord]:
        """The steps after the first (warm-up) one."""
        return [s for s in self.steps[1:] if s.wall_s is not None]

    def median(self, attribute: str = "wall_s") -> float:
        values = [getattr(s, attribute) for s in self.steady()]
        if not values or None in values:
            raise ValueError(
                f"{self.side}/{self.row}: no {attribute} after the warm-up step ({len(self.steps)} "
                "steps; run at least 2: --steps)"
            )
        return statistics.median(values)

    def rewards(self) -> list[float]:
        return [s.reward for s in self.steps]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> SideRun:
        return cls(**{**data, "steps": [StepRecord(**s) for s in data["steps"]]})


def step_walls(ends: list[float]) -> list[float | None]:
    """Per-step wall times from the times the steps ended: the first has none."""
    return [None, *(b - a for a, b in itertools.pairwise(ends))]
