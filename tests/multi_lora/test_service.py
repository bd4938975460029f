"""The controller as its own service: settings from a saved plan or from flags, and the module's command line."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
import yaml

from miles_runner.config.compose import compose
from miles_runner.multi_lora.settings import TOKEN_ENV, load_settings, parse_args
from miles_runner.plan.compile import compile_plan
from miles_runner.plan.model import plan_to_dict
from miles_runner.procs.ports import free_port
from miles_runner.procs.process import ManagedProcess

pytestmark = pytest.mark.integration

MODULE = "miles_runner.multi_lora.http_server"


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder holding the saved plan of the tiny multi-LoRA recipe."""
    folder = tmp_path_factory.mktemp("run")
    plan = compile_plan(compose(["+recipe=tiny_multi_lora"]))
    (folder / "plan.yaml").write_text(yaml.safe_dump(plan_to_dict(plan), sort_keys=False))
    return folder


def test_plan_settings_take_the_engines_lora_flags_and_the_plan_sizes(plan_dir):
    settings = load_settings(parse_args(["--plan", str(plan_dir / "plan.yaml")]))
    limits = settings.limits
    assert (limits.max_slots, limits.max_lora_rank, limits.dp_size) == (4, 8, 1)
    assert limits.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert settings.engine_urls == ("http://127.0.0.1:30010",)


def test_a_plan_controller_starts_with_the_plans_adapters_registered(plan_dir):
    controller = load_settings(parse_args(["--plan", str(plan_dir / "plan.yaml")])).build_controller()
    pending = controller.snapshot().pending
    assert [(name, run.slot) for name, run in pending.items()] == [("count", 0), ("retry", 1), ("letters", 2)]
    assert pending["retry"].config.save == str(plan_dir / "adapters" / "retry")


def test_without_a_plan_the_engine_limits_are_required():
    with pytest.raises(SystemExit):
        parse_args(["--max-slots", "2"])


def start_service(argv: list[str], log_dir: Path, **options) -> tuple[ManagedProcess, str]:
    port = free_port()
    argv = [sys.executable, "-m", MODULE, *argv, "--host", "127.0.0.1", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    process = ManagedProcess("controller", argv, log_path=log_dir / "controller.log", health_url=f"{url}/health",
                             startup_timeout_s=60, **options)  # fmt: skip
    return process, url


def test_the_module_serves_a_saved_plan_from_its_run_folder(plan_dir):
    process, url = start_service(["--plan", "plan.yaml"], plan_dir, cwd=plan_dir)
    with process:
        adapters = httpx.get(f"{url}/adapter_runs", trust_env=False).json()["adapters"]
    assert [a["name"] for a in adapters] == ["count", "retry", "letters"]


def test_the_standalone_module_requires_its_token(tmp_path):
    flags = ["--max-slots", "1", "--max-lora-rank", "8", "--target-modules", "q_proj", "v_proj"]
    process, url = start_service(flags, tmp_path, env={TOKEN_ENV: "tok"})
    body = {"name": "a", "config": {"rank": 4}}
    with process, httpx.Client(base_url=url, trust_env=False) as http:
        assert http.post("/adapter_runs", json=body).status_code == 401
        registered = http.post("/adapter_runs", json=body, headers={"Authorization": "Bearer tok"})
    assert registered.json() == {"name": "a", "slot": 0}
