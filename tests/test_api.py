"""The HTTP API v1, checked against its contract (board/api/openapi.yaml and
docs/reference/http-api.md): every endpoint's success shape and every refusal it names."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

import httpx
import pytest
from django.db import connection
from django.utils import timezone
from rest_framework.test import APIClient

from board import transitions
from board.models import Task, TaskEvent
from tests.factories import StaffFactory, TokenFactory, UserFactory, grant
from tests.live import LiveServer

API = "/api/v1"

TASK_FIELDS = {
    "id",
    "title",
    "description",
    "payload",
    "queue",
    "priority",
    "max_failures",
    "run_after",
    "status",
    "failure_count",
    "leased_by",
    "leased_until",
    "lease_expired",
    "result",
    "last_error",
    "created_by",
    "created_at",
    "updated_at",
    # Additions to v1: work graphs and idempotent create.
    "depends_on",
    "blocked",
    "parent_id",
    "progress",
    "max_attempt_seconds",
    "attempt_started_at",
    "idempotency_key",
    # Second round: humans in the loop.
    "assignee",
    "requires",
    "question",
    "answers",
}
EVENT_FIELDS = {"id", "task_id", "type", "status", "actor", "payload", "created_at"}

# What each lease-holder action needs in its body besides the lease_token.
HOLDER_ACTIONS: dict[str, dict[str, Any]] = {
    "heartbeat": {"lease_seconds": 300, "progress": {"done": 1}},
    "complete": {"result": {"answer": 42}},
    "fail": {"error": "it broke"},
    "release": {},
    "escalate": {"reason": "needs a human"},
}
STAFF_ACTIONS = {"requeue": {}, "resolve": {"result": 1}, "cancel": {}}

MIB = 1024 * 1024

pytestmark = pytest.mark.usefixtures("fast_password_hashing")


# -- Helpers ----------------------------------------------------------------------------


def post(client: APIClient, path: str, body: Any = None, **extra: Any) -> Any:
    return client.post(f"{API}/{path}", {} if body is None else body, format="json", **extra)


def get(client: APIClient, path: str, **params: Any) -> Any:
    return client.get(f"{API}/{path}", params)


def assert_error(response: Any, status: int, code: str | None = None) -> dict[str, Any]:
    """Assert the contract's error body: JSON with a string "error" and "detail"."""
    assert response.status_code == status, response.content
    assert response["Content-Type"].startswith("application/json"), response["Content-Type"]
    body: dict[str, Any] = json.loads(response.content)
    assert isinstance(body.get("error"), str) and body["error"], body
    assert isinstance(body.get("detail"), str) and body["detail"], body
    if code is not None:
        assert body["error"] == code, body
    return body


class HttpxResponse:
    """Let assert_error read an httpx response like a Django test response."""

    def __init__(self, response: httpx.Response) -> None:
        self.status_code = response.status_code
        self.content = response.content
        self.headers = response.headers

    def __getitem__(self, name: str) -> str:
        return str(self.headers[name])


def assert_invalid(response: Any, *fields: str) -> dict[str, Any]:
    """Assert a 400 ``invalid`` whose ``fields`` names each of ``fields``."""
    body = assert_error(response, 400, "invalid")
    assert isinstance(body.get("fields"), dict), body
    for name in fields:
        assert name in body["fields"], body
        messages = body["fields"][name]
        assert messages and all(isinstance(m, str) for m in messages), body
    return body


def parse_time(value: str) -> datetime:
    parsed = datetime.fromisoformat(value)
    assert parsed.tzinfo is not None, f"{value} has no UTC offset"
    return parsed


def claim(client: APIClient, **body: Any) -> list[dict[str, Any]]:
    response = post(client, "tasks/claim/", body)
    assert response.status_code == 200, response.content
    return list(response.json()["tasks"])


def create(client: APIClient, **body: Any) -> dict[str, Any]:
    response = post(client, "tasks/", {"title": "t", **body})
    assert response.status_code == 201, response.content
    return dict(response.json())


def claim_one(client: APIClient, **body: Any) -> dict[str, Any]:
    tasks = claim(client, **body)
    assert len(tasks) == 1, tasks
    return tasks[0]


def expire_lease(task_id: int) -> None:
    """Move the task's lease deadline into the past (tests only: now() is frozen here)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE tasks SET leased_until = now() - interval '1 minute' WHERE id = %s",
            [task_id],
        )


def history(task_id: int) -> list[tuple[str, str, str]]:
    """Return the task's events as (type, status, actor), oldest first."""
    return list(
        TaskEvent.objects.filter(task_id=task_id)
        .order_by("id")
        .values_list("type", "status", "actor")
    )


def escalated_task(make_task: Callable[..., Any], client: APIClient) -> int:
    """Return the id of a task escalated by its one allowed failure."""
    task = make_task(max_failures=1)
    token = claim_one(client)["lease_token"]
    response = post(client, f"tasks/{task.id}/fail/", {"lease_token": token, "error": "boom"})
    assert response.json()["status"] == "escalated"
    return int(task.id)


def walk_pages(client: APIClient, first_url: str) -> list[list[dict[str, Any]]]:
    """Follow ``next`` from ``first_url`` and return every page's results."""
    pages, url = [], first_url
    while url is not None:
        response = client.get(url)
        assert response.status_code == 200, response.content
        body = response.json()
        assert set(body) == {"results", "next"}
        pages.append(body["results"])
        url = body["next"]
        assert len(pages) < 50, "next never ends"
    return pages


@pytest.fixture
def other_api(api: Callable[[Any], APIClient], other_agent: Any) -> APIClient:
    return api(other_agent)


@pytest.fixture
def staff_api(api: Callable[[Any], APIClient], staff: Any) -> APIClient:
    """A staff member who may triage: requeue, resolve and cancel."""
    return api(grant(staff, "escalations.triage_task"))


@pytest.fixture
def held(make_task: Callable[..., Any], agent_api: APIClient) -> tuple[int, str]:
    """A task claimed by ``agent``: (task id, lease token)."""
    task = make_task(title="held task")
    claimed = claim_one(agent_api)
    assert claimed["id"] == task.id
    return int(task.id), str(claimed["lease_token"])


# -- Create -----------------------------------------------------------------------------


def test_it_creates_a_task_with_the_contract_defaults(agent_api: APIClient) -> None:
    response = post(agent_api, "tasks/", {"title": "Write the report"})

    assert response.status_code == 201, response.content
    task = response.json()
    assert set(task) == TASK_FIELDS
    assert isinstance(task["id"], int)
    assert {k: v for k, v in task.items() if k not in {"id", "created_at", "updated_at"}} == {
        "title": "Write the report",
        "description": "",
        "payload": {},
        "queue": "default",
        "priority": 0,
        "max_failures": 3,
        "run_after": None,
        "status": "pending",
        "failure_count": 0,
        "leased_by": None,
        "leased_until": None,
        "lease_expired": False,
        "result": None,
        "last_error": None,
        "created_by": "agent-smith",
        "depends_on": [],
        "blocked": False,
        "parent_id": None,
        "progress": None,
        "max_attempt_seconds": None,
        "attempt_started_at": None,
        "idempotency_key": None,
        "assignee": None,
        "requires": [],
        "question": None,
        "answers": [],
    }
    assert abs(parse_time(task["created_at"]) - timezone.now()) < timedelta(minutes=5)
    parse_time(task["updated_at"])


def test_it_creates_a_task_with_every_optional_field(agent_api: APIClient) -> None:
    body: dict[str, Any] = {
        "title": "t" * 200,
        "description": "Fetch the page and summarise it.",
        "payload": {"url": "https://example.com", "nested": {"list": [1, 2.5, None, True]}},
        "queue": "etl_v2-" + "q" * 57,
        "priority": -1000,
        "max_failures": 100,
        "run_after": "2030-01-01T12:00:00+02:00",
    }
    response = post(agent_api, "tasks/", body)

    assert response.status_code == 201, response.content
    task = response.json()
    for field in ("title", "description", "payload", "queue", "priority", "max_failures"):
        assert task[field] == body[field], field
    assert parse_time(task["run_after"]) == parse_time(body["run_after"])
    assert get(agent_api, f"tasks/{task['id']}/").json() == task


@pytest.mark.parametrize(
    ("field", "value"),
    [("priority", 1000), ("priority", -1000), ("max_failures", 1), ("queue", "a"), ("queue", "0")],
)
def test_it_accepts_the_edges_of_each_range(agent_api: APIClient, field: str, value: Any) -> None:
    response = post(agent_api, "tasks/", {"title": "edge", field: value})

    assert response.status_code == 201, response.content
    assert response.json()[field] == value


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "title"),
        ({"title": ""}, "title"),
        ({"title": "   "}, "title"),
        ({"title": "x" * 201}, "title"),
        ({"title": None}, "title"),
        ({"title": 42}, "title"),
        ({"title": "ok", "queue": "Default"}, "queue"),
        ({"title": "ok", "queue": ""}, "queue"),
        ({"title": "ok", "queue": "q" * 65}, "queue"),
        ({"title": "ok", "queue": "two words"}, "queue"),
        ({"title": "ok", "queue": "dots.not.allowed"}, "queue"),
        ({"title": "ok", "queue": "new\nline"}, "queue"),
        ({"title": "ok", "queue": 7}, "queue"),
        ({"title": "ok", "priority": 1001}, "priority"),
        ({"title": "ok", "priority": -1001}, "priority"),
        ({"title": "ok", "priority": "5"}, "priority"),
        ({"title": "ok", "priority": 1.5}, "priority"),
        ({"title": "ok", "priority": True}, "priority"),
        ({"title": "ok", "max_failures": 0}, "max_failures"),
        ({"title": "ok", "max_failures": 101}, "max_failures"),
        ({"title": "ok", "max_failures": "3"}, "max_failures"),
        ({"title": "ok", "payload": []}, "payload"),
        ({"title": "ok", "payload": "text"}, "payload"),
        ({"title": "ok", "payload": 3}, "payload"),
        ({"title": "ok", "payload": None}, "payload"),
        ({"title": "ok", "run_after": "tomorrow"}, "run_after"),
    ],
)
def test_it_refuses_an_invalid_task_with_400_and_the_field(
    agent_api: APIClient, body: dict[str, Any], field: str
) -> None:
    response = post(agent_api, "tasks/", body)

    assert_invalid(response, field)
    assert not Task.objects.exists()


def test_it_refuses_a_malformed_json_body_with_400(agent_api: APIClient) -> None:
    response = agent_api.post(
        f"{API}/tasks/", data='{"title": "cut off', content_type="application/json"
    )

    body = assert_invalid(response)
    assert body["fields"]
    assert not Task.objects.exists()


def test_it_refuses_a_body_that_is_not_a_json_object_with_400(agent_api: APIClient) -> None:
    response = agent_api.post(f"{API}/tasks/", data="[]", content_type="application/json")

    assert_invalid(response)


def test_it_refuses_a_body_that_is_not_json_with_415(agent_api: APIClient) -> None:
    response = agent_api.post(f"{API}/tasks/", data="title=plain", content_type="text/plain")

    assert_error(response, 415)
    assert not Task.objects.exists()


def test_a_url_without_its_trailing_slash_is_redirected_keeping_the_method(
    agent_api: APIClient,
) -> None:
    """308, not 301: a client that follows it repeats the POST with its body (after a 301
    it would GET the URL, and the task would never be created)."""
    response = agent_api.post(f"{API}/tasks?x=1", {"title": "slashless"}, format="json")

    assert response.status_code == 308
    assert response["Location"] == f"{API}/tasks/?x=1"
    assert not Task.objects.exists()
    followed = agent_api.post(f"{API}/tasks", {"title": "slashless"}, format="json", follow=True)
    assert followed.status_code == 201
    assert Task.objects.get().title == "slashless"


def test_it_refuses_a_non_numeric_content_length_with_a_json_400(agent_api: APIClient) -> None:
    response = agent_api.post(
        f"{API}/tasks/",
        data=b'{"title": "x"}',
        content_type="application/json",
        CONTENT_LENGTH="lots",
    )

    assert_error(response, 400, "invalid")


# JSON that parses but that PostgreSQL's jsonb cannot hold, or that Python cannot parse.
UNSTORABLE_JSON = [
    pytest.param('{"title": "x", "payload": {"text": "a\\u0000b"}}', id="nul-in-a-payload-string"),
    pytest.param('{"title": "x", "payload": {"a\\u0000": 1}}', id="nul-in-a-payload-key"),
    pytest.param(
        '{"title": "x", "payload": {"text": "\\ud800"}}', id="lone-surrogate-in-the-payload"
    ),
    pytest.param(
        '{"title": "x", "payload": {"deep": ' + "[" * 3000 + "]" * 3000 + "}}",
        id="nesting-deeper-than-the-parser-allows",
    ),
    pytest.param('{"title": "x", "payload": {"v": NaN}}', id="nan"),
    pytest.param('{"title": "x", "payload": {"v": 1e400}}', id="infinite-number"),
    pytest.param('{"title": "a\\u0000b"}', id="nul-in-the-title"),
    pytest.param('{"title": "\\ud800"}', id="lone-surrogate-in-the-title"),
]


@pytest.mark.parametrize("body", UNSTORABLE_JSON)
def test_it_refuses_json_that_the_database_cannot_store_with_400(body: str, agent: Any) -> None:
    client = APIClient(raise_request_exception=False)
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {TokenFactory.create(user=agent).key}")

    response = client.post(f"{API}/tasks/", data=body, content_type="application/json")

    assert_invalid(response)
    assert not Task.objects.exists()


def test_complete_refuses_a_result_the_database_cannot_store_with_400(
    agent: Any, held: tuple[int, str]
) -> None:
    task_id, token = held
    client = APIClient(raise_request_exception=False)
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {TokenFactory.create(user=agent).key}")

    response = client.post(
        f"{API}/tasks/{task_id}/complete/",
        data=json.dumps({"lease_token": token, "result": "a\u0000b"}),
        content_type="application/json",
    )

    assert_invalid(response, "result")
    assert Task.objects.get(id=task_id).status == "in_progress"


def test_it_records_the_authenticated_user_whatever_the_body_claims(
    agent_api: APIClient, staff_api: APIClient
) -> None:
    impostor = {"actor": "mallory", "created_by": "mallory", "leased_by": "mallory"}
    created = post(agent_api, "tasks/", {"title": "mine", **impostor}).json()
    task_id = created["id"]
    token = claim_one(agent_api, **impostor)["lease_token"]
    post(agent_api, f"tasks/{task_id}/heartbeat/", {"lease_token": token, **impostor})
    post(agent_api, f"tasks/{task_id}/complete/", {"lease_token": token, **impostor})
    post(staff_api, f"tasks/{task_id}/requeue/", {"note": "again", **impostor})

    assert created["created_by"] == "agent-smith"
    assert history(task_id) == [
        ("created", "pending", "agent-smith"),
        ("claimed", "in_progress", "agent-smith"),
        ("heartbeat", "in_progress", "agent-smith"),
        ("completed", "done", "agent-smith"),
        ("requeued", "pending", "ops-alice"),
    ]


def test_an_unexpected_error_in_a_view_is_a_json_500(
    agent: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(**kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(transitions, "create_once", broken)
    client = APIClient(raise_request_exception=False)
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {TokenFactory.create(user=agent).key}")

    response = post(client, "tasks/", {"title": "boom"})

    body = assert_error(response, 500, "server_error")
    assert "a bug" not in body["detail"]


def test_a_wrong_method_is_a_json_405(agent_api: APIClient) -> None:
    assert_error(get(agent_api, "tasks/claim/"), 405)


# -- Read -------------------------------------------------------------------------------


def test_it_reads_a_task(agent_api: APIClient, make_task: Callable[..., Any]) -> None:
    task = make_task(title="read me", payload={"k": "v"}, queue="docs", priority=7)

    response = get(agent_api, f"tasks/{task.id}/")

    assert response.status_code == 200
    body = response.json()
    assert set(body) == TASK_FIELDS
    assert (body["id"], body["title"], body["payload"], body["queue"], body["priority"]) == (
        task.id,
        "read me",
        {"k": "v"},
        "docs",
        7,
    )


def test_the_lease_token_appears_only_in_the_claim_response(
    agent_api: APIClient, staff_api: APIClient, make_task: Callable[..., Any]
) -> None:
    task = make_task()
    claimed = post(agent_api, "tasks/claim/", {})
    token = claimed.json()["tasks"][0]["lease_token"]
    assert set(claimed.json()["tasks"][0]) == TASK_FIELDS | {"lease_token"}

    reads = [
        get(agent_api, f"tasks/{task.id}/"),
        get(agent_api, "tasks/"),
        get(agent_api, "tasks/", status="in_progress", leased_by="agent-smith"),
        get(staff_api, f"tasks/{task.id}/"),
        post(agent_api, f"tasks/{task.id}/heartbeat/", {"lease_token": token}),
        get(agent_api, f"tasks/{task.id}/events/"),
        get(agent_api, "events/"),
        post(agent_api, f"tasks/{task.id}/complete/", {"lease_token": token}),
    ]

    for response in reads:
        assert response.status_code == 200, response.content
        assert token not in response.content.decode()
        assert b"lease_token" not in response.content
    assert set(reads[0].json()) == TASK_FIELDS
    assert set(reads[4].json()) == TASK_FIELDS


@pytest.mark.parametrize(
    ("method", "path", "body", "as_staff"),
    [
        ("get", "", None, False),
        ("get", "events/", None, False),
        *[("post", f"{name}/", body, False) for name, body in HOLDER_ACTIONS.items()],
        *[("post", f"{name}/", body, True) for name, body in STAFF_ACTIONS.items()],
    ],
)
def test_a_missing_task_is_a_json_404_on_every_detail_endpoint(
    agent_api: APIClient,
    staff_api: APIClient,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    as_staff: bool,
) -> None:
    client = staff_api if as_staff else agent_api
    url = f"{API}/tasks/987654/{path}"
    if method == "get":
        response = client.get(url)
    else:
        response = client.post(
            url, {"lease_token": str(uuid.uuid4()), **(body or {})}, format="json"
        )

    assert_error(response, 404, "not_found")


def test_an_id_too_large_for_the_database_is_a_json_404(agent_api: APIClient) -> None:
    assert_error(get(agent_api, "tasks/99999999999999999999999/"), 404, "not_found")
    assert_error(get(agent_api, "tasks/9223372036854775808/events/"), 404, "not_found")


@pytest.mark.parametrize("path", ["nothing-here/", "tasks/12/nothing/", "tasks/abc/"])
def test_an_unknown_url_under_the_api_is_a_json_404(agent_api: APIClient, path: str) -> None:
    assert_error(get(agent_api, path), 404, "not_found")


def test_the_schema_and_docs_are_served_without_credentials(db: None) -> None:
    schema = APIClient().get(f"{API}/schema/")
    docs = APIClient().get(f"{API}/docs/")

    assert schema.status_code == 200
    assert b"openapi" in schema.content
    assert docs.status_code == 200
    assert b"<html" in docs.content.lower()


# -- Identity ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("get", "tasks/"),
        ("post", "tasks/"),
        ("get", "tasks/1/"),
        ("post", "tasks/claim/"),
        ("post", "tasks/1/heartbeat/"),
        ("post", "tasks/1/requeue/"),
        ("get", "tasks/1/events/"),
        ("get", "events/"),
    ],
)
def test_it_refuses_a_request_without_credentials_with_401_and_www_authenticate(
    db: None, method: str, path: str
) -> None:
    client = APIClient()
    response = getattr(client, method)(f"{API}/{path}", {}, format="json")

    assert_error(response, 401, "not_authenticated")
    assert response["WWW-Authenticate"]


@pytest.mark.parametrize(
    "header",
    [
        "Bearer 0123456789abcdef0123456789abcdef01234567",
        "Token not-a-real-token",
        "Bearer",
        "Bearer two words",
    ],
)
def test_it_refuses_a_bad_token_with_401_and_www_authenticate(
    agent_api: APIClient, header: str
) -> None:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=header)

    response = post(client, "tasks/", {"title": "nope"})

    assert_error(response, 401, "not_authenticated")
    assert response["WWW-Authenticate"]
    assert not Task.objects.exists()


@pytest.mark.parametrize("keyword", ["Bearer", "Token"])
def test_it_accepts_a_token_as_bearer_or_token(agent: Any, keyword: str) -> None:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"{keyword} {TokenFactory.create(user=agent).key}")

    response = post(client, "tasks/", {"title": "hello"})

    assert response.status_code == 201, response.content
    assert response.json()["created_by"] == "agent-smith"


def test_a_logged_in_session_reads_and_writes_with_its_csrf_token(staff: Any) -> None:
    client = APIClient(enforce_csrf_checks=True)
    client.force_login(staff)
    client.get("/accounts/login/")  # any page with a form sets the CSRF cookie
    csrf = client.cookies["csrftoken"].value

    created = post(client, "tasks/", {"title": "from the browser"}, HTTP_X_CSRFTOKEN=csrf)
    listed = get(client, "tasks/")

    assert created.status_code == 201, created.content
    assert created.json()["created_by"] == "ops-alice"
    assert listed.status_code == 200
    assert [t["title"] for t in listed.json()["results"]] == ["from the browser"]


def test_a_session_post_without_a_csrf_token_is_refused_with_403(staff: Any) -> None:
    client = APIClient(enforce_csrf_checks=True)
    client.force_login(staff)

    response = post(client, "tasks/", {"title": "forged"})

    body = assert_error(response, 403, "permission_denied")
    assert "csrf" in body["detail"].lower()
    assert not Task.objects.exists()


@pytest.mark.parametrize("action", sorted(STAFF_ACTIONS))
def test_a_non_staff_user_may_not_use_a_staff_action(
    agent_api: APIClient, make_task: Callable[..., Any], action: str
) -> None:
    task_id = escalated_task(make_task, agent_api)
    before = history(task_id)

    response = post(agent_api, f"tasks/{task_id}/{action}/", STAFF_ACTIONS[action])

    assert_error(response, 403, "permission_denied")
    assert Task.objects.get(id=task_id).status == "escalated"
    assert history(task_id) == before


@pytest.mark.parametrize("action", sorted(STAFF_ACTIONS))
def test_staff_without_the_triage_permission_may_not_use_a_staff_action(
    api: Callable[[Any], APIClient],
    agent_api: APIClient,
    make_task: Callable[..., Any],
    action: str,
) -> None:
    task_id = escalated_task(make_task, agent_api)
    before = history(task_id)
    # Staff, as in the admin, where this user is refused the escalation queue's actions.
    untrusted = api(StaffFactory.create(username="ops-bob"))

    response = post(untrusted, f"tasks/{task_id}/{action}/", STAFF_ACTIONS[action])

    body = assert_error(response, 403, "permission_denied")
    assert "escalations.triage_task" in body["detail"]
    assert Task.objects.get(id=task_id).status == "escalated"
    assert history(task_id) == before


@pytest.mark.parametrize("action", sorted(STAFF_ACTIONS))
def test_a_superuser_may_use_every_staff_action(
    api: Callable[[Any], APIClient],
    agent_api: APIClient,
    make_task: Callable[..., Any],
    action: str,
) -> None:
    task_id = escalated_task(make_task, agent_api)
    root = UserFactory.create(username="root", is_staff=True, is_superuser=True)

    response = post(api(root), f"tasks/{task_id}/{action}/", STAFF_ACTIONS[action])

    assert response.status_code == 200, response.content
    assert history(task_id)[-1][2] == "root"


def test_a_non_staff_user_with_the_triage_permission_may_not_use_a_staff_action(
    api: Callable[[Any], APIClient], agent_api: APIClient, make_task: Callable[..., Any]
) -> None:
    # The admin needs is_staff as well: so does the API.
    task_id = escalated_task(make_task, agent_api)
    outsider = grant(UserFactory.create(username="outsider"), "escalations.triage_task")

    response = post(api(outsider), f"tasks/{task_id}/requeue/", {})

    assert_error(response, 403, "permission_denied")
    assert Task.objects.get(id=task_id).status == "escalated"


# -- Claim ------------------------------------------------------------------------------


def test_a_claim_hands_out_the_task_with_a_lease_token(
    agent_api: APIClient, make_task: Callable[..., Any]
) -> None:
    task = make_task()

    response = post(agent_api, "tasks/claim/", {})

    assert response.status_code == 200
    assert set(response.json()) == {"tasks"}
    [claimed] = response.json()["tasks"]
    assert set(claimed) == TASK_FIELDS | {"lease_token"}
    assert claimed["id"] == task.id
    assert claimed["status"] == "in_progress"
    assert claimed["leased_by"] == "agent-smith"
    assert claimed["lease_expired"] is False
    assert isinstance(claimed["lease_token"], str) and len(claimed["lease_token"]) >= 32
    lease = parse_time(claimed["leased_until"]) - timezone.now()
    assert timedelta(seconds=60) < lease <= timedelta(seconds=120)
    assert history(task.id)[-1] == ("claimed", "in_progress", "agent-smith")


def test_a_claim_with_nothing_claimable_returns_an_empty_list(agent_api: APIClient) -> None:
    response = post(agent_api, "tasks/claim/", {})

    assert response.status_code == 200
    assert response.json() == {"tasks": []}


def test_a_claim_with_an_empty_body_uses_the_defaults(
    agent_api: APIClient, make_task: Callable[..., Any]
) -> None:
    make_task()
    make_task()

    response = agent_api.post(f"{API}/tasks/claim/")

    assert response.status_code == 200, response.content
    assert len(response.json()["tasks"]) == 1


def test_a_claim_takes_the_highest_priority_first_up_to_its_limit(
    agent_api: APIClient, make_task: Callable[..., Any]
) -> None:
    low = make_task(priority=-5)
    first_high = make_task(priority=10)
    middle = make_task(priority=0)
    second_high = make_task(priority=10)

    tasks = claim(agent_api, limit=3)

    assert [t["id"] for t in tasks] == [first_high.id, second_high.id, middle.id]
    assert len({t["lease_token"] for t in tasks}) == 3
    assert Task.objects.get(id=low.id).status == "pending"


def test_a_claim_honours_lease_seconds(agent_api: APIClient, make_task: Callable[..., Any]) -> None:
    make_task()

    claimed = claim_one(agent_api, lease_seconds=3600)

    lease = parse_time(claimed["leased_until"]) - timezone.now()
    assert timedelta(minutes=55) < lease <= timedelta(hours=1)


def test_a_claim_takes_only_from_the_queues_it_names(
    agent_api: APIClient, make_task: Callable[..., Any]
) -> None:
    make_task(queue="mail", priority=100)
    wanted = make_task(queue="etl")
    also_wanted = make_task(queue="etl-2")

    tasks = claim(agent_api, queues=["etl", "etl-2", "nothing"], limit=10)

    assert sorted(t["id"] for t in tasks) == [wanted.id, also_wanted.id]


def test_a_task_is_not_claimable_before_its_run_after(
    agent_api: APIClient, make_task: Callable[..., Any]
) -> None:
    make_task(run_after=timezone.now() + timedelta(hours=1))
    due = make_task(run_after=timezone.now() - timedelta(hours=1))

    assert [t["id"] for t in claim(agent_api, limit=10)] == [due.id]


def test_a_claim_never_hands_out_a_task_under_a_live_lease(
    agent_api: APIClient, other_api: APIClient, make_task: Callable[..., Any]
) -> None:
    make_task()
    claim_one(agent_api)

    assert claim(other_api, limit=10) == []


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"limit": 0}, "limit"),
        ({"limit": 101}, "limit"),
        ({"limit": "2"}, "limit"),
        ({"lease_seconds": 0}, "lease_seconds"),
        ({"lease_seconds": 86401}, "lease_seconds"),
        ({"lease_seconds": "60"}, "lease_seconds"),
        ({"wait": -1}, "wait"),
        ({"wait": 61}, "wait"),
        ({"wait": "1"}, "wait"),
        ({"queues": "default"}, "queues"),
        ({"queues": ["Bad Queue"]}, "queues"),
    ],
)
def test_it_refuses_an_invalid_claim_with_400_and_the_field(
    agent_api: APIClient, make_task: Callable[..., Any], body: dict[str, Any], field: str
) -> None:
    task = make_task()

    assert_invalid(post(agent_api, "tasks/claim/", body), field)
    assert Task.objects.get(id=task.id).status == "pending"


def test_a_claim_accepts_the_edges_of_its_ranges(
    agent_api: APIClient, make_task: Callable[..., Any]
) -> None:
    make_task()
    make_task()

    long_lease = claim(agent_api, limit=100, lease_seconds=86400, wait=0)
    assert len(long_lease) == 2
    assert parse_time(long_lease[0]["leased_until"]) - timezone.now() > timedelta(hours=23)
    make_task()
    assert len(claim(agent_api, limit=1, lease_seconds=1)) == 1


def test_a_claim_takes_over_an_expired_lease_and_records_the_expiry(
    agent_api: APIClient, other_api: APIClient, make_task: Callable[..., Any]
) -> None:
    task = make_task()
    first_token = claim_one(agent_api)["lease_token"]
    expire_lease(task.id)
    seen = get(agent_api, f"tasks/{task.id}/").json()
    assert (seen["status"], seen["lease_expired"]) == ("in_progress", True)

    taken = claim_one(other_api)

    assert taken["id"] == task.id
    assert taken["leased_by"] == "agent-jones"
    assert taken["failure_count"] == 1
    assert taken["lease_token"] != first_token
    assert history(task.id) == [
        ("created", "pending", "agent-smith"),
        ("claimed", "in_progress", "agent-smith"),
        ("expired", "pending", "system"),
        ("claimed", "in_progress", "agent-jones"),
    ]
    expiry = TaskEvent.objects.get(task_id=task.id, type="expired")
    assert expiry.payload["previous_holder"] == "agent-smith"


def test_an_expired_lease_at_max_failures_is_escalated_and_the_claim_takes_the_next_task(
    agent_api: APIClient, other_api: APIClient, make_task: Callable[..., Any]
) -> None:
    doomed = make_task(max_failures=1, priority=5)
    claim_one(agent_api)
    next_task = make_task(priority=0)
    expire_lease(doomed.id)

    tasks = claim(other_api)

    assert [t["id"] for t in tasks] == [next_task.id]
    escalated = get(other_api, f"tasks/{doomed.id}/").json()
    assert (escalated["status"], escalated["failure_count"]) == ("escalated", 1)
    assert history(doomed.id)[-2:] == [
        ("expired", "escalated", "system"),
        ("escalated", "escalated", "system"),
    ]


# -- Lease holder actions ---------------------------------------------------------------


def test_a_heartbeat_extends_the_lease(agent_api: APIClient, make_task: Callable[..., Any]) -> None:
    task = make_task()
    claimed = claim_one(agent_api, lease_seconds=60)

    response = post(
        agent_api,
        f"tasks/{task.id}/heartbeat/",
        {"lease_token": claimed["lease_token"], "lease_seconds": 3600, "progress": {"pct": 50}},
    )

    assert response.status_code == 200, response.content
    body = response.json()
    assert set(body) == TASK_FIELDS
    assert body["status"] == "in_progress"
    assert parse_time(body["leased_until"]) > parse_time(claimed["leased_until"])
    assert parse_time(body["leased_until"]) - timezone.now() > timedelta(minutes=55)
    beat = TaskEvent.objects.filter(task_id=task.id).order_by("id").last()
    assert beat is not None
    assert (beat.type, beat.actor, beat.payload["progress"]) == (
        "heartbeat",
        "agent-smith",
        {"pct": 50},
    )


def test_complete_marks_the_task_done_with_its_result(
    agent_api: APIClient, held: tuple[int, str]
) -> None:
    task_id, token = held

    response = post(
        agent_api, f"tasks/{task_id}/complete/", {"lease_token": token, "result": [1, "two"]}
    )

    assert response.status_code == 200, response.content
    body = response.json()
    assert set(body) == TASK_FIELDS
    assert (body["status"], body["result"], body["leased_by"], body["leased_until"]) == (
        "done",
        [1, "two"],
        None,
        None,
    )
    assert history(task_id)[-1] == ("completed", "done", "agent-smith")


def test_fail_counts_a_strike_and_returns_the_task_to_pending(
    agent_api: APIClient, held: tuple[int, str]
) -> None:
    task_id, token = held

    response = post(agent_api, f"tasks/{task_id}/fail/", {"lease_token": token, "error": "oops"})

    assert response.status_code == 200, response.content
    body = response.json()
    assert set(body) == TASK_FIELDS
    assert (body["status"], body["failure_count"], body["last_error"], body["leased_by"]) == (
        "pending",
        1,
        "oops",
        None,
    )
    assert history(task_id)[-1] == ("failed", "pending", "agent-smith")


def test_fail_with_retry_after_delays_the_next_claim(
    agent_api: APIClient, held: tuple[int, str]
) -> None:
    task_id, token = held

    response = post(
        agent_api,
        f"tasks/{task_id}/fail/",
        {"lease_token": token, "error": "rate limited", "retry_after": 600},
    )

    delay = parse_time(response.json()["run_after"]) - timezone.now()
    assert timedelta(minutes=9) < delay <= timedelta(minutes=10)
    assert claim(agent_api) == []


def test_the_failure_that_reaches_max_failures_escalates_the_task(
    agent_api: APIClient, make_task: Callable[..., Any]
) -> None:
    task = make_task(max_failures=2)
    for strike, status in [(1, "pending"), (2, "escalated")]:
        token = claim_one(agent_api)["lease_token"]
        body = post(
            agent_api, f"tasks/{task.id}/fail/", {"lease_token": token, "error": f"no {strike}"}
        ).json()
        assert (body["status"], body["failure_count"]) == (status, strike)

    assert history(task.id)[-2:] == [
        ("failed", "escalated", "agent-smith"),
        ("escalated", "escalated", "agent-smith"),
    ]
    assert claim(agent_api) == []


@pytest.mark.parametrize("body", [{}, {"error": ""}, {"error": None}, {"error": 5}])
def test_fail_without_an_error_is_refused_with_400(
    agent_api: APIClient, held: tuple[int, str], body: dict[str, Any]
) -> None:
    task_id, token = held

    assert_invalid(
        post(agent_api, f"tasks/{task_id}/fail/", {"lease_token": token, **body}), "error"
    )
    assert Task.objects.get(id=task_id).status == "in_progress"


def test_release_returns_the_task_without_a_strike(
    agent_api: APIClient, held: tuple[int, str]
) -> None:
    task_id, token = held

    response = post(agent_api, f"tasks/{task_id}/release/", {"lease_token": token})

    assert response.status_code == 200, response.content
    body = response.json()
    assert (body["status"], body["failure_count"], body["leased_by"]) == ("pending", 0, None)
    assert history(task_id)[-1] == ("released", "pending", "agent-smith")
    assert claim_one(agent_api)["id"] == task_id


def test_escalate_hands_the_task_to_the_humans_with_the_reason(
    agent_api: APIClient, held: tuple[int, str]
) -> None:
    task_id, token = held

    response = post(
        agent_api, f"tasks/{task_id}/escalate/", {"lease_token": token, "reason": "ambiguous"}
    )

    assert response.status_code == 200, response.content
    body = response.json()
    assert (body["status"], body["last_error"], body["leased_by"]) == (
        "escalated",
        "ambiguous",
        None,
    )
    assert history(task_id)[-1] == ("escalated", "escalated", "agent-smith")


def test_escalate_without_a_reason_is_refused_with_400(
    agent_api: APIClient, held: tuple[int, str]
) -> None:
    task_id, token = held

    assert_invalid(post(agent_api, f"tasks/{task_id}/escalate/", {"lease_token": token}), "reason")


@pytest.mark.parametrize("action", sorted(HOLDER_ACTIONS))
def test_a_lease_holder_action_requires_a_lease_token(
    agent_api: APIClient, held: tuple[int, str], action: str
) -> None:
    task_id, _ = held

    assert_invalid(
        post(agent_api, f"tasks/{task_id}/{action}/", HOLDER_ACTIONS[action]), "lease_token"
    )


def assert_lease_lost_and_untouched(response: Any, task_id: int, before: Task) -> None:
    body = assert_error(response, 409, "lease_lost")
    assert body.get("status") == before.status
    after = Task.objects.get(id=task_id)
    assert (after.status, after.leased_by_id, after.leased_until, after.failure_count) == (
        before.status,
        before.leased_by_id,
        before.leased_until,
        before.failure_count,
    )


@pytest.mark.parametrize("action", sorted(HOLDER_ACTIONS))
@pytest.mark.parametrize("wrong_token", ["random-uuid", "not-a-uuid"])
def test_a_lease_holder_action_refuses_a_wrong_token_with_409(
    agent_api: APIClient, held: tuple[int, str], action: str, wrong_token: str
) -> None:
    task_id, _ = held
    token = str(uuid.uuid4()) if wrong_token == "random-uuid" else wrong_token
    before, events_before = Task.objects.get(id=task_id), history(task_id)

    response = post(
        agent_api, f"tasks/{task_id}/{action}/", {"lease_token": token, **HOLDER_ACTIONS[action]}
    )

    assert_lease_lost_and_untouched(response, task_id, before)
    assert history(task_id) == events_before


@pytest.mark.parametrize("action", sorted(HOLDER_ACTIONS))
def test_a_lease_holder_action_refuses_another_agent_holding_the_token_with_409(
    other_api: APIClient, held: tuple[int, str], action: str
) -> None:
    task_id, token = held
    before, events_before = Task.objects.get(id=task_id), history(task_id)

    response = post(
        other_api, f"tasks/{task_id}/{action}/", {"lease_token": token, **HOLDER_ACTIONS[action]}
    )

    assert_lease_lost_and_untouched(response, task_id, before)
    assert history(task_id) == events_before


@pytest.mark.parametrize("action", sorted(HOLDER_ACTIONS))
def test_a_lease_holder_action_refuses_a_token_from_another_task_with_409(
    agent_api: APIClient, make_task: Callable[..., Any], action: str
) -> None:
    first, second = make_task(), make_task()
    tokens = {t["id"]: t["lease_token"] for t in claim(agent_api, limit=2)}
    before = Task.objects.get(id=first.id)

    response = post(
        agent_api,
        f"tasks/{first.id}/{action}/",
        {"lease_token": tokens[second.id], **HOLDER_ACTIONS[action]},
    )

    assert_lease_lost_and_untouched(response, first.id, before)


@pytest.mark.parametrize("action", sorted(HOLDER_ACTIONS))
def test_a_lease_holder_action_refuses_an_expired_lease_with_409(
    agent_api: APIClient, held: tuple[int, str], action: str
) -> None:
    task_id, token = held
    expire_lease(task_id)
    before, events_before = Task.objects.get(id=task_id), history(task_id)

    response = post(
        agent_api, f"tasks/{task_id}/{action}/", {"lease_token": token, **HOLDER_ACTIONS[action]}
    )

    assert_lease_lost_and_untouched(response, task_id, before)
    assert history(task_id) == events_before


@pytest.mark.parametrize("action", sorted(HOLDER_ACTIONS))
def test_a_lease_holder_action_refuses_a_task_no_longer_in_progress_with_409(
    agent_api: APIClient, held: tuple[int, str], action: str
) -> None:
    task_id, token = held
    assert post(agent_api, f"tasks/{task_id}/complete/", {"lease_token": token}).status_code == 200
    before = Task.objects.get(id=task_id)

    response = post(
        agent_api, f"tasks/{task_id}/{action}/", {"lease_token": token, **HOLDER_ACTIONS[action]}
    )

    assert_lease_lost_and_untouched(response, task_id, before)
    assert response.json()["status"] == "done"


# -- Staff actions ----------------------------------------------------------------------


@pytest.mark.parametrize("start", ["escalated", "done", "cancelled"])
def test_staff_requeue_puts_the_task_back_to_pending_with_its_strikes_reset(
    agent_api: APIClient,
    staff_api: APIClient,
    make_task: Callable[..., Any],
    start: str,
) -> None:
    task_id = escalated_task(make_task, agent_api)
    if start == "done":
        post(staff_api, f"tasks/{task_id}/resolve/", {})
    elif start == "cancelled":
        post(staff_api, f"tasks/{task_id}/cancel/", {})
    assert Task.objects.get(id=task_id).status == start

    response = post(staff_api, f"tasks/{task_id}/requeue/", {"note": "try again"})

    assert response.status_code == 200, response.content
    body = response.json()
    assert set(body) == TASK_FIELDS
    assert (body["status"], body["failure_count"]) == ("pending", 0)
    assert history(task_id)[-1] == ("requeued", "pending", "ops-alice")
    assert claim_one(agent_api)["id"] == task_id


def test_staff_resolve_settles_an_escalated_task_as_done(
    agent_api: APIClient, staff_api: APIClient, make_task: Callable[..., Any]
) -> None:
    task_id = escalated_task(make_task, agent_api)

    response = post(
        staff_api, f"tasks/{task_id}/resolve/", {"note": "did it by hand", "result": {"ok": 1}}
    )

    assert response.status_code == 200, response.content
    body = response.json()
    assert (body["status"], body["result"]) == ("done", {"ok": 1})
    resolved = TaskEvent.objects.filter(task_id=task_id).order_by("id").last()
    assert resolved is not None
    assert (resolved.type, resolved.actor, resolved.payload["note"]) == (
        "resolved",
        "ops-alice",
        "did it by hand",
    )


@pytest.mark.parametrize("start", ["pending", "escalated"])
def test_staff_cancel_withdraws_a_pending_or_escalated_task(
    agent_api: APIClient, staff_api: APIClient, make_task: Callable[..., Any], start: str
) -> None:
    task_id = escalated_task(make_task, agent_api) if start == "escalated" else make_task().id

    response = post(staff_api, f"tasks/{task_id}/cancel/", {"note": "not needed"})

    assert response.status_code == 200, response.content
    assert response.json()["status"] == "cancelled"
    assert history(task_id)[-1] == ("cancelled", "cancelled", "ops-alice")
    assert claim(agent_api) == []


@pytest.mark.parametrize(
    ("action", "start"),
    [
        ("requeue", "pending"),
        ("requeue", "in_progress"),
        ("resolve", "pending"),
        ("resolve", "in_progress"),
        ("resolve", "done"),
        ("cancel", "in_progress"),
        ("cancel", "done"),
        ("cancel", "cancelled"),
    ],
)
def test_a_staff_action_from_the_wrong_status_is_refused_with_409(
    agent_api: APIClient,
    staff_api: APIClient,
    make_task: Callable[..., Any],
    action: str,
    start: str,
) -> None:
    task = make_task()
    if start in {"in_progress", "done"}:
        token = claim_one(agent_api)["lease_token"]
        if start == "done":
            post(agent_api, f"tasks/{task.id}/complete/", {"lease_token": token})
    elif start == "cancelled":
        post(staff_api, f"tasks/{task.id}/cancel/", {})
    events_before = history(task.id)

    response = post(staff_api, f"tasks/{task.id}/{action}/", STAFF_ACTIONS[action])

    body = assert_error(response, 409, "invalid_transition")
    assert body.get("status") == start
    assert Task.objects.get(id=task.id).status == start
    assert history(task.id) == events_before


# -- Task list --------------------------------------------------------------------------


def test_the_task_list_filters_by_status_queue_and_holder(
    agent_api: APIClient, other_api: APIClient, make_task: Callable[..., Any]
) -> None:
    mine = make_task(queue="a", priority=3)
    theirs = make_task(queue="b", priority=2)
    waiting_a = make_task(queue="a")
    waiting_b = make_task(queue="b")
    claim_one(agent_api)
    claim_one(other_api)

    def ids(**params: Any) -> set[int]:
        response = get(agent_api, "tasks/", **params)
        assert response.status_code == 200, response.content
        return {t["id"] for t in response.json()["results"]}

    assert ids() == {mine.id, theirs.id, waiting_a.id, waiting_b.id}
    assert ids(status="in_progress") == {mine.id, theirs.id}
    assert ids(status="pending") == {waiting_a.id, waiting_b.id}
    assert ids(status="done") == set()
    assert ids(queue="a") == {mine.id, waiting_a.id}
    assert ids(leased_by="agent-jones") == {theirs.id}
    assert ids(status="pending", queue="b") == {waiting_b.id}
    assert ids(leased_by="nobody") == set()


@pytest.mark.parametrize(
    ("params", "field"), [({"status": "finished"}, "status"), ({"queue": "Not Valid"}, "queue")]
)
def test_the_task_list_refuses_a_bad_filter_with_400(
    agent_api: APIClient, params: dict[str, str], field: str
) -> None:
    assert_invalid(get(agent_api, "tasks/", **params), field)


def test_the_task_list_pages_through_every_task_exactly_once(
    agent_api: APIClient, make_task: Callable[..., Any]
) -> None:
    created = {make_task().id for _ in range(101)}

    pages = walk_pages(agent_api, f"{API}/tasks/")

    assert len(pages) >= 2
    ids = [t["id"] for page in pages for t in page]
    assert len(ids) == len(set(ids)) == 101
    assert set(ids) == created
    assert all(set(t) == TASK_FIELDS for page in pages for t in page)


def test_the_task_list_keeps_its_filters_across_pages(
    agent_api: APIClient, make_task: Callable[..., Any]
) -> None:
    wanted = {make_task(queue="wanted").id for _ in range(5)}
    for _ in range(4):
        make_task(queue="other")

    pages = walk_pages(agent_api, f"{API}/tasks/?queue=wanted&limit=2")

    assert [len(page) for page in pages] == [2, 2, 1]
    assert [t["id"] for page in pages for t in page] == sorted(wanted, reverse=True)


# -- Event log --------------------------------------------------------------------------


def test_the_created_event_carries_the_title_queue_and_priority(
    agent_api: APIClient,
) -> None:
    task = post(agent_api, "tasks/", {"title": "log me", "queue": "q1", "priority": 9}).json()

    [event] = get(agent_api, f"tasks/{task['id']}/events/").json()["results"]

    assert set(event) == EVENT_FIELDS
    assert (event["task_id"], event["type"], event["status"], event["actor"]) == (
        task["id"],
        "created",
        "pending",
        "agent-smith",
    )
    assert event["payload"] == {"title": "log me", "queue": "q1", "priority": 9}
    parse_time(event["created_at"])


def test_a_tasks_events_are_listed_oldest_first(
    agent_api: APIClient, held: tuple[int, str]
) -> None:
    task_id, token = held
    post(agent_api, f"tasks/{task_id}/heartbeat/", {"lease_token": token})
    post(agent_api, f"tasks/{task_id}/release/", {"lease_token": token})

    response = get(agent_api, f"tasks/{task_id}/events/")

    assert response.status_code == 200
    body = response.json()
    assert body["next"] is None
    assert [e["type"] for e in body["results"]] == ["created", "claimed", "heartbeat", "released"]
    ids = [e["id"] for e in body["results"]]
    assert ids == sorted(ids)
    assert {e["task_id"] for e in body["results"]} == {task_id}


def test_the_event_log_lists_every_event_by_ascending_id(
    agent_api: APIClient, make_task: Callable[..., Any]
) -> None:
    first, second = make_task(), make_task()
    claim(agent_api, limit=2)

    response = get(agent_api, "events/")

    assert response.status_code == 200
    body = response.json()
    assert set(body) == {"results", "next"}
    assert body["next"] is None
    assert all(set(e) == EVENT_FIELDS for e in body["results"])
    ids = [e["id"] for e in body["results"]]
    assert ids == sorted(ids) and len(ids) == len(set(ids)) == 4
    assert [(e["task_id"], e["type"]) for e in body["results"]] == [
        (first.id, "created"),
        (second.id, "created"),
        (first.id, "claimed"),
        (second.id, "claimed"),
    ]


def test_the_event_log_filters_by_after_task_and_type(
    agent_api: APIClient, make_task: Callable[..., Any]
) -> None:
    first, second = make_task(), make_task()
    claim(agent_api, limit=2)
    events = get(agent_api, "events/").json()["results"]

    def listed(**params: Any) -> list[tuple[int, str]]:
        response = get(agent_api, "events/", **params)
        assert response.status_code == 200, response.content
        return [(e["task_id"], e["type"]) for e in response.json()["results"]]

    assert listed(after=events[1]["id"]) == [(first.id, "claimed"), (second.id, "claimed")]
    assert listed(after=events[-1]["id"]) == []
    assert listed(task=second.id) == [(second.id, "created"), (second.id, "claimed")]
    assert listed(type="claimed") == [(first.id, "claimed"), (second.id, "claimed")]
    assert listed(task=first.id, type="created") == [(first.id, "created")]
    assert listed(limit=1) == [(first.id, "created")]


def test_the_event_log_pages_through_every_event_exactly_once(
    agent_api: APIClient, make_task: Callable[..., Any]
) -> None:
    for _ in range(7):
        make_task()
    expected = list(TaskEvent.objects.order_by("id").values_list("id", flat=True))

    pages = walk_pages(agent_api, f"{API}/events/?limit=3")

    assert [len(page) for page in pages] == [3, 3, 1]
    assert [e["id"] for page in pages for e in page] == expected


@pytest.mark.parametrize(
    "params",
    [
        {"limit": 0},
        {"limit": 1001},
        {"limit": "many"},
        {"after": -1},
        {"after": "x"},
        {"task": "x"},
        {"type": "exploded"},
    ],
)
def test_the_event_log_refuses_a_bad_query_with_400(
    agent_api: APIClient, params: dict[str, Any]
) -> None:
    assert_invalid(get(agent_api, "events/", **params), *params)


def test_the_event_log_accepts_limits_from_1_to_1000(
    agent_api: APIClient, make_task: Callable[..., Any]
) -> None:
    make_task()

    assert len(get(agent_api, "events/", limit=1).json()["results"]) == 1
    assert len(get(agent_api, "events/", limit=1000).json()["results"]) == 1


# -- A whole session --------------------------------------------------------------------


def test_a_full_agent_session_is_recorded_in_the_event_log(agent_api: APIClient) -> None:
    created = post(agent_api, "tasks/", {"title": "crawl", "queue": "web"})
    assert created.status_code == 201
    task_id = created.json()["id"]

    first = claim_one(agent_api, queues=["web"], lease_seconds=30)
    beat = post(
        agent_api,
        f"tasks/{task_id}/heartbeat/",
        {"lease_token": first["lease_token"], "progress": {"pages": 3}},
    )
    failed = post(
        agent_api,
        f"tasks/{task_id}/fail/",
        {"lease_token": first["lease_token"], "error": "timeout"},
    )
    second = claim_one(agent_api, queues=["web"])
    stale = post(agent_api, f"tasks/{task_id}/complete/", {"lease_token": first["lease_token"]})
    done = post(
        agent_api,
        f"tasks/{task_id}/complete/",
        {"lease_token": second["lease_token"], "result": {"pages": 10}},
    )

    assert beat.status_code == failed.status_code == done.status_code == 200
    assert failed.json()["status"] == "pending"
    assert second["id"] == task_id and second["failure_count"] == 1
    assert second["lease_token"] != first["lease_token"]
    assert_error(stale, 409, "lease_lost")
    assert done.json()["status"] == "done"
    assert done.json()["result"] == {"pages": 10}
    events = get(agent_api, f"tasks/{task_id}/events/").json()["results"]
    assert [(e["type"], e["status"], e["actor"]) for e in events] == [
        ("created", "pending", "agent-smith"),
        ("claimed", "in_progress", "agent-smith"),
        ("heartbeat", "in_progress", "agent-smith"),
        ("failed", "pending", "agent-smith"),
        ("claimed", "in_progress", "agent-smith"),
        ("completed", "done", "agent-smith"),
    ]
    assert events[3]["payload"]["error"] == "timeout"
    assert events[5]["payload"]["result"] == {"pages": 10}


# -- Body size --------------------------------------------------------------------------


def task_body_of_size(size: int) -> bytes:
    """Return a JSON task body of exactly ``size`` bytes, padded in its payload."""
    empty = json.dumps({"title": "big", "payload": {"blob": ""}}).encode()
    body = json.dumps({"title": "big", "payload": {"blob": "x" * (size - len(empty))}}).encode()
    assert len(body) == size
    return body


def test_a_body_of_exactly_1_mib_is_accepted(agent_api: APIClient) -> None:
    response = agent_api.post(
        f"{API}/tasks/", data=task_body_of_size(MIB), content_type="application/json"
    )

    assert response.status_code == 201, response.content[:300]


def test_a_body_over_1_mib_is_refused_with_413(agent_api: APIClient) -> None:
    response = agent_api.post(
        f"{API}/tasks/", data=task_body_of_size(MIB + 1), content_type="application/json"
    )

    assert_error(response, 413)
    assert not Task.objects.exists()


def test_a_large_declared_content_length_is_refused_with_413_before_reading(
    agent_api: APIClient,
) -> None:
    response = agent_api.post(
        f"{API}/tasks/",
        data=b'{"title": "small"}',
        content_type="application/json",
        CONTENT_LENGTH=str(50 * MIB),
    )

    assert_error(response, 413)


# -- Over real HTTP ---------------------------------------------------------------------
# The stream, waiting claims and chunked bodies are handled in front of Django (the ASGI
# application that `serve` runs), which the test client bypasses: these go through uvicorn.


@pytest.fixture
def bearer(agent: Any) -> dict[str, str]:
    return {"Authorization": f"Bearer {TokenFactory.create(user=agent).key}"}


def chunks_of(body: bytes, size: int = 64 * 1024) -> Iterator[bytes]:
    """Yield ``body`` in pieces: httpx sends a generator with Transfer-Encoding: chunked."""
    for start in range(0, len(body), size):
        yield body[start : start + size]


@pytest.mark.django_db(transaction=True)
def test_over_http_the_stream_refuses_a_request_without_credentials_with_401(
    server: LiveServer,
) -> None:
    response = httpx.get(f"{server.url}{API}/stream/", timeout=10)

    assert_error(HttpxResponse(response), 401, "not_authenticated")
    assert response.headers["WWW-Authenticate"]


@pytest.mark.django_db(transaction=True)
def test_over_http_a_claim_with_wait_holds_the_request_while_nothing_is_claimable(
    server: LiveServer, bearer: dict[str, str]
) -> None:
    started = time.monotonic()
    response = httpx.post(
        f"{server.url}{API}/tasks/claim/", json={"wait": 1}, headers=bearer, timeout=10
    )
    elapsed = time.monotonic() - started

    assert response.status_code == 200, response.text
    assert response.json() == {"tasks": []}
    assert 0.9 <= elapsed < 5


@pytest.mark.django_db(transaction=True)
def test_over_http_a_claim_with_wait_gets_a_task_created_while_it_waits(
    server: LiveServer, bearer: dict[str, str], other_agent: Any
) -> None:
    def create_soon() -> None:
        time.sleep(0.5)
        try:
            transitions.create(actor=other_agent, title="arrived late")
        finally:
            connection.close()  # this thread's own connection

    creator = threading.Thread(target=create_soon)
    creator.start()
    try:
        started = time.monotonic()
        response = httpx.post(
            f"{server.url}{API}/tasks/claim/", json={"wait": 15}, headers=bearer, timeout=30
        )
        elapsed = time.monotonic() - started
    finally:
        creator.join()

    assert response.status_code == 200, response.text
    [task] = response.json()["tasks"]
    assert (task["title"], task["leased_by"]) == ("arrived late", "agent-smith")
    assert task["lease_token"]
    # Woken by the new task, not by the end of the wait. (The relay sees an event only once
    # every older transaction in the cluster has ended, so allow for a busy cluster.)
    assert 0.4 < elapsed < 10


@pytest.mark.django_db(transaction=True)
def test_over_http_a_chunked_body_over_1_mib_is_refused_with_413(
    server: LiveServer, bearer: dict[str, str]
) -> None:
    response = httpx.post(
        f"{server.url}{API}/tasks/",
        content=chunks_of(task_body_of_size(MIB + 1)),
        headers={**bearer, "Content-Type": "application/json"},
        timeout=20,
    )

    assert response.request.headers.get("Transfer-Encoding") == "chunked"
    assert_error(HttpxResponse(response), 413)
    assert not Task.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_over_http_a_chunked_body_under_1_mib_is_accepted(
    server: LiveServer, bearer: dict[str, str]
) -> None:
    response = httpx.post(
        f"{server.url}{API}/tasks/",
        content=chunks_of(b'{"title": "sent in chunks"}', 5),
        headers={**bearer, "Content-Type": "application/json"},
        timeout=20,
    )

    assert response.request.headers.get("Transfer-Encoding") == "chunked"
    assert response.status_code == 201, response.text
    assert response.json()["title"] == "sent in chunks"


# -- Exactly what the schema states (tests/test_fuzz.py holds the server to it) ----------

# Every query parameter of every endpoint, with a valid value.
QUERY_PARAMETERS = [
    ("tasks/", "status", "pending"),
    ("tasks/", "queue", "default"),
    ("tasks/", "leased_by", "agent-smith"),
    ("tasks/", "before", "10"),
    ("tasks/", "limit", "10"),
    ("events/", "type", "created"),
    ("events/", "task", "1"),
    ("events/", "after", "0"),
    ("events/", "limit", "10"),
    ("tasks/{id}/events/", "after", "0"),
    ("tasks/{id}/events/", "limit", "10"),
]


def query_url(make_task: Callable[..., Any], path: str, query: str) -> str:
    return f"{API}/{path.format(id=make_task().id)}?{query}"


@pytest.mark.parametrize(("path", "name", "value"), QUERY_PARAMETERS)
def test_an_empty_query_parameter_is_refused_with_400_not_ignored(
    agent_api: APIClient, make_task: Callable[..., Any], path: str, name: str, value: str
) -> None:
    assert agent_api.get(query_url(make_task, path, f"{name}={value}")).status_code == 200

    assert_invalid(agent_api.get(query_url(make_task, path, f"{name}=")), name)


@pytest.mark.parametrize(("path", "name", "value"), QUERY_PARAMETERS)
def test_a_query_parameter_given_twice_is_refused_with_400(
    agent_api: APIClient, make_task: Callable[..., Any], path: str, name: str, value: str
) -> None:
    response = agent_api.get(query_url(make_task, path, f"{name}={value}&{name}={value}"))

    assert_invalid(response, name)


@pytest.mark.parametrize("value", ["5.0", "5.", " 5", "5 ", "+5", "1_0", "\u0665", "0x5", "5e0"])
@pytest.mark.parametrize(("path", "name"), [("events/", "limit"), ("tasks/", "before")])
def test_a_query_integer_is_decimal_digits_and_nothing_else(
    agent_api: APIClient, path: str, name: str, value: str
) -> None:
    assert_invalid(agent_api.get(f"{API}/{path}", {name: value}), name)


def test_a_query_string_with_a_nul_is_refused_with_400(agent_api: APIClient) -> None:
    assert_invalid(agent_api.get(f"{API}/tasks/?leased_by=a%00b"), "leased_by")


@pytest.mark.parametrize("blank", [" ", "\t\n", "\x1c", "\u3000", "\u2028 \u00a0"])
@pytest.mark.parametrize("field", ["title", "error", "reason"])
def test_a_text_that_must_say_something_refuses_only_whitespace(
    agent_api: APIClient, held: tuple[int, str], field: str, blank: str
) -> None:
    task_id, token = held
    path, body = {
        "title": ("tasks/", {}),
        "error": (f"tasks/{task_id}/fail/", {"lease_token": token}),
        "reason": (f"tasks/{task_id}/escalate/", {"lease_token": token}),
    }[field]

    assert_invalid(post(agent_api, path, {**body, field: blank}), field)
    assert Task.objects.get(id=task_id).status == "in_progress"


def test_text_length_is_counted_as_sent_before_any_trimming(
    agent_api: APIClient, held: tuple[int, str]
) -> None:
    # 200 characters is the limit, spaces included: the schema's maxLength.
    assert_invalid(post(agent_api, "tasks/", {"title": " " + "x" * 200}), "title")
    task_id, token = held
    long_error = {"lease_token": token, "error": "x" * 10000 + "\n"}
    assert_invalid(post(agent_api, f"tasks/{task_id}/fail/", long_error), "error")
    # Within the limit, titles and errors are stored without surrounding whitespace, and a
    # description as sent.
    created = post(agent_api, "tasks/", {"title": " spaced \n", "description": "  "})
    assert created.status_code == 201, created.content
    assert (created.json()["title"], created.json()["description"]) == ("spaced", "  ")
    failed = post(agent_api, f"tasks/{task_id}/fail/", {"lease_token": token, "error": "oops\n"})
    assert failed.status_code == 200, failed.content
    assert failed.json()["last_error"] == "oops"


@pytest.mark.parametrize(
    "value",
    [
        "2030-01-01 00:00:00+00:00",  # a space for the T
        "2030-01-01T00:00:00",  # no UTC offset
        "2030-01-01T00:00Z",  # no seconds
        "2030-01-01t00:00:00z",
        "2030-01-01T00:00:00+0100",
        "2030-01-01T00:00:00.1234567890Z",  # finer than nanoseconds
        "2030-02-29T00:00:00Z",  # not a leap year
        "2030-04-31T00:00:00Z",
        "2030-01-01T24:00:00Z",
        "2030-01-01T23:59:60Z",
        "0001-01-01T12:00:00Z",  # years Python cannot hold on both sides of UTC
        "9999-12-31T00:00:00Z",
        "",
    ],
)
def test_run_after_refuses_a_time_that_is_not_rfc_3339_with_an_offset(
    agent_api: APIClient, value: str
) -> None:
    assert_invalid(post(agent_api, "tasks/", {"title": "later", "run_after": value}), "run_after")


@pytest.mark.parametrize(
    "value",
    [
        "2032-02-29T00:00:00Z",
        "2000-02-29T12:30:45.5+01:00",
        "2030-01-01T00:00:00.123456789-23:59",
        "0002-01-01T00:00:00-23:59",
        "9998-12-31T23:59:59.999999+00:00",
    ],
)
def test_run_after_accepts_every_rfc_3339_time_with_an_offset(
    agent_api: APIClient, value: str
) -> None:
    response = post(agent_api, "tasks/", {"title": "later", "run_after": value})

    assert response.status_code == 201, response.content
    sent = datetime.fromisoformat(value)
    assert abs(parse_time(response.json()["run_after"]) - sent) < timedelta(microseconds=1)


def test_an_integer_field_takes_a_number_without_a_fraction(agent_api: APIClient) -> None:
    # JSON Schema counts 5.0 as an integer; so does the server.
    response = post(agent_api, "tasks/", {"title": "five", "priority": 5.0, "max_failures": 2.0})

    assert response.status_code == 201, response.content
    assert (response.json()["priority"], response.json()["max_failures"]) == (5, 2)


def nested(levels: int) -> Any:
    """A JSON object with ``levels`` levels of arrays and objects, itself the first."""
    value: Any = []
    for _ in range(levels - 2):
        value = [value]
    return {"deep": value}


def test_json_nests_at_most_100_levels_deep(agent_api: APIClient, held: tuple[int, str]) -> None:
    # Deeper payloads passed the parser and failed to reach the database (a 500 at ~940).
    accepted = post(agent_api, "tasks/", {"title": "deep", "payload": nested(100)})
    assert accepted.status_code == 201, accepted.content
    assert accepted.json()["payload"] == nested(100)

    assert_invalid(
        post(agent_api, "tasks/", {"title": "deeper", "payload": nested(101)}), "payload"
    )
    task_id, token = held
    response = post(
        agent_api, f"tasks/{task_id}/complete/", {"lease_token": token, "result": nested(101)}
    )
    assert_invalid(response, "result")
    assert Task.objects.get(id=task_id).status == "in_progress"


# -- Pages bounded in bytes -----------------------------------------------------------------


@pytest.mark.django_db
def test_a_page_of_large_tasks_stops_at_its_byte_budget_and_next_goes_on(
    agent_api: APIClient, agent: Any
) -> None:
    from board.api.serializers import PAGE_BYTES

    megabyte = "x" * 1_000_000
    made = [
        transitions.create(actor=agent, title=f"big {n}", description=megabyte) for n in range(9)
    ]

    sizes, pages, url = [], [], f"{API}/tasks/?limit=1000"
    while url is not None:
        response = agent_api.get(url)
        assert response.status_code == 200, response.content[:300]
        sizes.append(len(response.content))
        pages.append([t["id"] for t in response.json()["results"]])
        url = response.json()["next"]
        assert len(pages) <= 9

    assert [len(page) for page in pages] == [4, 4, 1]  # 4 MiB hold four of a million bytes
    assert max(sizes) <= PAGE_BYTES
    assert [i for page in pages for i in page] == [t.id for t in reversed(made)]


@pytest.mark.django_db
def test_a_page_of_small_rows_still_holds_its_whole_limit(agent_api: APIClient, agent: Any) -> None:
    made = [transitions.create(actor=agent, title=f"t{n}") for n in range(45)]

    pages = walk_pages(agent_api, f"{API}/tasks/?limit=40")
    assert [len(page) for page in pages] == [40, 5]
    assert [t["id"] for page in pages for t in page] == [t.id for t in reversed(made)]
    # Exactly the limit's worth of rows: no next page after it.
    assert len(walk_pages(agent_api, f"{API}/tasks/?limit=45")) == 1


@pytest.mark.django_db
def test_a_task_larger_than_the_budget_is_a_page_of_its_own(
    agent_api: APIClient, agent: Any
) -> None:
    big = 1_100_000  # four fields of it are more than the 4 MiB budget
    small = transitions.create(actor=agent, title="small")
    huge = transitions.create(
        actor=agent,
        title="huge",
        queue="huge",
        description="y" * big,
        payload={"z": "z" * big},
    )
    result = {"r": "r" * big}
    [held] = transitions.claim(actor=agent, queues=[huge.queue])
    transitions.heartbeat(
        task_id=huge.pk, actor=agent, lease_token=held.lease_token, progress={"p": "p" * big}
    )
    transitions.complete(task_id=huge.pk, actor=agent, lease_token=held.lease_token, result=result)
    transitions.create(
        actor=agent,
        title="bigger",
        description="b" * big,
        payload={"z": "z" * big},
    )

    pages = walk_pages(agent_api, f"{API}/tasks/?limit=100")
    assert [[t["title"] for t in page] for page in pages] == [["bigger"], ["huge"], ["small"]]
    assert pages[-1][0]["id"] == small.pk


@pytest.mark.django_db
def test_a_page_of_events_with_large_results_stops_at_its_byte_budget(
    agent_api: APIClient, agent: Any
) -> None:
    for n in range(5):
        task = transitions.create(actor=agent, title=f"t{n}", queue=f"q{n}")
        [held] = transitions.claim(actor=agent, queues=[task.queue])
        transitions.complete(
            task_id=task.pk, actor=agent, lease_token=held.lease_token, result="r" * 1_000_000
        )

    pages = walk_pages(agent_api, f"{API}/events/?type=completed&limit=1000")
    assert [len(page) for page in pages] == [4, 1]
    assert [e["type"] for page in pages for e in page] == ["completed"] * 5
