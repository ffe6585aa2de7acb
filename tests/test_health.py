"""GET /healthz, and how the app answers while the database is unreachable."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.db import connections
from django.test import Client
from rest_framework.test import APIClient

# Outages close the default connection, which a test inside a transaction cannot survive.
pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("fast_password_hashing"),
]


@contextmanager
def database_unreachable() -> Iterator[None]:
    """Point the default connection at a local port where nothing listens, then restore it.

    The address is changed where the engine computes it (``get_connection_params``), so the
    outage is the same for the plain PostgreSQL engine and the embedded one (which picks its
    own host and port). Every connection attempt meanwhile is really refused by the OS.
    """
    default = connections["default"]
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))  # bound but never listening: connections are refused
        port = unused.getsockname()[1]
        real = default.get_connection_params

        def unreachable() -> dict[str, Any]:
            return {**real(), "host": "127.0.0.1", "port": port}

        default.close()
        default.get_connection_params = unreachable  # type: ignore[method-assign]
        try:
            yield
        finally:
            del default.get_connection_params
            default.close()


def assert_health(response: Any, status: int, value: str) -> None:
    assert response.status_code == status, response.content
    assert response["Content-Type"].startswith("application/json")
    assert json.loads(response.content) == {"status": value}


def assert_unavailable(response: Any) -> None:
    assert response.status_code == 503, response.content
    assert response["Content-Type"].startswith("application/json")
    body = json.loads(response.content)
    assert body["error"] == "unavailable"
    assert isinstance(body["detail"], str) and body["detail"]


@pytest.fixture
def agent_api(api: Callable[[Any], APIClient], agent: Any) -> APIClient:
    return api(agent)


def test_healthz_answers_ok_without_credentials() -> None:
    response = Client().get("/healthz")

    assert_health(response, 200, "ok")
    assert "no-cache" in response["Cache-Control"]


def test_healthz_answers_503_while_the_database_is_unreachable() -> None:
    with database_unreachable():
        response = Client().get("/healthz")

    assert_health(response, 503, "unavailable")


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("get", "tasks/", None),
        ("post", "tasks/", {"title": "during the outage"}),
        ("post", "tasks/claim/", {}),
        ("get", "events/", None),
    ],
)
def test_the_api_answers_503_json_while_the_database_is_unreachable(
    agent_api: APIClient, method: str, path: str, body: dict[str, Any] | None
) -> None:
    with database_unreachable():
        response = getattr(agent_api, method)(f"/api/v1/{path}", body, format="json")

    assert_unavailable(response)


def test_a_logged_in_session_gets_503_json_while_the_database_is_unreachable(
    staff: Any,
) -> None:
    client = APIClient()
    client.force_login(staff)

    with database_unreachable():
        response = client.get("/api/v1/tasks/")

    assert_unavailable(response)


def test_the_app_recovers_by_itself_when_the_database_comes_back(agent_api: APIClient) -> None:
    client = Client()
    with database_unreachable():
        assert_health(client.get("/healthz"), 503, "unavailable")
        assert_unavailable(agent_api.get("/api/v1/tasks/"))
        assert_health(client.get("/healthz"), 503, "unavailable")

    assert_health(client.get("/healthz"), 200, "ok")
    created = agent_api.post("/api/v1/tasks/", {"title": "after the outage"}, format="json")
    assert created.status_code == 201, created.content
    assert agent_api.get("/api/v1/tasks/").json()["results"][0]["title"] == "after the outage"


def test_healthz_replaces_a_connection_the_server_dropped(
    open_raw_connection: Callable[..., Any],
) -> None:
    client = Client()
    assert_health(client.get("/healthz"), 200, "ok")
    default = connections["default"]
    with default.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]
    # The server ends the session under us, as a restart or an admin would.
    with open_raw_connection(autocommit=True) as admin:
        assert admin.execute("SELECT pg_terminate_backend(%s)", [pid]).fetchone()[0] is True

    first = client.get("/healthz")
    second = client.get("/healthz")

    # The test client keeps one connection across requests, so the first check may meet
    # the dead session (503); it must drop it, so that the next one connects afresh.
    assert (first.status_code, json.loads(first.content)) in [
        (200, {"status": "ok"}),
        (503, {"status": "unavailable"}),
    ]
    assert_health(second, 200, "ok")
