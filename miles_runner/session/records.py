"""What the session keeps of each turn: the exact upstream request and the full upstream response."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class SessionRecord:
    timestamp: float
    request_timestamp: float
    method: str
    path: str
    request: dict[str, Any]
    response: dict[str, Any]
    status_code: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def choice(self) -> dict[str, Any]:
        return self.response["choices"][0]

    @property
    def meta_info(self) -> dict[str, Any]:
        return self.choice["meta_info"]

    @property
    def prompt_ids(self) -> list[int]:
        return self.request["input_ids"]

    @property
    def output_ids(self) -> list[int]:
        return [entry[1] for entry in self.meta_info["output_token_logprobs"]]

    @property
    def output_logprobs(self) -> list[float]:
        return [float(entry[0]) for entry in self.meta_info["output_token_logprobs"]]
