"""The run's key (security.api_key_env): every server of a keyed run requires it, every client of the
run sends it, and it is never written into plan.yaml, the printed plan or a log line."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from miles_runner.config.compose import compose
from miles_runner.executors.controller_service import controller_process
from miles_runner.executors.local import LocalExecutor
from miles_runner.executors.ray import RayExecutor
from miles_runner.plan.compile import compile_plan
from miles_runner.plan.model import plan_to_dict
from miles_runner.plan.secrets import MissingSecretError
from miles_runner.procs.ports import free_port, free_port_block
from tests.drivers import runner_command

pytestmark = [pytest.mark.integration, pytest.mark.reliability]

KEY_ENV = "MILES_TEST_RUN_KEY"
KEY = "k3y-of-the-run-7f1c"  # a value no other text of a run contains
GENERATE = {"text": "1 + 1 =", "sampling_params": {"max_new_tokens": 1}}


def keyed_overrides(*extra: str) -> list[str]:
    ports = [
        f"engine.base_port={free_port_block(2)}",
        f"router.port={free_port()}",
        f"router.metrics_port={free_port()}",
        f"session.port={free_port()}",
    ]
    return ["+recipe=tiny_lora_agentic", "router=sglang", f"security.api_key_env={KEY_ENV}", *ports, *extra]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.timeout(300)
def test_every_server_of_a_keyed_run_refuses_a_request_without_its_key(tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    plan = compile_plan(compose(keyed_overrides()))
    http = httpx.Client(trust_env=False, timeout=60)
    with LocalExecutor(plan, tmp_path, startup_timeout_s=240) as deployment, http:
        assert deployment.api_key == KEY
        engine, router, session = deployment.engine_urls[0], plan.router.launch.url, deployment.session_url
        calls = [
            ("POST", f"{engine}/generate", GENERATE),
            ("GET", f"{router}/workers", None),
            ("POST", f"{session}/sessions", None),
        ]
        for method, url, body in calls:
            for headers in ({}, bearer("wrong")):
                assert http.request(method, url, json=body, headers=headers).status_code == 401, url
            assert http.request(method, url, json=body, headers=bearer(KEY)).status_code == 200, url
        for url in (engine, router, session):  # probes stay open, as SGLang's do
            assert http.get(f"{url}/health").status_code == 200
    logs = "".join(path.read_text(errors="replace") for path in (tmp_path / "logs").glob("*.log"))
    assert "{secret:" + KEY_ENV + "}" in logs and KEY not in logs  # the log's command line holds the placeholder


def test_the_key_is_refused_before_anything_starts_when_its_variable_is_unset(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    plan = compile_plan(compose(keyed_overrides()))
    with pytest.raises(MissingSecretError, match=rf"security.api_key_env={KEY_ENV} .* \${KEY_ENV} is unset or empty"):
        LocalExecutor(plan, tmp_path).start()
    assert not (tmp_path / "logs").exists()


def miles_run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {**{k: v for k, v in os.environ.items() if k != KEY_ENV}, "WANDB_MODE": "offline", **env}
    return subprocess.run(
        runner_command("miles_runner.cli.main", *args),
        cwd=cwd,
        env=environ,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_keyed_run_with_a_session_server_trains_end_to_end_and_writes_no_key(tmp_path):
    short = [
        "algorithm.num_steps=2",
        "rollout.rollout_batch_size=4",
        "rollout.n_samples_per_prompt=2",
        "checkpoint.interval=0",
        "logger.plots=false",
        f"run.output_root={tmp_path / 'outputs'}",
    ]
    done = miles_run(keyed_overrides(*short), tmp_path, **{KEY_ENV: KEY})
    assert done.returncode == 0, done.stdout + done.stderr
    [run_dir] = [plan.parent for plan in (tmp_path / "outputs").rglob("plan.yaml")]
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2
    plan_text = (run_dir / "plan.yaml").read_text()
    assert f"api_key_env: {KEY_ENV}" in plan_text and "{secret:" + KEY_ENV + "}" in plan_text
    written = [plan_text, done.stdout, done.stderr, *(p.read_text(errors="replace") for p in run_dir.rglob("*.log"))]
    assert not [text for text in written if KEY in text]


def test_the_printed_plan_names_the_keys_variable_never_its_value(tmp_path):
    printed = miles_run([*keyed_overrides(f"run.output_root={tmp_path}"), "--plan"], tmp_path, **{KEY_ENV: KEY})
    assert printed.returncode == 0, printed.stderr
    assert f"auth       bearer key from ${KEY_ENV}" in printed.stdout and KEY not in printed.stdout
    assert "--api-key '{secret:" + KEY_ENV + "}'" in printed.stdout and f"--api-key-env {KEY_ENV}" in printed.stdout


def test_a_keyed_run_without_its_variable_is_refused_naming_the_setting_and_variable(tmp_path):
    refused = miles_run(keyed_overrides(f"run.output_root={tmp_path / 'outputs'}"), tmp_path)
    assert refused.returncode != 0
    assert f"security.api_key_env={KEY_ENV}" in refused.stderr and f"${KEY_ENV} is unset or empty" in refused.stderr
    assert not list((tmp_path / "outputs").rglob("engine0.log"))  # nothing was started


def test_the_multi_lora_controller_of_a_keyed_run_requires_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    overrides = ["+recipe=tiny_multi_lora", f"security.api_key_env={KEY_ENV}", f"adapters.api_port={free_port()}"]
    plan = compile_plan(compose(overrides))
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(plan_to_dict(plan), sort_keys=False))
    with controller_process(plan, tmp_path), httpx.Client(base_url=plan.multi_lora.launch.url, trust_env=False) as http:
        assert http.get("/state").status_code == 401
        assert http.get("/state", headers=bearer("wrong")).status_code == 401
        assert http.get("/state", headers=bearer(KEY)).status_code == 200
        assert http.get("/health").status_code == 200


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_ray_executor_hands_the_key_to_its_node_agents_in_their_runtime_env(tmp_path, monkeypatch):
    """Ray is started before the variable exists (as a cluster started by `ray start` may be): the agents get the
    key through their runtime_env, and their engines and session server require it."""
    monkeypatch.delenv(KEY_ENV, raising=False)
    plan = compile_plan(compose([*keyed_overrides("executor=ray", "router=none")]))
    executor = RayExecutor(plan, tmp_path, startup_timeout_s=240)
    executor._init_ray()  # the executor's own local Ray, started without the key in its environment
    monkeypatch.setenv(KEY_ENV, KEY)
    with executor as deployment, httpx.Client(trust_env=False, timeout=60) as http:
        generate = f"{deployment.engine_urls[0]}/generate"
        assert http.post(generate, json=GENERATE).status_code == 401
        assert http.post(generate, json=GENERATE, headers=bearer(KEY)).status_code == 200
        assert http.post(f"{deployment.session_url}/sessions").status_code == 401
