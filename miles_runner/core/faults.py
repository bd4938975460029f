"""Fault switches: environment variables that make a run misbehave on purpose, for the tests that prove a
behaviour depends on what they break. Never set outside those tests; a run with one set says so loudly
(a warning at start) and keeps it on record (provenance.json)."""

from __future__ import annotations

import logging
import os
import sys

# Every sync pushes the initial (identity) adapter instead of the trained one: learning must then stop.
FREEZE_ROLLOUT_ADAPTER = "MILES_FAULT_FREEZE_ROLLOUT_ADAPTER"
# The Slurm job script waits for one Ray node more than the job has: that node never joins.
EXPECT_MISSING_NODE = "MILES_FAULT_EXPECT_MISSING_NODE"
FAULT_SWITCHES = {
    FREEZE_ROLLOUT_ADAPTER: "rollouts keep the initial adapter; the trained one never reaches them",
    EXPECT_MISSING_NODE: "the Slurm job waits for one Ray node more than its allocation has",
}

log = logging.getLogger(__name__)


def active_fault_switches() -> dict[str, str]:
    """The fault switches set ("1") in this environment, with what each breaks."""
    return {name: effect for name, effect in FAULT_SWITCHES.items() if os.environ.get(name) == "1"}


def warn_fault_switches() -> dict[str, str]:
    """Warn on stderr and in the log about every fault switch that is set; returns them."""
    active = active_fault_switches()
    for name, effect in active.items():
        message = f"FAULT SWITCH {name}=1 is set: {effect}. This run is a fault-injection run, not a real one."
        print(f"miles-run: WARNING: {message}", file=sys.stderr)
        log.warning(message)
    return active
