"""Additions to the generated OpenAPI document for what is not a DRF view."""

from __future__ import annotations

from typing import Any

from drf_spectacular.openapi import AutoSchema

STREAM_PATH = {
    "get": {
        "operationId": "stream",
        "summary": "Every event, live, as server-sent events",
        "description": (
            "A `text/event-stream` of every event, each sent as `id: <resume id>`, "
            "`event: task_event`, `data: <Event JSON>`. Reconnect with the last id received "
            "(the `Last-Event-ID` header, which EventSource sends itself, or `lastEventId`) "
            "to be replayed every event missed, in order, none twice, also across server "
            "restarts. Comment lines keep the connection alive at least every 30 s. "
            "Without a resume id the stream starts with the next event."
        ),
        "tags": ["stream"],
        "parameters": [
            {
                "in": "header",
                "name": "Last-Event-ID",
                "schema": {"type": "string"},
                "description": "Resume after this event.",
            },
            {
                "in": "query",
                "name": "lastEventId",
                "schema": {"type": "string"},
                "description": "Resume after this event (for clients that cannot set headers).",
            },
        ],
        "security": [{"bearerAuth": []}, {"cookieAuth": []}],
        "responses": {
            "200": {
                "description": "The event stream; see the Event schema for each `data:` line.",
                "content": {"text/event-stream": {"schema": {"type": "string"}}},
            },
            "401": {
                "description": "No credentials.",
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
            },
        },
    }
}


def add_stream_endpoint(result: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    """drf-spectacular postprocessing hook: document GET /api/v1/stream/."""
    result.setdefault("paths", {})["/api/v1/stream/"] = STREAM_PATH
    return result


THROTTLED = {
    "description": (
        "Throttled: too many failed authentications (401 answers, failed logins) came from "
        "this client address in the current window (by default 30 a minute). Every request "
        "from it that authenticates is refused until the window ends, a valid token "
        "included; the request had no effect. Successful requests never count."
    ),
    "headers": {
        "Retry-After": {
            "description": "Seconds until the window ends and the address may try again.",
            "schema": {"type": "integer", "minimum": 1},
        }
    },
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
}


def add_throttled_responses(result: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    """drf-spectacular postprocessing hook: the 429 of access.throttle, described once, on
    every operation that authenticates."""
    result.setdefault("components", {}).setdefault("responses", {})["Throttled"] = THROTTLED
    for operations in result.get("paths", {}).values():
        for operation in operations.values():
            security = operation.get("security") if isinstance(operation, dict) else None
            if security and {} not in security:
                operation["responses"]["429"] = {"$ref": "#/components/responses/Throttled"}
    return result


class BoardAutoSchema(AutoSchema):
    """drf-spectacular's AutoSchema, told that list endpoints answer a page object
    (``{"results": [...], "next": ...}``), never a bare array."""

    def _is_list_view(self, serializer: Any = None) -> bool:
        return False
