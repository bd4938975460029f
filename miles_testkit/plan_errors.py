"""Reading a printed PlanError back in tests: the rule ids, in the order they were printed."""

from __future__ import annotations


def printed_rules(err: str) -> list[str]:
    """The rule ids of a rendered PlanError (`N. rule-id` lines), in order."""
    return [line.split(". ", 1)[1] for line in err.splitlines() if line[:1].isdigit() and ". " in line]
