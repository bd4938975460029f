"""scripts/gpu_check_sglang.py: runs the contract against real SGLang on a GPU, and says why it cannot here."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check_sglang.py"


def missing_requirement() -> str | None:
    spec = importlib.util.spec_from_file_location("gpu_check_sglang", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.missing_requirement()


def run_script(*args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout_s)


def test_gpu_check_exits_cleanly_where_sglang_or_cuda_is_missing() -> None:
    if missing_requirement() is None:
        pytest.skip("this machine can run real SGLang")
    finished = run_script(timeout_s=120)
    assert finished.returncode == 2
    assert json.loads(finished.stdout)["skipped"]


@pytest.mark.gpu
@pytest.mark.slow
def test_engine_contract_holds_against_real_sglang(tmp_path: Path) -> None:
    reason = missing_requirement()
    if reason:
        pytest.skip(reason)
    finished = run_script("--work-dir", str(tmp_path), timeout_s=1500)
    summary = json.loads(finished.stdout)
    failed = {name: check["error"] for name, check in summary["checks"].items() if not check["ok"]}
    assert finished.returncode == 0, failed
