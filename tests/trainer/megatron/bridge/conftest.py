"""Skip every test here unless Megatron-Bridge is installed: it needs Python 3.12, so these tests run in the side
environment ``.venv-bridge`` that ``make bridge-env`` builds (``make test`` runs them there). The tiny-model
fixtures are the parent folder's."""

from __future__ import annotations

import importlib.util

import pytest

SIDE_ENV_REASON = (
    "megatron-bridge is not installed in this Python: these tests run in the side environment of `make bridge-env` "
    "(.venv-bridge, Python 3.12): `.venv-bridge/bin/python -m pytest tests/trainer/megatron/bridge` (make test runs "
    "them)"
)


def bridge_installed() -> bool:
    return importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.bridge") is not None


def pytest_collection_modifyitems(config, items) -> None:
    if bridge_installed():
        return
    skip = pytest.mark.skip(reason=SIDE_ENV_REASON)
    for item in items:
        if "megatron/bridge/" in item.nodeid:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def one_rank(tmp_path_factory, tiny_dense_path, tiny_moe_path) -> dict[str, dict]:
    """bridge_case.run_case in this process (one rank, no parallelism), the reference of every layout: tiny-dense
    and tiny-moe with every target, tiny-moe with attention targets only, and tiny-moe under routing replay."""
    from miles_runner.trainer.megatron.parallel import Layout

    from .bridge_case import ATTENTION_TARGETS, run_case

    root = tmp_path_factory.mktemp("bridge_one_rank")
    return {
        "tiny-dense": run_case(tiny_dense_path, Layout(), root / "tiny-dense"),
        "tiny-moe": run_case(tiny_moe_path, Layout(), root / "tiny-moe"),
        "tiny-moe-attention": run_case(tiny_moe_path, Layout(), root / "tiny-moe-attention", ATTENTION_TARGETS),
        "tiny-moe-replay": run_case(tiny_moe_path, Layout(), root / "tiny-moe-replay", replay=True),
    }
