"""JSON answers as SGLang writes them (sglang/srt/utils/json_response.py of the pinned release): orjson, compact,
non-string keys and numpy values allowed, NaN as null. Its /generate answers, whole and streamed, are written so,
which also skips FastAPI's jsonable_encoder walk of every token's logprob entry."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi.responses import Response

ORJSON_OPTIONS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY


def dumps_json(content: Any) -> bytes:
    return orjson.dumps(content, option=ORJSON_OPTIONS)


class OrjsonResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps_json(content)


def sse_event(payload: Any) -> bytes:
    """One server-sent event of a /generate stream: `data: <json>` and a blank line."""
    return b"data: " + dumps_json(payload) + b"\n\n"
