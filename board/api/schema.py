"""The OpenAPI document beyond what drf-spectacular finds in the views: the text and JSON
rules the serializers enforce, the refusals every endpoint can answer, the event stream,
and the links a client (or a stateful fuzzer) follows from a created or claimed task to
its actions.

The document is OpenAPI 3.2: its schemas are JSON Schema 2020-12, which can say that no
string of a JSON value, object keys included, holds a NUL (``propertyNames``), and
``itemSchema`` describes the stream as a sequence of events whose ``data`` is an Event.
tests/test_fuzz.py holds the server to it with schemathesis and every check.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from drf_spectacular.extensions import OpenApiSerializerFieldExtension
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.plumbing import is_list_serializer

from board.api.serializers import (
    MAX_JSON_DEPTH,
    NUL_FREE_PATTERN,
    TIME_PATTERN,
    VISIBLE_PATTERN,
    StrictCharField,
    StrictRegexField,
)

API = "/api/v1"


def ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


# -- Text and JSON ----------------------------------------------------------------------

JSON_VALUE = {
    "description": (
        "Any JSON value that PostgreSQL's jsonb can store: no string in it, object keys "
        "included, contains the NUL character (\\u0000), and arrays and objects nest at "
        f"most {MAX_JSON_DEPTH} levels deep."
    ),
    "type": ["object", "array", "string", "number", "boolean", "null"],
    "pattern": NUL_FREE_PATTERN,
    "propertyNames": {"pattern": NUL_FREE_PATTERN},
    "additionalProperties": ref("JSONValue"),
    "items": ref("JSONValue"),
}

JSON_OBJECT = {
    "description": (
        "A JSON object whose keys and strings, at any depth, contain no NUL character "
        f"(\\u0000), with arrays and objects nested at most {MAX_JSON_DEPTH} levels deep "
        "(the object itself is the first)."
    ),
    "type": "object",
    "propertyNames": {"pattern": NUL_FREE_PATTERN},
    "additionalProperties": ref("JSONValue"),
}


class StrictTextFieldExtension(OpenApiSerializerFieldExtension):
    """State the text rules of StrictCharField: no NUL, and for ``visible`` fields at
    least one character that is not whitespace."""

    target_class = "board.api.serializers.StrictCharField"
    match_subclasses = True

    def map_serializer_field(self, auto_schema: AutoSchema, direction: Any) -> dict[str, Any]:
        # drf-spectacular adds the rest: nullable, minLength, maxLength, the description.
        if isinstance(self.target, StrictRegexField):  # (its own pattern is stricter)
            return {"type": "string"}
        return {
            "type": "string",
            "pattern": VISIBLE_PATTERN if self.target.visible else NUL_FREE_PATTERN,
        }


class TimeFieldExtension(OpenApiSerializerFieldExtension):
    """State TimeField's rule: the pattern asserts what ``format: date-time`` only names
    (in JSON Schema 2020-12 a format is an annotation)."""

    target_class = "board.api.serializers.TimeField"

    def map_serializer_field(self, auto_schema: AutoSchema, direction: Any) -> dict[str, Any]:
        return {"type": "string", "format": "date-time", "pattern": TIME_PATTERN}


class UniqueListFieldExtension(OpenApiSerializerFieldExtension):
    """State UniqueListField's rule: no item twice (``uniqueItems``)."""

    target_class = "board.api.serializers.UniqueListField"

    def map_serializer_field(self, auto_schema: AutoSchema, direction: Any) -> dict[str, Any]:
        schema = auto_schema._map_serializer_field(self.target, direction, bypass_extensions=True)
        return {**schema, "uniqueItems": True}


class JSONValueFieldExtension(OpenApiSerializerFieldExtension):
    target_class = "board.api.serializers.AnyJSONField"

    def get_name(self) -> str:
        return "JSONValue"

    def map_serializer_field(self, auto_schema: AutoSchema, direction: Any) -> dict[str, Any]:
        return copy.deepcopy(JSON_VALUE)


class JSONObjectFieldExtension(OpenApiSerializerFieldExtension):
    target_class = "board.api.serializers.JSONObjectField"

    def get_name(self) -> str:
        return "JSONObject"

    def map_serializer_field(self, auto_schema: AutoSchema, direction: Any) -> dict[str, Any]:
        return copy.deepcopy(JSON_OBJECT)


class BoardAutoSchema(AutoSchema):
    """drf-spectacular's AutoSchema, told that list endpoints answer what they declare: a
    page object (``{"results": [...], "next": ...}``) for tasks and events, a bare array
    only where the response is declared ``many=True`` (queues/, agents/)."""

    def _is_list_view(self, serializer: Any = None) -> bool:
        return serializer is not None and is_list_serializer(serializer)

    def _insert_field_validators(self, field: Any, schema: dict[str, Any]) -> None:
        super()._insert_field_validators(field, schema)  # type: ignore[no-untyped-call]
        # drf-spectacular offers "" as a second choice (oneOf) beside a pattern; the text
        # patterns above accept "" already, and a oneOf that matches twice matches nothing.
        blank = {"type": "string", "maxLength": 0}
        if isinstance(field, StrictCharField) and schema.get("oneOf", [None])[-1] == blank:
            [inner, _] = schema.pop("oneOf")
            schema.update(inner)


# -- The event stream -------------------------------------------------------------------


def error_content() -> dict[str, Any]:
    return {"application/json": {"schema": ref("Error")}}


EXAMPLE_TASK = {
    "id": 7,
    "title": "Resize the images",
    "description": "",
    "payload": {},
    "queue": "default",
    "priority": 0,
    "max_failures": 3,
    "run_after": None,
    "status": "in_progress",
    "failure_count": 0,
    "leased_by": "agent-1",
    "leased_until": "2026-12-01T12:02:00.000000Z",
    "lease_expired": False,
    "result": None,
    "last_error": None,
    "created_by": "ops-alice",
    "created_at": "2026-12-01T11:59:00.000000Z",
    "updated_at": "2026-12-01T12:00:00.000000Z",
    "depends_on": [],
    "blocked": False,
    "parent_id": None,
    "progress": None,
    "max_attempt_seconds": None,
    "attempt_started_at": "2026-12-01T12:00:00.000000Z",
    "idempotency_key": None,
}
EXAMPLE_EVENT = {
    "id": 42,
    "task_id": 7,
    "type": "claimed",
    "status": "in_progress",
    "actor": "agent-1",
    "payload": {"lease_until": "2026-12-01T12:02:00+00:00"},
    "created_at": "2026-12-01T12:00:00.000000Z",
    "task": EXAMPLE_TASK,
}
STREAM_EXAMPLE = (
    "retry: 1000\nid: 41\n: connected\n\n"
    f"id: 42\nevent: task_event\ndata: {json.dumps(EXAMPLE_EVENT)}\n\n"
    ": keep-alive\n\n"
)

STREAM_PATH = {
    "get": {
        "operationId": "stream",
        "summary": "Every event, live, as server-sent events",
        "description": (
            "A `text/event-stream` of every event, each sent as `id: <resume id>`, "
            "`event: task_event`, `data: <Event JSON>`, the Event with one more field: `task`, the "
            "task as it is after the event, a Task (null when a later event of the task has "
            "already committed: that one, which follows on the stream, carries it). "
            "The task's `description`, `payload`, `result`, `progress` and `last_error`, "
            "and the values of the Event's `payload`, are sent only when each is at most "
            "8 KiB as JSON; a larger one is null and named in `elided` (the task's, or "
            "the Event's), present only then: read the task, or its events, for it. No "
            "event's data is over 64 KiB. "
            "Reconnect with the last id received "
            "(the `Last-Event-ID` header, which EventSource sends itself, or `lastEventId`) "
            "to be replayed every event missed, in order, none twice, also across server "
            "restarts. The stream opens with `retry:` and an `id:` without data, the "
            "position it starts from (EventSource takes it as its last id and dispatches "
            "nothing), so a client whose connection drops before its first event resumes "
            "without a gap. Comment lines keep the connection alive at least every 30 s. "
            "Without a resume id, or with one the server does not know, the stream starts "
            "with the next event."
        ),
        "tags": ["stream"],
        "parameters": [
            {
                "in": "header",
                "name": "Last-Event-ID",
                "schema": {"type": "string"},
                "description": "Resume after this event.",
                "example": "0",
            },
            {
                "in": "query",
                "name": "lastEventId",
                "schema": {"type": "string"},
                "description": (
                    "Resume after this event (for clients that cannot set headers). "
                    "`0` replays the whole log."
                ),
                "example": "0",
            },
        ],
        "security": [{"bearerAuth": []}, {"cookieAuth": []}],
        "responses": {
            "400": {
                "description": "`lastEventId` given more than once.",
                "content": {"application/json": {"schema": ref("ValidationError")}},
            },
            "200": {
                "description": (
                    "The event stream, which does not end: one `task_event` per event, its "
                    "`data` an Event with its `task` (a Task or null), its `id` the Event's id, to "
                    "resume from."
                ),
                "content": {
                    "text/event-stream": {
                        "example": STREAM_EXAMPLE,
                        "itemSchema": {
                            "type": "object",
                            "required": ["event", "data", "id"],
                            "properties": {
                                "event": {"const": "task_event"},
                                "data": {
                                    "type": "string",
                                    "contentMediaType": "application/json",
                                    "contentSchema": ref("Event"),
                                },
                                "id": {
                                    "type": "string",
                                    "pattern": "^[0-9]+$",
                                    "description": "The resume id: the Event's id.",
                                },
                                "retry": {"type": "integer", "minimum": 0},
                            },
                        },
                    }
                },
            },
        },
    }
}


# -- Links: from a created or claimed task to what can be done with it next -----------------

HOLDER_ACTIONS = ("heartbeat", "complete", "fail", "release", "escalate")
STAFF_ACTIONS = ("requeue", "resolve", "cancel")


def operation_id(action: str) -> str:
    return {"read": "tasks_retrieve", "events": "tasks_events_retrieve"}.get(
        action, f"tasks_{action}_create"
    )


def link(target: str, task_id: str, lease_token: str | None = None) -> dict[str, Any]:
    """A link to ``target`` on the task named by ``task_id`` (a runtime expression),
    presenting the lease named by ``lease_token`` in the body."""
    value: dict[str, Any] = {"operationId": operation_id(target), "parameters": {"id": task_id}}
    if lease_token is not None:
        value["requestBody"] = {"lease_token": lease_token}
        value["description"] = f"{target.capitalize()} the task, with its lease."
    elif target == "events":
        value["description"] = "This task's events."
    else:
        value["description"] = f"{target.capitalize()} this task."
    return value


def links_from(
    task_id: str, *, lease_token: str | None = None, actions: tuple[str, ...] = ()
) -> dict[str, Any]:
    links = {
        "read": link("read", task_id),
        "events": link("events", task_id),
    }
    links["event_log"] = {
        "operationId": "events_list",
        "parameters": {"task": task_id},
        "description": "This task's events in the event log.",
    }
    for action in actions:
        if action in HOLDER_ACTIONS:
            links[action] = link(action, task_id, lease_token)
        else:
            links[action] = link(action, task_id)
    return links


# Which response of which operation links to what. Holder actions carry the lease token:
# from the claim, or on from a heartbeat, which keeps the same lease.
RESPONSE_LINKS: dict[tuple[str, str], dict[str, Any]] = {
    ("tasks_create", "201"): {
        **links_from("$response.body#/id", actions=("cancel",)),
        "claim": {
            "operationId": "tasks_claim_create",
            "requestBody": {"queues": ["$response.body#/queue"]},
            "description": "Claim from this task's queue.",
        },
    },
    ("tasks_claim_create", "200"): links_from(
        "$response.body#/tasks/0/id",
        lease_token="$response.body#/tasks/0/lease_token",
        actions=HOLDER_ACTIONS,
    ),
    ("tasks_heartbeat_create", "200"): links_from(
        "$request.path.id", lease_token="$request.body#/lease_token", actions=HOLDER_ACTIONS
    ),
    # An escalated task waits for the staff; a finished one may be requeued.
    ("tasks_escalate_create", "200"): links_from("$response.body#/id", actions=STAFF_ACTIONS),
    ("tasks_complete_create", "200"): links_from("$response.body#/id", actions=("requeue",)),
    ("tasks_fail_create", "200"): links_from("$response.body#/id", actions=STAFF_ACTIONS),
    ("tasks_release_create", "200"): links_from("$response.body#/id", actions=("cancel",)),
    ("tasks_cancel_create", "200"): links_from("$response.body#/id", actions=("requeue",)),
    ("tasks_requeue_create", "200"): links_from("$response.body#/id", actions=("cancel",)),
    ("tasks_resolve_create", "200"): links_from("$response.body#/id", actions=("requeue",)),
}


# -- Refusals every endpoint can answer ----------------------------------------------------


def retry_after(description: str) -> dict[str, Any]:
    return {
        "required": True,
        "schema": {"type": "string", "pattern": "^[0-9]+$"},
        "description": description,
    }


def common_responses(operation: dict[str, Any], method: str) -> dict[str, Any]:
    responses: dict[str, Any] = {
        "401": {
            "description": "No credentials, or a token that is not valid.",
            "headers": {
                "WWW-Authenticate": {
                    "required": True,
                    "schema": {"type": "string"},
                    "description": 'The scheme to use: `Bearer realm="taskboard"`.',
                }
            },
            "content": error_content(),
        },
        "429": {
            "description": (
                "Too many failed authentications from this address "
                "(`TASKBOARD_AUTH_FAILURE_LIMIT` within `TASKBOARD_AUTH_FAILURE_WINDOW_SECONDS`, "
                "by default 30 a minute): wait `Retry-After` seconds, also with a valid token."
            ),
            "headers": {"Retry-After": retry_after("Seconds to wait before trying again.")},
            "content": error_content(),
        },
        "503": {
            "description": "The database is unavailable: try again shortly.",
            "headers": {"Retry-After": retry_after("Seconds to wait before trying again.")},
            "content": error_content(),
        },
    }
    if method == "post":
        responses["403"] = {
            "description": "A session's request without its CSRF token.",
            "content": error_content(),
        }
    if "requestBody" in operation:
        responses["408"] = {
            "description": (
                "The body did not arrive in full within `TASKBOARD_BODY_TIMEOUT` seconds "
                "(`request_timeout`); nothing was done."
            ),
            "content": error_content(),
        }
        responses["413"] = {
            "description": "The body is larger than 1 MiB.",
            "content": error_content(),
        }
        responses["415"] = {
            "description": (
                "The body is not sent as JSON (a `Content-Type` other than "
                "`application/json`: `unsupported_media_type`); nothing was done."
            ),
            "content": error_content(),
        }
    return responses


def postprocess(result: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    """drf-spectacular postprocessing hook: add the stream, the links and the refusals
    every endpoint can answer."""
    paths = result.setdefault("paths", {})
    paths[f"{API}/stream/"] = copy.deepcopy(STREAM_PATH)
    for item in paths.values():
        for method, operation in item.items():
            responses = operation.setdefault("responses", {})
            for status, response in common_responses(operation, method).items():
                if status in responses:
                    if response["description"] not in responses[status]["description"]:
                        responses[status]["description"] += " Or: " + response["description"]
                    for name, header in response.get("headers", {}).items():
                        responses[status].setdefault("headers", {}).setdefault(name, header)
                else:
                    responses[status] = response
            for status, response in responses.items():
                links = RESPONSE_LINKS.get((operation["operationId"], status))
                if links:
                    response["links"] = copy.deepcopy(links)
            operation["responses"] = dict(sorted(responses.items()))
    result["paths"] = dict(sorted(paths.items()))
    return result
