"""The engine's auth follows SGLang's levels (docs/sglang-protocol.md §0): probes open, admin routes behind the admin
key when one is set, every other route behind the API key; refusals are SGLang's 401 body."""

from __future__ import annotations

import ast
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from miles_runner.core.sglang_protocol import LORA_BROADCAST_ROUTE
from miles_runner.embedded_engine.args import parse_args
from miles_runner.sglang_client.auth import ADMIN_OPTIONAL, NORMAL, allowed
from miles_testkit.contract.sglang_spec import HTTP_SERVER, SpecMissing, pinned_wheel

from .server_process import EngineProcess, start_engine

pytestmark = pytest.mark.reliability

API_KEY = "engine-test-key"
ADMIN_KEY = "engine-admin-key"
KEY_ENV = "MILES_TEST_ENGINE_KEY"
GENERATE = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}}


def _bearer(key: str, scheme: str = "Bearer") -> dict[str, str]:
    return {"Authorization": f"{scheme} {key}"}


# ----- the decision, as SGLang's decide_request_auth -----------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "level", "api_key", "admin_key", "header", "expected"),
    [
        ("/health", NORMAL, API_KEY, ADMIN_KEY, None, True),
        ("/health_generate", NORMAL, API_KEY, None, None, True),
        ("/metrics", NORMAL, API_KEY, None, None, True),
        ("/ready", NORMAL, API_KEY, None, None, True),
        ("/generate", NORMAL, API_KEY, None, None, False),
        ("/generate", NORMAL, API_KEY, None, f"Bearer {API_KEY}", True),
        ("/generate", NORMAL, API_KEY, None, f"bearer {API_KEY}", True),
        ("/generate", NORMAL, API_KEY, None, f"Basic {API_KEY}", False),
        ("/generate", NORMAL, API_KEY, None, f"Bearer {API_KEY}x", False),
        ("/generate", NORMAL, API_KEY, ADMIN_KEY, f"Bearer {ADMIN_KEY}", False),  # the admin key is not the API key
        ("/generate", NORMAL, None, ADMIN_KEY, None, True),  # an admin key alone leaves normal routes open
        ("/pause_generation", ADMIN_OPTIONAL, API_KEY, None, f"Bearer {API_KEY}", True),  # no admin key: API key
        ("/pause_generation", ADMIN_OPTIONAL, API_KEY, ADMIN_KEY, f"Bearer {API_KEY}", False),
        ("/pause_generation", ADMIN_OPTIONAL, API_KEY, ADMIN_KEY, f"Bearer {ADMIN_KEY}", True),
        ("/pause_generation", ADMIN_OPTIONAL, None, ADMIN_KEY, None, False),
        ("/pause_generation", ADMIN_OPTIONAL, None, None, None, True),
        ("/generate", NORMAL, API_KEY, None, "Bearer ké", False),  # non-ASCII: refused, not an error
    ],
)
def test_decision_follows_sglangs_levels(path, level, api_key, admin_key, header, expected):
    decided = allowed(
        method="POST", path=path, authorization=header, level=level, api_key=api_key, admin_api_key=admin_key
    )
    assert decided is expected


def test_options_is_always_allowed():
    assert allowed(
        method="OPTIONS", path="/generate", authorization=None, level=NORMAL, api_key=API_KEY, admin_api_key=ADMIN_KEY
    )


# ----- which routes are admin: SGLang's own marks --------------------------------------------------------------
def _sglang_admin_routes() -> set[str]:
    """Paths SGLang's http_server.py marks ``@auth_level(AuthLevel.ADMIN_OPTIONAL)``, read from the pinned wheel."""
    from miles_testkit.contract.sglang_spec import _route_decorators

    try:
        wheel = pinned_wheel()
    except SpecMissing as missing:
        pytest.skip(str(missing))
    with zipfile.ZipFile(wheel) as archive:
        tree = ast.parse(archive.read(HTTP_SERVER).decode())
    admin = set()
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) and "ADMIN_OPTIONAL" in {
            node.attr
            for decorator in fn.decorator_list
            for node in ast.walk(decorator)
            if isinstance(node, ast.Attribute)
        }:
            admin |= {path for path, _ in _route_decorators(fn)}
    return admin


@pytest.fixture(scope="module")
def engine_routes(tiny_dense_dir: Path) -> dict[str, str]:
    """Each route of the engine app (built in-process, not started) and its auth level."""
    from miles_runner.embedded_engine.app import create_app
    from miles_runner.embedded_engine.engine import EmbeddedEngine

    app = create_app(EmbeddedEngine(parse_args(["--model-path", str(tiny_dense_dir), "--enable-lora"])))
    return {
        route.path: getattr(route.endpoint, "_auth_level", NORMAL)
        for route in app.routes
        if hasattr(route, "endpoint") and not route.path.startswith(("/openapi", "/docs", "/redoc"))
    }


def test_admin_routes_are_the_ones_sglang_marks(engine_routes):
    sglang_admin = _sglang_admin_routes()
    ours_admin = {path for path, level in engine_routes.items() if level == ADMIN_OPTIONAL}
    served_sglang_admin = sglang_admin & set(engine_routes)
    assert served_sglang_admin, "no route in common with SGLang's admin routes: the parse is broken"
    # The fork's broadcast load is a weight/adapter load like /load_lora_adapter_from_tensors: admin too.
    assert ours_admin - {LORA_BROADCAST_ROUTE} == served_sglang_admin


# ----- a real keyed engine -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed_engine(tiny_dense_dir: Path, tmp_path_factory, monkeypatch_module) -> Iterator[EngineProcess]:
    monkeypatch_module.setenv(KEY_ENV, API_KEY)  # the key travels in the environment, not argv
    process = start_engine(
        tiny_dense_dir,
        tmp_path_factory.mktemp("keyed") / "engine.log",
        "--api-key-env",
        KEY_ENV,
        "--admin-api-key",
        ADMIN_KEY,
    )
    yield process
    process.stop()


@pytest.mark.integration
def test_keyed_engine_serves_sglangs_levels(keyed_engine):
    with httpx.Client(base_url=keyed_engine.url, timeout=30) as http:
        for probe in ("/health", "/health_generate"):
            assert http.get(probe).status_code == 200, probe
        refused = http.post("/generate", json=GENERATE)
        assert refused.status_code == 401 and refused.json() == {"error": "Unauthorized"}
        assert http.post("/generate", json=GENERATE, headers=_bearer(API_KEY)).status_code == 200
        assert http.get("/v1/models", headers=_bearer(ADMIN_KEY)).status_code == 401
        # Admin routes take the admin key, not the API key.
        assert http.post("/pause_generation", json={}, headers=_bearer(API_KEY)).status_code == 401
        assert http.post("/pause_generation", json={}, headers=_bearer(ADMIN_KEY)).status_code == 200
        assert http.post("/continue_generation", json={}, headers=_bearer(ADMIN_KEY)).status_code == 200
        assert http.post("/abort_request", json={"abort_all": True}, headers=_bearer(API_KEY)).status_code == 401


@pytest.mark.integration
def test_server_info_never_shows_a_key(keyed_engine):
    info = httpx.get(f"{keyed_engine.url}/server_info", headers=_bearer(API_KEY), timeout=30)
    assert info.status_code == 200
    assert API_KEY not in info.text and ADMIN_KEY not in info.text
    assert "api_key" not in info.json() and "admin_api_key" not in info.json()


def test_api_key_env_unset_is_refused_naming_the_variable(tiny_dense_dir, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(SystemExit, match=KEY_ENV):
        parse_args(["--model-path", str(tiny_dense_dir), "--api-key-env", KEY_ENV])
