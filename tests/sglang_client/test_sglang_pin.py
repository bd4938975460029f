"""One SGLang release defines the protocol: core.sglang_protocol.SGLANG_VERSION. pyproject's gpu extra installs
exactly it, the wire-format tests read exactly its wheel, and every run records it; a plan says which build
(stock or the sglang-miles fork) its engines are, and the embedded engine is launched as that build."""

from __future__ import annotations

import tomllib
from pathlib import Path

from miles_runner.config.compose import compose
from miles_runner.core.sglang_protocol import MILES_FORK, SGLANG_VERSION, STOCK
from miles_runner.plan.compile import compile_design, compile_plan
from miles_runner.plan.record import provenance_record
from miles_runner.plan.summary import engines_line

REPO = Path(__file__).resolve().parents[2]


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_pyproject_pins_the_gpu_extra_to_exactly_the_protocol_version():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert [req for req in extras["gpu"] if req.startswith("sglang")] == [f"sglang=={SGLANG_VERSION}"]


def test_the_wire_format_tests_read_the_pinned_release(sglang_spec):
    assert sglang_spec.version == SGLANG_VERSION


def test_provenance_records_the_sglang_protocol_version():
    assert provenance_record(compose([]), ["miles-run"])["sglang_protocol_version"] == SGLANG_VERSION


def test_the_plan_and_its_summary_say_which_build_the_engines_are():
    stock = compile_design(compose(["+recipe=qwen25_05b_lora"]))  # engine=sglang: stock unless a recipe says
    assert stock.engines[0].build == STOCK
    assert f"stock {SGLANG_VERSION}" in engines_line(stock)
    fork = compile_plan(compose([]))  # the embedded engine serves the fork's features
    assert fork.engines[0].build == MILES_FORK
    assert "sglang-miles fork" in engines_line(fork)


def test_the_embedded_engine_is_launched_as_the_plans_build():
    for build in (STOCK, MILES_FORK):
        plan = compile_plan(compose([f"engine.build={build}"]))
        assert _flag(plan.engines[0].launch.argv, "--engine-build") == build
