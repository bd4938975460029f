"""The tiny_multi_lora recipe end to end on CPU (controller service, embedded engine, multi-LoRA trainer):
its three adapters train at once, each on its own task, and each one's reward rises. A fourth, `victim`, is
retired over HTTP (DELETE) mid-run while a request of it is in flight, then its name is registered again (POST)
for a new tenant. Asserted from the trained groups' stamps (adapter, slot, slot version, registration id)
recorded in multi_lora_events.jsonl, and from metrics.jsonl."""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles_runner.plan.record import read_plan

from .runs import TOKEN, adapter_rewards, events, metrics, plan_run, start_driver, wait_for

pytestmark = pytest.mark.slow

LEARNERS = ("count", "retry", "letters")  # the recipe's adapters
STEPS = 60  # more than the recipe's 40: the rise of each reward then stands well above the noise
RUNS = (
    "adapters.runs=[{name: count, task: count}, {name: retry, task: count_retry},"
    f" {{name: letters, task: jsonl, data: 'bundled:letters.jsonl', num_step: {STEPS}}},"
    " {name: victim, task: guess_number, reward: guess_number}]"
)
OVERRIDES = (RUNS, "checkpoint.interval=10", f"algorithm.num_steps={STEPS}")
# The rise of each adapter's mean reward from the first quarter of its records to the last: each starts near chance,
# and under a full suite's load the rewards rise less steadily, so the bar sits below the smallest rise a learning
# adapter shows there and above the noise of two quarters' means for one that does not learn.
RISE = 0.06
NEW_TENANT = {"task": "count", "num_step": 2}  # and its own save folder: a new tenant, not a resume
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@dataclass
class Run:
    dir: Path
    probe: dict[str, Any]  # the engine's answer to the victim's long request, in flight at the retire
    registrations: dict[str, list[str]]  # name -> registration ids, in load order


def long_request(engine_url: str, slot: int) -> dict[str, Any]:
    body = {
        "input_ids": [1, 2, 3, 4],
        "lora_path": f"__miles_slot_{slot}",
        "rid": "victim::probe",
        "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},  # within the context
    }
    return httpx.post(f"{engine_url}/generate", json=body, timeout=300, trust_env=False).json()


def probe_until_aborted(engine_url: str, slot: int, run_dir: Path) -> dict[str, Any]:
    """Keep one long request of the victim in flight until the retire aborts it (one may finish at the context
    limit first, while the driver has not reconciled the DELETE yet)."""
    while not events(run_dir, "retired"):
        answer = long_request(engine_url, slot)
        if answer["meta_info"]["finish_reason"]["type"] == "abort":
            return answer
    raise AssertionError("the victim was retired between two probe requests")


def register_when_slot_is_free(api: httpx.Client, name: str, config: dict[str, Any], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while (reply := api.post("/adapter_runs", json={"name": name, "config": config})).status_code == 400:
        assert "cleaning up" in reply.text or "already registered" in reply.text, reply.text
        assert time.monotonic() < deadline, reply.text
        time.sleep(0.2)
    assert reply.status_code == 200, reply.text


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    run_dir = plan_run(tmp_path_factory.mktemp("lifecycle") / "outputs", *OVERRIDES)
    plan = read_plan(run_dir / "plan.yaml")
    proc = start_driver(run_dir)
    try:
        with (
            httpx.Client(base_url=plan.multi_lora.launch.url, headers=AUTH, trust_env=False) as api,
            ThreadPoolExecutor(1) as pool,
        ):
            wait_for(lambda: any("victim/step" in r for r in metrics(run_dir)), proc, timeout_s=240)
            slot = api.get("/adapter_runs/victim").json()["slot"]
            probe = pool.submit(probe_until_aborted, plan.engines[0].launch.url, slot, run_dir)
            time.sleep(1.0)  # let it start decoding
            assert api.delete("/adapter_runs/victim").status_code == 200
            answer = probe.result(timeout=300)
            new_tenant = {**NEW_TENANT, "save": str(run_dir / "adapters" / "victim-tenant-2")}
            register_when_slot_is_free(api, "victim", new_tenant, timeout_s=120)
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    loads = events(run_dir, "loaded")
    registrations = {e["name"]: [x["registration_id"] for x in loads if x["name"] == e["name"]] for e in loads}
    return Run(run_dir, answer, registrations)


def first_retire(run_dir: Path, name: str) -> int:
    return min(e["iteration"] for e in events(run_dir, "retired") if name in e["names"])


def trained_groups(run_dir: Path) -> list[tuple[int, list]]:
    return [(e["iteration"], group) for e in events(run_dir, "trained") for group in e["groups"]]


def test_the_retired_adapters_in_flight_request_ends_aborted(run):
    assert run.probe["meta_info"]["finish_reason"]["type"] == "abort"
    assert run.probe["meta_info"]["completion_tokens"] < 2000  # cut short


def test_no_group_of_the_retired_registration_is_trained_after_its_retire(run):
    retired_at = first_retire(run.dir, "victim")
    old, new = run.registrations["victim"]
    assert old != new
    assert any(g[0] == "victim" and g[3] == old for it, g in trained_groups(run.dir) if it < retired_at)
    assert not [g for it, g in trained_groups(run.dir) if it >= retired_at and g[3] == old]


def test_every_trained_group_belongs_to_the_current_registration_of_its_adapter(run):
    current: dict[str, str] = {}
    timeline = sorted(events(run.dir), key=lambda e: e["iteration"])
    for event in timeline:  # loads of an iteration are written before its training
        if event["event"] == "loaded":
            current[event["name"]] = event["registration_id"]
        elif event["event"] == "trained":
            for adapter, _slot, _version, registration, _index in event["groups"]:
                assert registration == current[adapter], f"a foreign group of {adapter} reached training"


def test_the_new_tenant_trains_and_the_others_carry_on_to_their_num_step(run):
    retired_at = first_retire(run.dir, "victim")
    new = run.registrations["victim"][1]
    assert any(g[3] == new for _, g in trained_groups(run.dir))
    for name in LEARNERS:
        assert any(g[0] == name for it, g in trained_groups(run.dir) if it > retired_at)
    final = {
        name: max(r[f"{name}/step"] for r in metrics(run.dir) if f"{name}/step" in r) for name in (*LEARNERS, "victim")
    }
    assert final == {**dict.fromkeys(LEARNERS, STEPS), "victim": NEW_TENANT["num_step"]}


@pytest.mark.parametrize("name", LEARNERS)
def test_each_adapter_reward_rises_on_its_own_task(run, name):
    rewards = adapter_rewards(metrics(run.dir), name)
    quarter, eighth = len(rewards) // 4, len(rewards) // 8
    first, last = statistics.mean(rewards[:quarter]), statistics.mean(rewards[-quarter:])
    eighths = [round(statistics.mean(rewards[i * eighth : (i + 1) * eighth]), 2) for i in range(8)]
    assert last - first >= RISE, f"{name}: {first:.3f} in the first quarter, {last:.3f} in the last; eighths {eighths}"


def test_only_stepped_or_new_adapters_are_pushed(run):
    pushes = events(run.dir, "pushed")
    stepped = {e["iteration"]: set(e["step_names"]) for e in events(run.dir, "trained")}
    for push in pushes[1:]:
        loaded_now = {e["name"] for e in events(run.dir, "loaded") if e["iteration"] == push["iteration"]}
        assert set(push["names"]) <= stepped.get(push["iteration"] - 1, set()) | loaded_now


def test_per_adapter_metrics_plots_wandb_and_checkpoints(run):
    keys = set().union(*metrics(run.dir))
    for name in (*LEARNERS, "victim"):
        assert {f"{name}/reward/mean", f"{name}/train/loss", f"{name}/step"} <= keys
        assert (run.dir / f"metrics_{name}.png").stat().st_size > 1000
    assert list((run.dir / "wandb").glob("offline-run-*"))
    for name in LEARNERS:
        kept = sorted(p.name for p in (run.dir / "adapters" / name / "checkpoints").iterdir())
        assert kept == [f"step_{STEPS - 10}", f"step_{STEPS}"]
