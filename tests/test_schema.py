"""The served OpenAPI document is the committed one: the contract cannot drift silently."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.test import Client

from board.api.serializers import (
    NUL_FREE_PATTERN,
    TIME_PATTERN,
    VISIBLE_PATTERN,
    TimeField,
    storable_text_error,
)

COMMITTED = Path(__file__).resolve().parent.parent / "board" / "api" / "openapi.yaml"
REGENERATE = (
    "python manage.py spectacular --api-version v1 --validate --fail-on-warn "
    "--file board/api/openapi.yaml"
)


@pytest.mark.django_db
def test_the_served_schema_is_the_committed_schema() -> None:
    response = Client().get("/api/v1/schema/")

    assert response.status_code == 200
    served = yaml.safe_load(response.content)
    committed = yaml.safe_load(COMMITTED.read_text())
    assert served == committed, (
        f"The API's schema differs from {COMMITTED.name}. If the change is intended, "
        f"regenerate it with: {REGENERATE}"
    )


@pytest.mark.django_db
def test_the_schema_and_the_docs_need_no_login() -> None:
    client = Client()

    assert client.get("/api/v1/schema/?format=json").status_code == 200
    docs = client.get("/api/v1/docs/")
    assert docs.status_code == 200
    assert b"swagger-ui" in docs.content


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("method", "path", "headers", "status"),
    [
        ("post", "/api/v1/schema/", {}, 405),
        ("delete", "/api/v1/docs/", {}, 405),
        ("post", "/api/v1/docs/", {}, 405),
        ("get", "/api/v1/schema/?format=bogus", {}, 404),
        ("get", "/api/v1/docs/?format=bogus", {}, 404),
        ("get", "/api/v1/schema/", {"HTTP_ACCEPT": "text/html"}, 406),
    ],
)
def test_the_schema_and_the_docs_refuse_with_the_apis_json_error(
    method: str, path: str, headers: dict[str, str], status: int
) -> None:
    response = getattr(Client(), method)(path, **headers)

    assert response.status_code == status, response.content
    assert response["Content-Type"] == "application/json"
    assert set(json.loads(response.content)) == {"error", "detail"}


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/api/v1/schema/", "/api/v1/docs/", "/api/v1/docs/?script="])
def test_the_schema_and_the_docs_answer_options_in_json(path: str) -> None:
    response = Client().options(path)

    assert response.status_code == 200, response.content
    assert response["Content-Type"] == "application/json"
    assert "GET" in response["Allow"]


def test_the_committed_schema_covers_every_contract_endpoint() -> None:
    paths = yaml.safe_load(COMMITTED.read_text())["paths"]
    expected = {
        ("/api/v1/tasks/", "post"),
        ("/api/v1/tasks/", "get"),
        ("/api/v1/tasks/{id}/", "get"),
        ("/api/v1/tasks/claim/", "post"),
        *(
            (f"/api/v1/tasks/{{id}}/{verb}/", "post")
            for verb in [
                "heartbeat",
                "complete",
                "fail",
                "release",
                "escalate",
                "requeue",
                "resolve",
                "cancel",
            ]
        ),
        ("/api/v1/tasks/{id}/events/", "get"),
        ("/api/v1/events/", "get"),
    }
    present = {(path, method) for path, item in paths.items() for method in item}
    assert expected <= present, f"missing from the schema: {sorted(expected - present)}"


# -- The document is exact: structural checks that keep it so ---------------------------

DOCUMENT: dict[str, Any] = yaml.safe_load(COMMITTED.read_text())
SCHEMAS: dict[str, Any] = DOCUMENT["components"]["schemas"]
OPERATIONS = {
    operation["operationId"]: (path, method, operation)
    for path, item in DOCUMENT["paths"].items()
    for method, operation in item.items()
}
HOLDER_ACTIONS = ["heartbeat", "complete", "fail", "release", "escalate"]
# The stream's resume id is any text: one the server does not know starts the stream now.
FREE_TEXT = {("stream", "Last-Event-ID"), ("stream", "lastEventId")}


def resolve(schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = SCHEMAS[schema["$ref"].rsplit("/", 1)[-1]]
    return schema


def links_to(links: dict[str, Any], operation_id: str) -> list[dict[str, Any]]:
    return [link for link in links.values() if link["operationId"] == operation_id]


def request_strings(schema: dict[str, Any], seen: set[str]) -> Iterator[dict[str, Any]]:
    """Every schema a request may hold a string in, following references once."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        if name not in seen:
            seen.add(name)
            yield from request_strings(SCHEMAS[name], seen)
        return
    types = schema.get("type", [])
    if "string" in ([types] if isinstance(types, str) else types):
        yield schema
    for key in ("properties", "patternProperties"):
        for sub in schema.get(key, {}).values():
            yield from request_strings(sub, seen)
    for key in ("items", "additionalProperties", "propertyNames"):
        if isinstance(schema.get(key), dict):
            yield from request_strings(schema[key], seen)
    for key in ("allOf", "anyOf", "oneOf"):
        for sub in schema.get(key, []):
            yield from request_strings(sub, seen)


def test_the_document_is_openapi_3_2() -> None:
    # JSON Schema 2020-12 (propertyNames for JSON keys) and itemSchema for the stream.
    assert DOCUMENT["openapi"].startswith("3.2.")


def test_every_holder_action_has_a_link_from_the_claim_that_carries_id_and_lease_token() -> None:
    links = OPERATIONS["tasks_claim_create"][2]["responses"]["200"]["links"]
    for action in HOLDER_ACTIONS:
        targets = [
            link for link in links.values() if link["operationId"] == f"tasks_{action}_create"
        ]
        assert targets, f"no link from the claim to {action}"
        [link] = targets
        assert link["parameters"] == {"id": "$response.body#/tasks/0/id"}
        assert link["requestBody"] == {"lease_token": "$response.body#/tasks/0/lease_token"}


def test_a_heartbeat_links_on_to_every_holder_action_with_the_same_lease() -> None:
    links = OPERATIONS["tasks_heartbeat_create"][2]["responses"]["200"]["links"]
    for action in HOLDER_ACTIONS:
        [link] = [
            link for link in links.values() if link["operationId"] == f"tasks_{action}_create"
        ]
        assert link["requestBody"] == {"lease_token": "$request.body#/lease_token"}


def test_a_created_task_links_to_its_reads_and_to_a_claim_from_its_queue() -> None:
    links = OPERATIONS["tasks_create"][2]["responses"]["201"]["links"]
    targets = {link["operationId"] for link in links.values()}
    assert {"tasks_retrieve", "tasks_events_retrieve", "events_list", "tasks_claim_create"} <= (
        targets
    )
    [claim] = links_to(links, "tasks_claim_create")
    assert claim["requestBody"] == {"queues": ["$response.body#/queue"]}


def test_every_link_names_an_operation_and_its_parameters() -> None:
    for source, (_, _, operation) in OPERATIONS.items():
        for status, response in operation["responses"].items():
            for name, link in response.get("links", {}).items():
                assert link["operationId"] in OPERATIONS, (source, status, name)
                target = OPERATIONS[link["operationId"]][2]
                declared = {p["name"] for p in target.get("parameters", [])}
                assert set(link.get("parameters", {})) <= declared, (source, status, name)
                if "requestBody" in link:
                    assert "requestBody" in target, (source, status, name)


def test_every_string_a_request_may_carry_states_what_the_server_refuses() -> None:
    # The server refuses NUL everywhere (PostgreSQL cannot store it): the schema says so.
    for operation_id, (_, _, operation) in OPERATIONS.items():
        schemas = [
            (parameter["name"], parameter["schema"])
            for parameter in operation.get("parameters", [])
            if (operation_id, parameter["name"]) not in FREE_TEXT
        ]
        for content in operation.get("requestBody", {}).get("content", {}).values():
            schemas.append(("body", content["schema"]))
        for name, schema in schemas:
            for string in request_strings(schema, set()):
                assert {"pattern", "enum", "const"} & set(string), (operation_id, name, string)
                if "pattern" in string:
                    assert re.search(string["pattern"], "a\x00b") is None, (operation_id, name)


def test_json_values_and_objects_refuse_nul_in_keys_and_strings_at_any_depth() -> None:
    value, obj = SCHEMAS["JSONValue"], SCHEMAS["JSONObject"]
    for schema in (value, obj):
        assert schema["propertyNames"] == {"pattern": NUL_FREE_PATTERN}
        assert schema["additionalProperties"] == {"$ref": "#/components/schemas/JSONValue"}
    assert value["pattern"] == NUL_FREE_PATTERN
    assert value["items"] == {"$ref": "#/components/schemas/JSONValue"}
    for name, field in [
        ("TaskCreateRequest", "payload"),
        ("CompleteRequest", "result"),
        ("HeartbeatRequest", "progress"),
        ("ResolveRequest", "result"),
    ]:
        assert SCHEMAS[name]["properties"][field]["$ref"].endswith(("/JSONValue", "/JSONObject"))


def test_every_operation_states_the_refusals_every_endpoint_can_make() -> None:
    for operation_id, (_, method, operation) in OPERATIONS.items():
        responses = operation["responses"]
        assert responses["401"]["headers"]["WWW-Authenticate"]["required"], operation_id
        assert responses["429"]["headers"]["Retry-After"]["required"], operation_id
        assert responses["503"]["headers"]["Retry-After"]["required"], operation_id
        if "requestBody" in operation:
            assert {"400", "413", "415"} <= set(responses), operation_id
        if any(p["in"] == "query" for p in operation.get("parameters", [])):
            assert "400" in responses, operation_id
        if method == "post":
            assert "403" in responses, operation_id
        for status, response in responses.items():
            if int(status) >= 400:
                schema = response["content"]["application/json"]["schema"]
                assert resolve(schema)["required"][:2] in (["detail", "error"],), operation_id


@pytest.mark.django_db
def test_every_operation_that_takes_a_body_refuses_one_that_is_not_json_as_documented(
    api: Any,
) -> None:
    """What the server answers to a body sent as text, on every operation with a body:
    the documented 415, with nothing done."""
    from board import transitions
    from board.models import Task
    from tests.factories import UserFactory

    user = UserFactory.create(username="root", is_staff=True, is_superuser=True)
    task = transitions.create(actor=user, title="aimed at")
    client = api(user)
    for operation_id, (path, method, operation) in OPERATIONS.items():
        if "requestBody" not in operation:
            continue
        url = re.sub(r"\{(id|task_id)\}", str(task.pk), path).replace("{name}", "q")
        assert "{" not in url, url
        response = client.generic(method.upper(), url, "title=plain", content_type="text/plain")
        assert response.status_code == 415, (operation_id, response.content)
        assert "415" in operation["responses"], operation_id
        assert response.json()["error"] == "unsupported_media_type", operation_id
    assert list(Task.objects.values_list("pk", flat=True)) == [task.pk]


def test_the_stream_is_a_sequence_of_events_whose_data_is_an_event() -> None:
    content = OPERATIONS["stream"][2]["responses"]["200"]["content"]["text/event-stream"]
    item = content["itemSchema"]
    assert "schema" not in content  # in 3.2 it would describe the whole stream
    assert item["properties"]["event"] == {"const": "task_event"}
    assert item["properties"]["data"]["contentMediaType"] == "application/json"
    assert item["properties"]["data"]["contentSchema"] == {"$ref": "#/components/schemas/Event"}
    assert set(item["required"]) == {"event", "data", "id"}


@pytest.mark.parametrize(
    ("pattern", "accepts"),
    [
        (NUL_FREE_PATTERN, lambda text: storable_text_error(text) is None),
        (VISIBLE_PATTERN, lambda text: storable_text_error(text) is None and not text.isspace()),
    ],
)
def test_each_text_pattern_is_the_rule_the_server_applies(pattern: str, accepts: Any) -> None:
    # Every character Python calls whitespace, NUL, and their neighbours, alone and mixed.
    alphabet = [chr(c) for c in range(0x110000) if chr(c).isspace()]
    alphabet += ["\x00", "a", "\x1b", "\u200b", "\ufeff", "\U0001f600"]
    texts = [a + b for a in alphabet for b in ["", *alphabet]]
    for text in texts:
        if text:
            assert (re.search(pattern, text) is not None) == accepts(text), repr(text)


def test_the_time_pattern_is_the_rule_the_server_applies() -> None:
    field = TimeField()
    start = datetime(2, 1, 1, tzinfo=UTC)
    for days in range(0, 9996 * 365, 997):  # every few years, from year 2 to 9998
        moment = start + timedelta(days=days, seconds=days % 86400)
        for text in (moment.isoformat(), moment.isoformat().replace("+00:00", "Z")):
            assert re.search(TIME_PATTERN, text), text
            assert field.to_internal_value(text)
    for day in range(1, 32):
        for month in range(1, 13):
            for year in (1900, 2000, 2023, 2024):
                text = f"{year}-{month:02d}-{day:02d}T00:00:00Z"
                try:
                    date(year, month, day)
                    valid = True
                except ValueError:
                    valid = False
                assert (re.search(TIME_PATTERN, text) is not None) == valid, text
