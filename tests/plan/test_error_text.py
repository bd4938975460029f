"""The shape of the rejection a user reads: every problem, its settings and origins, the reason and a fix."""

import re

import pytest

from miles_runner.config.compose import compose
from miles_runner.core.errors import PlanError
from miles_runner.plan.compile import compile_plan

BAD = [
    "+recipe=qwen3_30b_a3b_r3_session",
    "pause_generation_mode=abort",
    "topology=disaggregated",
    "adapters=multi",
    "rollout.fully_async=true",
    "topology=colocated",
]


@pytest.fixture(scope="module")
def error() -> PlanError:
    with pytest.raises(PlanError) as info:
        compile_plan(compose(BAD))
    return info.value


def test_head_line_counts_the_problems_and_says_nothing_started(error):
    head = str(error).splitlines()[0]
    assert head == f"this experiment cannot run ({len(error.problems)} problems); nothing was started."


def test_problems_are_numbered_and_named_by_rule(error):
    numbered = re.findall(r"^(\d+)\. ([a-z0-9-]+)$", str(error), flags=re.M)
    assert [int(n) for n, _ in numbered] == list(range(1, len(error.problems) + 1))
    assert {rule for _, rule in numbered} >= {"session-needs-resumable-pause", "multi-lora-needs-disaggregated"}


def test_each_setting_shows_its_value_and_origin(error):
    text = str(error)
    assert re.search(r"^   session=v1 +\(recipe qwen3_30b_a3b_r3_session\)$", text, flags=re.M)
    assert re.search(r"^   pause_generation_mode=abort +\(command line\)$", text, flags=re.M)


def test_each_problem_ends_with_a_pasteable_fix(error):
    session = next(p for p in error.problems if p.rule == "session-needs-resumable-pause")
    assert session.fix == "pause_generation_mode=in_place"
    assert "   fix: pause_generation_mode=in_place" in str(error)


def test_all_violations_are_reported_at_once(error):
    rules = {p.rule for p in error.problems}
    assert {
        "session-needs-resumable-pause",
        "multi-lora-needs-disaggregated",
        "fully-async-needs-disaggregated",
        "fully-async-needs-resumable-pause",
    } <= rules
