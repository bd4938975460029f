"""The registry's state machine (docs/system.md §4.2)."""

from __future__ import annotations

import pytest

from miles_runner.multi_lora.registry import (
    MAX_BATCH_RECORDS,
    MAX_COMPLETED_RECORDS,
    AdapterRegistry,
    AdapterState,
    NoFreeSlotError,
    UnknownAdapterError,
)

from .helpers import config


def registry_with(*names: str, slots: int = 2, active: bool = True, **cfg) -> AdapterRegistry:
    registry = AdapterRegistry(slots)
    for name in names:
        registry.register(name, config(name, **cfg))
    if active:
        registry.record_weight_update(names)
    return registry


def retire_and_free(registry: AdapterRegistry, name: str) -> int:
    registry.deregister(name)
    registry.retire_adapters()
    return registry.free_slot(name)


def test_register_takes_the_lowest_free_slot():
    registry = AdapterRegistry(3)
    assert registry.register("a", config("a")) == {"name": "a", "slot": 0}
    assert registry.register("b", config("b")) == {"name": "b", "slot": 1}
    retire_and_free(registry, "a")
    assert registry.register("c", config("c"))["slot"] == 0


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "a::b", "a b", "__miles_slot_0", "miles_lora"])
def test_register_rejects_unsafe_names(name):
    with pytest.raises(ValueError):
        AdapterRegistry(1).register(name, config("x"))


def test_register_a_live_name_again_says_already_registered():
    registry = registry_with("a")
    with pytest.raises(ValueError, match="already registered"):
        registry.register("a", config("a", save="/tmp/other"))


@pytest.mark.parametrize("retired", [False, True])
def test_register_a_name_being_cleaned_up_says_retry_shortly(retired):
    registry = registry_with("a")
    registry.deregister("a")
    if retired:
        registry.retire_adapters()
    with pytest.raises(ValueError, match="still cleaning up; retry shortly"):
        registry.register("a", config("a"))


def test_register_after_cleanup_finishes_succeeds():
    registry = registry_with("a")
    retire_and_free(registry, "a")
    assert registry.register("a", config("a"))["slot"] == 0
    assert registry.state_of("a") is AdapterState.PENDING


def test_register_rejects_the_save_folder_of_a_live_adapter():
    registry = registry_with("a")
    with pytest.raises(ValueError, match="already used by live adapter 'a'"):
        registry.register("b", config("b", save=config("a").save))


def test_register_without_a_free_slot_raises_no_free_slots():
    registry = registry_with("a", "b", slots=2)
    with pytest.raises(NoFreeSlotError, match=r"No free adapter slots \(max 2\)"):
        registry.register("c", config("c"))


def test_weight_update_promotes_pending_to_active():
    registry = registry_with("a", active=False)
    assert registry.state_of("a") is AdapterState.PENDING
    registry.record_weight_update(["a"])
    assert registry.state_of("a") is AdapterState.ACTIVE


def test_weight_update_bumps_only_the_reported_slots():
    registry = registry_with("a", "b")
    registry.record_weight_update(["b"])
    assert registry.slot_versions == [1, 2]


def test_slot_versions_are_never_reset_for_a_new_tenant():
    registry = registry_with("a", slots=1)
    registry.record_weight_update(["a"])
    retire_and_free(registry, "a")
    registry.register("b", config("b"))
    registry.record_weight_update(["b"])
    assert registry.snapshot().active["b"].version == 3


def test_each_registration_gets_a_new_registration_id():
    registry = registry_with("a")
    first = registry.snapshot().active["a"].registration_id
    retire_and_free(registry, "a")
    registry.register("a", config("a"))
    second = registry.snapshot().pending["a"].registration_id
    assert first and second and first != second


def test_deregister_only_marks_retiring_and_it_stays_sampleable():
    registry = registry_with("a")
    assert registry.deregister("a") is AdapterState.RETIRING
    assert "a" in registry.snapshot().sampleable
    assert registry.active_adapters() == ["a"]


def test_deregister_an_unknown_adapter_raises_unknown():
    with pytest.raises(UnknownAdapterError):
        AdapterRegistry(1).deregister("nope")


def test_retire_moves_retiring_adapters_to_cleanup_and_returns_them_sorted():
    registry = registry_with("b", "a", slots=3)
    registry.register("c", config("c"))
    for name in ("b", "a"):
        registry.deregister(name)
    assert registry.retire_adapters() == ["a", "b"]
    assert registry.snapshot().cleanup == ("a", "b")
    assert registry.state_of("c") is AdapterState.PENDING


def test_the_slot_is_held_until_free_slot():
    registry = registry_with("a", slots=1)
    registry.deregister("a")
    registry.retire_adapters()
    with pytest.raises(NoFreeSlotError):
        registry.register("b", config("b"))
    assert registry.free_slot("a") == 0
    assert registry.register("b", config("b"))["slot"] == 0


@pytest.mark.parametrize("state", ["ACTIVE", "RETIRING"])
def test_free_slot_outside_cleanup_returns_minus_one_and_changes_nothing(state):
    registry = registry_with("a")
    if state == "RETIRING":
        registry.deregister("a")
    assert registry.free_slot("a") == -1
    assert registry.state_of("a") is AdapterState(state)


def test_free_slot_completes_the_adapter():
    registry = registry_with("a")
    retire_and_free(registry, "a")
    assert registry.state_of("a") is AdapterState.COMPLETED
    assert registry.snapshot().completed == ("a",)
    assert registry.status("a")["version"] is None


def test_mark_batch_trained_accumulates_then_steps():
    registry = registry_with("a", rollout_batch_size=4)
    registry.record_batch_adapters("r0", {"a": 2}, [])
    assert registry.mark_batch_trained("r0") == []
    assert registry.snapshot().active["a"].accumulated_groups == 2
    registry.record_batch_adapters("r1", {"a": 2}, ["a"])
    assert registry.mark_batch_trained("r1") == ["a"]
    view = registry.snapshot().active["a"]
    assert (view.step, view.accumulated_groups) == (1, 0)


def test_a_batch_that_is_never_marked_trained_changes_nothing():
    registry = registry_with("a", rollout_batch_size=2)
    registry.record_batch_adapters("failed", {"a": 2}, ["a"])
    view = registry.snapshot().active["a"]
    assert (view.step, view.accumulated_groups) == (0, 0)


def test_marking_an_unrecorded_batch_raises():
    with pytest.raises(UnknownAdapterError):
        registry_with("a").mark_batch_trained("never")


def test_record_batch_rejects_step_names_without_groups():
    with pytest.raises(ValueError, match="have no groups"):
        registry_with("a").record_batch_adapters("r", {}, ["a"])


def test_a_deregistered_adapter_keeps_counting_until_freed():
    registry = registry_with("a", rollout_batch_size=4)
    registry.record_batch_adapters("r", {"a": 2}, [])
    registry.deregister("a")
    registry.retire_adapters()
    registry.mark_batch_trained("r")
    assert registry.status("a")["accumulated_groups"] == 2


def test_pending_adapters_do_not_accumulate():
    registry = registry_with("a", active=False)
    registry.record_batch_adapters("r", {"a": 2}, [])
    registry.mark_batch_trained("r")
    assert registry.status("a")["accumulated_groups"] == 0


def train_steps(registry: AdapterRegistry, name: str, steps: int) -> None:
    rbs = registry.snapshot().sampleable[name].config.rollout_batch_size
    for k in range(steps):
        registry.record_batch_adapters(f"{name}-{k}", {name: rbs}, [name])
        registry.mark_batch_trained(f"{name}-{k}")


def test_num_step_retires_the_adapter_when_reached():
    registry = registry_with("a", num_step=2)
    train_steps(registry, "a", 1)
    assert registry.state_of("a") is AdapterState.ACTIVE
    train_steps(registry, "a", 1)
    assert registry.state_of("a") is AdapterState.RETIRING


def test_num_step_counts_from_the_resume_step():
    registry = registry_with("a", num_step=2)
    registry.set_step("a", 10)
    train_steps(registry, "a", 1)
    assert (registry.adapter_step("a"), registry.state_of("a")) == (11, AdapterState.ACTIVE)
    train_steps(registry, "a", 1)
    assert registry.state_of("a") is AdapterState.RETIRING


def test_resolve_num_step_is_rows_over_rollout_batch_size_when_unset():
    assert registry_with("a", rollout_batch_size=4).resolve_num_step("a", rows=10) == 2


def test_resolve_num_step_multiplies_by_num_epoch():
    assert registry_with("a", rollout_batch_size=4, num_epoch=3).resolve_num_step("a", rows=10) == 7


def test_resolve_num_step_is_at_least_one():
    assert registry_with("a", rollout_batch_size=4).resolve_num_step("a", rows=1) == 1


def test_resolve_num_step_keeps_a_set_num_step():
    assert registry_with("a", num_step=5).resolve_num_step("a", rows=1000) == 5


def test_snapshot_puts_each_adapter_under_its_state():
    registry = registry_with("act", "ret", "cln", "done", slots=5)
    registry.register("pend", config("pend"))
    for name in ("cln", "done"):
        registry.deregister(name)
    registry.retire_adapters()
    registry.free_slot("done")
    registry.deregister("ret")
    snap = registry.snapshot()
    assert (list(snap.pending), list(snap.active), list(snap.retiring)) == (["pend"], ["act"], ["ret"])
    assert (snap.cleanup, snap.completed) == (("cln",), ("done",))


def test_snapshot_round_trips_through_its_wire_form():
    registry = registry_with("a", "b", metadata={"k": 1})
    registry.deregister("b")
    snap = registry.snapshot()
    assert type(snap).from_dict(snap.to_dict()) == snap


def test_completed_records_are_bounded():
    registry = AdapterRegistry(1)
    for k in range(MAX_COMPLETED_RECORDS + 3):
        registry.register(f"a{k}", config(f"a{k}"))
        retire_and_free(registry, f"a{k}")
    completed = registry.snapshot().completed
    assert len(completed) == MAX_COMPLETED_RECORDS and completed[0] == "a3"


def test_batch_records_are_bounded_oldest_evicted():
    registry = registry_with("a")
    for k in range(MAX_BATCH_RECORDS + 1):
        registry.record_batch_adapters(f"r{k}", {"a": 1}, [])
    with pytest.raises(UnknownAdapterError):
        registry.mark_batch_trained("r0")
    registry.mark_batch_trained(f"r{MAX_BATCH_RECORDS}")
