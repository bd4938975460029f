"""The one error a user sees when an experiment cannot run: every problem at once, each with a fix."""

from __future__ import annotations

from dataclasses import dataclass, field


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
