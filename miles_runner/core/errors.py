"""The one error a user sees when an experiment cannot run: every problem at once, each with a fix."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Problem:
    rule: str  # a stable id, e.g. "session-needs-resumable-pause"
    settings: list[tuple[str, str]]  # (key=value as the user would write it, where that value came from)
    reason: str
    fix: str = ""  # an override that can be pasted on the command line

    def render(self, number: int) -> str:
        lines = [f"{number}. {self.rule}"]
        width = max((len(s) for s, _ in self.settings), default=0)
        lines += [f"   {setting:<{width}}  ({origin})" for setting, origin in self.settings]
        lines.append(f"   {self.reason}")
        if self.fix:
            lines.append(f"   fix: {self.fix}")
        return "\n".join(lines)


@dataclass
class PlanError(Exception):
    """Raised by composition and by compile_plan; lists every problem, never just the first."""

    problems: list[Problem] = field(default_factory=list)

    def __str__(self) -> str:
        count = len(self.problems)
        head = f"this experiment cannot run ({count} problem{'s' if count != 1 else ''}); nothing was started."
        return "\n\n".join([head, *(p.render(i) for i, p in enumerate(self.problems, 1))])


class ComponentFailure(RuntimeError):
    """A run stopped because one of its components failed: which one, why, and where its log is.

    `miles-run` prints exactly this at the end of a failed run (with the run folder); the traceback that led here
    goes to the run's log. Raised for a process that would not start or died mid-run, and for checks that
    name the component at fault (an engine that did not take an adapter push, ...).
    """

    def __init__(self, component: str, reason: str, *, log_path: str | None = None, log_tail: str = "") -> None:
        super().__init__(f"{component}: {reason}")
        self.component, self.reason, self.log_path, self.log_tail = component, reason, log_path, log_tail

    def __reduce__(self) -> tuple[type[ComponentFailure], tuple[str, str], dict[str, Any]]:
        """Pickles whole (a node agent's failures cross Ray): the default rebuilds from args, one string."""
        return type(self), (self.component, self.reason), self.__dict__

    def report(self) -> str:
        lines = [f"component: {self.component}", f"reason:    {self.reason}"]
        if self.log_path:
            lines.append(f"--- last lines of {self.log_path} ---\n{self.log_tail.rstrip()}")
        return "\n".join(lines)
