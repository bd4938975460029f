"""The driver's and rollout's handle on a controller service in another process: the controller's methods,
each one HTTP call (what a Ray actor handle would be, without Ray). Errors come back typed as the controller
raises them: ValueError (400), UnknownAdapterError (404), NoFreeSlotError (409); anything else is an
httpx.HTTPStatusError."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any

from miles_runner.multi_lora.registry import NoFreeSlotError, RegistrySnapshot, UnknownAdapterError
from miles_runner.sglang_client.client import http_client

ERRORS_BY_STATUS: dict[int, type[Exception]] = {400: ValueError, 404: UnknownAdapterError, 409: NoFreeSlotError}


class ControllerClient:
    def __init__(self, base_url: str, *, api_token: str | None = None, timeout_s: float = 30.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = http_client(
            self.base_url, timeout_s=timeout_s, headers={"Authorization": f"Bearer {api_token}"} if api_token else None
        )

    async def register_adapter(self, name: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
        return await self._call("POST", "/adapter_runs", {"name": name, "config": dict(overrides)})

    async def deregister_adapter(self, name: str) -> None:
        await self._call("DELETE", f"/adapter_runs/{name}")

    async def retire_adapters(self) -> list[str]:
        return (await self._call("POST", "/control/retire_adapters"))["names"]

    async def free_slot(self, name: str) -> int:
        return (await self._call("POST", "/control/free_slot", {"name": name}))["slot"]

    async def record_weight_update(self, names: Iterable[str]) -> None:
        await self._call("POST", "/control/record_weight_update", {"names": list(names)})

    async def record_batch_adapters(
        self, rollout_id: str, group_counts: Mapping[str, int], step_names: Iterable[str]
    ) -> None:
        body = {"rollout_id": rollout_id, "group_counts": dict(group_counts), "step_names": list(step_names)}
        await self._call("POST", "/control/record_batch_adapters", body)

    async def mark_batch_trained(self, rollout_id: str) -> list[str]:
        return (await self._call("POST", "/control/mark_batch_trained", {"rollout_id": rollout_id}))["names"]

    async def resolve_num_step(self, name: str, rows: int) -> int:
        return (await self._call("POST", "/control/resolve_num_step", {"name": name, "rows": rows}))["num_step"]

    async def set_adapter_step(self, name: str, step: int) -> None:
        await self._call("POST", "/control/set_adapter_step", {"name": name, "step": step})

    async def adapter_step(self, name: str) -> int:
        return (await self._call("GET", f"/control/adapter_step/{name}"))["step"]

    async def snapshot(self) -> RegistrySnapshot:
        return RegistrySnapshot.from_dict(await self._call("GET", "/state"))

    async def adapter_status(self, name: str) -> dict[str, Any]:
        return await self._call("GET", f"/adapter_runs/{name}")

    async def _call(self, method: str, path: str, body: Any = None) -> Any:
        response = await self._http.request(method, path, json=body)
        error = ERRORS_BY_STATUS.get(response.status_code)
        if error is not None:
            raise error(response.json().get("detail", response.text))
        response.raise_for_status()
        return response.json()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> ControllerClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
