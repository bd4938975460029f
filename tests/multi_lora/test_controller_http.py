"""The controller's HTTP API and its abort fan-out (docs/system.md §4.3, §4.4), over real loopback HTTP.

The engines here are `abort_recorder`s: stand-ins that only record the abort bodies they receive."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles_runner.multi_lora.client import ControllerClient
from miles_runner.multi_lora.controller import MultiLoRAController
from miles_runner.multi_lora.http_server import create_app
from miles_runner.multi_lora.registry import NoFreeSlotError, UnknownAdapterError
from miles_runner.procs.ports import free_port
from miles_runner.sglang_client.auth import install_auth

from .helpers import LIMITS, abort_recorder, defaults, serve

pytestmark = pytest.mark.integration

TOKEN = "s3cret"


@dataclass
class Service:
    controller: MultiLoRAController
    http: httpx.AsyncClient
    url: str
    engine_urls: list[str]
    aborts: list[list[dict[str, Any]]]  # per engine, the abort bodies it received


@contextlib.asynccontextmanager
async def service(
    tmp_path: Path, *, engines: int = 2, engine_key: str | None = None, **app_options: Any
) -> AsyncIterator[Service]:
    """The API over a controller whose engines are abort recorders (with `engine_key`: behind SGLang's auth, and the
    controller holds the key, as a keyed run's does)."""
    async with contextlib.AsyncExitStack() as stack:
        recorders = [abort_recorder() for _ in range(engines)]
        for app, _ in recorders:
            install_auth(app, api_key=engine_key, admin_api_key=None)
        engine_urls: list[str] = []  # filled once the recorders listen

        async def workers() -> list[str]:
            return engine_urls

        controller = MultiLoRAController(defaults(str(tmp_path)), LIMITS, workers, api_key=engine_key)
        app = create_app(controller, **app_options)
        url, *listening = await stack.enter_async_context(serve(app, *(engine for engine, _ in recorders)))
        engine_urls += listening
        http = await stack.enter_async_context(httpx.AsyncClient(base_url=url, trust_env=False))
        yield Service(controller, http, url, engine_urls, [received for _, received in recorders])


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[Service]:
    async with service(tmp_path) as running:
        yield running


async def register(api: Service, name: str, **config: Any) -> httpx.Response:
    return await api.http.post("/adapter_runs", json={"name": name, "config": config})


async def test_health_answers_healthy(api):
    assert (await api.http.get("/health")).json() == {"status": "healthy"}


async def test_register_then_listed_with_its_config_and_state(api):
    response = await register(api, "math", rank=4)
    assert (response.status_code, response.json()) == (200, {"name": "math", "slot": 0})
    [listed] = (await api.http.get("/adapter_runs")).json()["adapters"]
    assert listed["name"] == "math" and listed["rank"] == 4 and listed["state"] == "PENDING"
    assert listed["version"] == 0 and listed["registration_id"]


async def test_get_one_adapter_returns_its_status(api):
    await register(api, "math")
    assert (await api.http.get("/adapter_runs/math")).json()["slot"] == 0


async def test_register_when_every_slot_is_taken_is_409(api):
    for name in ("a", "b"):
        await register(api, name)
    response = await register(api, "c")
    assert (response.status_code, response.json()["detail"]) == (409, "No free adapter slots (max 2)")


async def test_register_a_rejected_config_is_400_with_the_reason(api):
    response = await register(api, "a", rank=64)
    assert response.status_code == 400 and "max LoRA rank" in response.json()["detail"]


async def test_register_a_live_name_again_is_400(api):
    await register(api, "a")
    response = await register(api, "a")
    assert response.status_code == 400 and "already registered" in response.json()["detail"]


@pytest.mark.parametrize("body", [{"name": "a"}, {"name": "a", "config": {}, "yaml_path": "a.yaml"}])
async def test_register_with_neither_or_both_config_and_yaml_path_is_400(api, body):
    assert (await api.http.post("/adapter_runs", json=body)).status_code == 400


@pytest.mark.parametrize(
    "body",
    [
        {"name": "a", "config": {"rank": "8"}},
        {"name": "a", "config": {"rnk": 8}},
        {"config": {}},
        {"name": 3, "config": {}},
        ["not", "an", "object"],
    ],
)
async def test_register_a_body_of_the_wrong_shape_is_422(api, body):
    assert (await api.http.post("/adapter_runs", json=body)).status_code == 422


async def test_register_malformed_json_is_4xx_not_500(api):
    response = await api.http.post("/adapter_runs", content=b"{nope", headers={"content-type": "application/json"})
    assert response.status_code == 422


async def test_delete_only_marks_the_adapter_retiring(api):
    await register(api, "a")
    response = await api.http.delete("/adapter_runs/a")
    assert response.json() == {"status": "ok", "name": "a"}
    assert (await api.http.get("/adapter_runs/a")).json()["state"] == "RETIRING"
    assert api.aborts == [[], []]


@pytest.mark.parametrize("method", ["GET", "DELETE"])
async def test_an_unknown_adapter_is_404(api, method):
    response = await api.http.request(method, "/adapter_runs/ghost")
    assert response.status_code == 404 and "ghost" in response.json()["detail"]


async def test_retire_posts_a_prefix_abort_to_every_engine(api):
    await register(api, "A")
    await register(api, "B")
    await api.http.delete("/adapter_runs/A")
    assert await api.controller.retire_adapters() == ["A"]
    assert api.aborts == [[{"rid": "A::", "abort_all": False, "prefix": True}]] * 2


@pytest.mark.reliability
async def test_the_controller_sends_the_runs_key_with_its_aborts_to_keyed_engines(tmp_path):
    async with service(tmp_path, engine_key=TOKEN) as running:
        running.controller.register_adapter("A", {})
        running.controller.deregister_adapter("A")
        await running.controller.retire_adapters()
        assert running.aborts == [[{"rid": "A::", "abort_all": False, "prefix": True}]] * 2
        unkeyed = await running.http.post(f"{running.engine_urls[0]}/abort_request", json={"rid": "A::"})
        assert unkeyed.status_code == 401  # the stand-ins do refuse a request without it


async def test_free_slot_aborts_once_more_only_in_cleanup(api):
    await register(api, "A")
    assert await api.controller.free_slot("A") == -1
    assert api.aborts == [[], []]
    await api.http.delete("/adapter_runs/A")
    await api.controller.retire_adapters()
    assert await api.controller.free_slot("A") == 0
    assert [len(received) for received in api.aborts] == [2, 2]


async def test_an_unreachable_engine_does_not_stop_the_abort_on_the_others(tmp_path):
    async with service(tmp_path, engines=1) as running:
        running.engine_urls.insert(0, f"http://127.0.0.1:{free_port()}")  # nothing listens there
        running.controller.register_adapter("A", {})
        running.controller.deregister_adapter("A")
        assert await running.controller.retire_adapters() == ["A"]
        assert len(running.aborts[0]) == 1


async def test_state_endpoint_follows_the_lifecycle(api):
    async def state(name: str) -> str | None:
        response = await api.http.get("/adapter_runs/state", params={"names": [name, "ghost"]})
        states = response.json()["states"]
        assert states["ghost"] is None
        return states[name]

    await register(api, "a")
    assert await state("a") == "PENDING"
    api.controller.record_weight_update(["a"])
    assert await state("a") == "ACTIVE"
    await api.http.delete("/adapter_runs/a")
    assert await state("a") == "RETIRING"
    await api.controller.retire_adapters()
    assert await state("a") == "CLEANUP"
    await api.controller.free_slot("a")
    assert await state("a") == "COMPLETED"
    assert (await api.http.get("/adapter_runs/a")).json()["version"] is None


async def test_state_returns_the_registry_snapshot(api):
    await register(api, "a")
    api.controller.record_weight_update(["a"])
    body = (await api.http.get("/state")).json()
    assert body["active"]["a"]["version"] == 1 and body["pending"] == {} and body["cleanup"] == []


async def test_with_a_token_every_route_but_health_needs_it(tmp_path):
    async with service(tmp_path, api_token=TOKEN) as running:
        assert (await running.http.get("/health")).status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            assert (await running.http.get("/adapter_runs", headers=headers)).status_code == 401
            assert (await running.http.post("/control/retire_adapters", headers=headers)).status_code == 401
        ok = await running.http.get("/adapter_runs", headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 200


async def test_yaml_path_inside_the_adapters_folder_registers(tmp_path):
    (tmp_path / "math.yaml").write_text("task: reverse\nrank: 4\n")
    async with service(tmp_path, adapters_dir=tmp_path) as running:
        response = await running.http.post("/adapter_runs", json={"name": "math", "yaml_path": "math.yaml"})
        assert response.status_code == 200
        assert running.controller.adapter_status("math")["task"] == "reverse"


@pytest.mark.parametrize("path", ["../outside.yaml", "/etc/passwd", "missing.yaml"])
async def test_yaml_path_outside_the_adapters_folder_is_400(tmp_path, path):
    (tmp_path / "outside.yaml").write_text("rank: 4\n")
    adapters = tmp_path / "adapters"
    adapters.mkdir()
    async with service(tmp_path, adapters_dir=adapters) as running:
        response = await running.http.post("/adapter_runs", json={"name": "a", "yaml_path": path})
        assert response.status_code == 400


async def test_yaml_path_is_400_when_no_adapters_folder_is_configured(api):
    response = await api.http.post("/adapter_runs", json={"name": "a", "yaml_path": "a.yaml"})
    assert response.status_code == 400 and "--adapters-dir" in response.json()["detail"]


async def test_a_yaml_file_with_wrong_keys_is_422(tmp_path):
    (tmp_path / "bad.yaml").write_text("rnk: 4\n")
    async with service(tmp_path, adapters_dir=tmp_path) as running:
        response = await running.http.post("/adapter_runs", json={"name": "a", "yaml_path": "bad.yaml"})
        assert response.status_code == 422


async def test_the_client_drives_a_full_lifecycle_over_http(api):
    async with ControllerClient(api.url) as client:
        await client.register_adapter("a", {"rollout_batch_size": 2})
        await client.record_weight_update(["a"])
        await client.set_adapter_step("a", 5)
        await client.record_batch_adapters("r0", {"a": 2}, ["a"])
        assert await client.mark_batch_trained("r0") == ["a"]
        assert await client.adapter_step("a") == 6
        assert await client.resolve_num_step("a", 10) == 5
        assert (await client.snapshot()).active["a"].step == 6
        await client.deregister_adapter("a")
        assert await client.retire_adapters() == ["a"]
        assert await client.free_slot("a") == 0
        assert (await client.adapter_status("a"))["state"] == "COMPLETED"


async def test_the_client_raises_the_controllers_errors(api):
    async with ControllerClient(api.url) as client:
        await client.register_adapter("a", {})
        await client.register_adapter("b", {})
        with pytest.raises(NoFreeSlotError):
            await client.register_adapter("c", {})
        with pytest.raises(ValueError, match="already registered"):
            await client.register_adapter("a", {})
        with pytest.raises(UnknownAdapterError):
            await client.mark_batch_trained("never")


@pytest.mark.reliability
@pytest.mark.parametrize("field,raw", [("lr", "NaN"), ("alpha", "Infinity"), ("lr", "-Infinity")])
async def test_a_non_finite_number_is_400_naming_the_field(api, field, raw):
    body = '{"name": "a", "config": {"' + field + '": ' + raw + "}}"  # JSON as Python's parser reads it
    response = await api.http.post("/adapter_runs", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400 and f"{field} must be a finite number > 0" in response.json()["detail"]
    assert (await api.http.get("/state")).json()["pending"] == {}


@pytest.mark.reliability
@pytest.mark.parametrize("save", ["/etc/miles-adapter", "../../escape"])
async def test_a_save_folder_outside_the_run_is_400(api, save):
    response = await register(api, "a", save=save)
    assert response.status_code == 400 and "save must name a folder inside" in response.json()["detail"]


@pytest.mark.reliability
async def test_a_data_file_outside_the_run_is_400_and_says_nothing_of_its_existence(api):
    answers = [(await register(api, "a", data=path)).json()["detail"] for path in ("/etc/passwd", "/etc/no-such")]
    assert answers[0].replace("/etc/passwd", "PATH") == answers[1].replace("/etc/no-such", "PATH")
    assert "is not a readable file" in answers[0]


@pytest.mark.reliability
async def test_every_route_documents_its_status_codes_and_response_bodies(api):
    """The OpenAPI schema tells the truth: errors and 200 bodies have schemas."""
    paths = (await api.http.get("/openapi.json")).json()["paths"]
    for path, operations in paths.items():
        for method, operation in operations.items():
            codes = set(operation["responses"])
            assert "200" in codes and ("401" in codes or path == "/health"), (method, path, codes)
            for code, response in operation["responses"].items():
                assert response["content"]["application/json"]["schema"], (method, path, code)
    register_codes = set(paths["/adapter_runs"]["post"]["responses"])
    assert register_codes == {"200", "400", "401", "409", "422"}
    assert set(paths["/adapter_runs/{name}"]["get"]["responses"]) == {"200", "401", "404", "422"}
