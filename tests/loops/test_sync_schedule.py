"""When the single-adapter loop pushes, and how stale a batch may be (no servers)."""

import pytest

from miles_runner.loops.single_adapter import StaleSamplesError, check_staleness, push_due
from miles_runner.plan.model import staleness_bound
from miles_runner.session.samples import Sample, SampleStatus


def pushes(total: int, interval: int) -> list[int]:
    """The steps after which the adapter is pushed."""
    return [step for step in range(total) if push_due(step + 1, total, interval)]


def test_every_step_pushes_with_interval_one():
    assert pushes(4, 1) == [0, 1, 2, 3]


def test_an_interval_pushes_after_every_nth_step_as_train_async_does():
    assert pushes(6, 3) == [2, 5]


def test_the_last_step_always_pushes_so_the_engines_end_on_the_saved_adapter():
    assert pushes(7, 3) == [2, 5, 6]


@pytest.mark.parametrize(
    ("interval", "driver", "bound"), [(1, "sync", 0), (3, "sync", 2), (1, "async", 1), (3, "async", 3)]
)
def test_the_staleness_bound_is_the_steps_between_pushes_plus_one_for_the_async_schedule(interval, driver, bound):
    assert staleness_bound(interval, driver) == bound


def batch(*versions: list[str]) -> list[Sample]:
    return [Sample([1, 2], 1, [1], [0.0], None, SampleStatus.COMPLETED, weight_versions=v) for v in versions]


def test_staleness_is_the_trainer_version_minus_the_oldest_token_version():
    assert check_staleness(batch(["3"], ["2", "3"]), 4, 2) == 2


def test_a_batch_beyond_the_bound_stops_the_run_naming_the_settings():
    with pytest.raises(StaleSamplesError, match=r"3 versions old at version 5.*update_weights_interval"):
        check_staleness(batch(["2"]), 5, 2)
