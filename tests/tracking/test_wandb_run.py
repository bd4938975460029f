"""The run's wandb record follows the plan's logger section: an offline run in the run folder with the plan's
project, name and tags (read back from the run's own .wandb file), and no wandb at all when disabled."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from miles_runner.config.compose import compose
from miles_runner.plan.compile import compile_plan
from miles_runner.tracking.tracker import Tracker

pytestmark = pytest.mark.integration

BLOCK = 32 * 1024  # the .wandb file is a LevelDB-style log: 32 KiB blocks of (crc, length, type) records
HEADER = 7  # the file's ":W&B" magic, version and format bytes; also each record's header size
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> list[bytes]:
    data, position, records, pending = path.read_bytes(), HEADER, [], b""
    while position + HEADER <= len(data):
        if BLOCK - position % BLOCK < HEADER:  # a block's tail too short for a header is padding
            position += BLOCK - position % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + HEADER])
        chunk = data[position + HEADER : position + HEADER + length]
        position += HEADER + length
        if kind in (FULL, FIRST):
            pending = chunk
        elif kind in (MIDDLE, LAST):
            pending += chunk
        if kind in (FULL, LAST):
            records.append(pending)
    return records


def offline_run(run_dir: Path):
    """The run record (wandb's own protobuf) of the one offline run under `run_dir`."""
    import wandb
    from wandb.proto import wandb_internal_pb2

    wandb.teardown()  # wandb's service writes the run file after finish(); its shutdown flushes it
    [run_file] = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    for raw in wandb_records(run_file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "run":
            return record.run
    raise AssertionError(f"{run_file} has no run record")


def track_one_step(run_dir: Path, *overrides: str) -> None:
    plan = compile_plan(compose(["run.name=tracked", "logger.plots=false", "logger.progress=plain", *overrides]))
    tracker = Tracker(plan, run_dir, start_step=0)
    tracker.step_done(0, {"step": 0, "reward/mean": 0.5})
    tracker.close()


def test_an_offline_run_records_the_plans_project_name_and_tags(tmp_path):
    track_one_step(
        tmp_path,
        "logger.wandb_mode=offline",
        "logger.project=proj-x",
        "logger.run_name=name-y",
        "logger.tags=[first,second]",
    )
    run = offline_run(tmp_path)
    assert (run.project, run.display_name, list(run.tags)) == ("proj-x", "name-y", ["first", "second"])


def test_without_a_run_name_the_wandb_run_is_named_after_the_run(tmp_path):
    track_one_step(tmp_path, "logger.wandb_mode=offline", "logger.run_name=")
    assert offline_run(tmp_path).display_name == "tracked"


def test_disabled_wandb_writes_no_wandb_folder(tmp_path):
    track_one_step(tmp_path, "logger.wandb_mode=disabled")
    assert (tmp_path / "metrics.jsonl").is_file()
    assert not (tmp_path / "wandb").exists()
