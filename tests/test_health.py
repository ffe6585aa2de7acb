"""GET /healthz, and how the app answers while the database is unreachable."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.db import connections
from django.test import Client
from rest_framework.test import APIClient

from board.ops import health

# Outages close the default connection, which a test inside a transaction cannot survive.
pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("fast_password_hashing"),
]


@contextmanager
def database_at(port: int) -> Iterator[None]:
    """Point every new connection of the default database at a local port, then restore.

    The address is changed where the engine computes it (``get_connection_params``, on the
    engine's class, so that the health check's own thread sees it too), so the change is
    the same for the plain PostgreSQL engine and the embedded one (which picks its own host
    and port).
    """
    default = connections["default"]
    engine = type(default)
    own = engine.__dict__.get("get_connection_params")
    real = engine.get_connection_params

    def elsewhere(self: Any) -> dict[str, Any]:
        return {**real(self), "host": "127.0.0.1", "port": port}

    default.close()
    engine.get_connection_params = elsewhere  # type: ignore[method-assign]
    try:
        yield
    finally:
        if own is None:
            del engine.get_connection_params
        else:
            engine.get_connection_params = own  # type: ignore[method-assign]
        default.close()


@contextmanager
def database_unreachable() -> Iterator[None]:
    """Every connection attempt meanwhile is really refused by the OS."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))  # bound but never listening: connections are refused
        with database_at(unused.getsockname()[1]):
            yield


@contextmanager
def database_hanging() -> Iterator[None]:
    """A database that hangs, as a stopped (SIGSTOP) PostgreSQL does: the operating system
    accepts the connection, and nothing ever answers on it."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)  # never accepted: the kernel completes the handshakes itself
        with database_at(silent.getsockname()[1]):
            yield


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


def test_healthz_answers_ok_without_credentials() -> None:
    response = Client().get("/healthz")

    assert_health(response, 200, "ok")
    assert "no-cache" in response["Cache-Control"]


def test_healthz_answers_head_as_get_without_a_body() -> None:
    response = Client().head("/healthz")

    assert response.status_code == 200
    assert response["Content-Type"] == "application/json"  # the body is left out by uvicorn
    with database_unreachable():
        assert Client().head("/healthz").status_code == 503


def test_healthz_answers_503_while_the_database_is_unreachable() -> None:
    with database_unreachable():
        response = Client().get("/healthz")

    assert_health(response, 503, "unavailable")


def test_healthz_answers_503_in_time_while_the_database_hangs(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.TASKBOARD_HEALTH_TIMEOUT = 1
    # The connection attempt alone would wait 30 s: only the check's own bound ends it.
    monkeypatch.setitem(connections["default"].settings_dict["OPTIONS"], "connect_timeout", 30)
    answers: list[Any] = []

    def probe() -> None:
        answers.append(Client().get("/healthz"))

    with database_hanging():
        started = time.monotonic()
        together = [threading.Thread(target=probe) for _ in range(3)]
        for thread in together:
            thread.start()
        for thread in together:
            thread.join()
        took = time.monotonic() - started
        # The three requests waited on one check, which still hangs.
        shared = len(health._checks)
        # Later requests each start another, up to MAX_HUNG_CHECKS; then refuse at once.
        for _ in range(health.MAX_HUNG_CHECKS - 1):
            probe()
        full = time.monotonic()
        probe()
        refused_in = time.monotonic() - full
        hung = len(health._checks)

    assert [a.status_code for a in answers] == [503] * (3 + health.MAX_HUNG_CHECKS)
    assert_health(answers[-1], 503, "unavailable")
    assert took < 1 + 1.5, took
    assert shared == 1
    assert hung == health.MAX_HUNG_CHECKS
    assert refused_in < 0.5, refused_in
    # The database back, the hung checks fail and a new one answers.
    deadline = time.monotonic() + 10
    while (status := Client().get("/healthz").status_code) != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert status == 200
    assert not [check for check in health._checks if not check.answer.done()]


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


def test_every_503_for_the_database_is_the_same_json(agent_api: APIClient, staff: Any) -> None:
    """Every path a client takes during an outage answers the same bytes, so that no client
    sees two bodies. Through Django's test client each of these is answered in front of
    the views (the throttle's read meets the outage first); the API's own handler
    (board.api.errors) renders the same object through DRF, and is not reached here."""
    session = APIClient()
    session.force_login(staff)
    # Known before the outage: the agent's token is in the cache.
    assert agent_api.get("/api/v1/tasks/").status_code == 200

    with database_unreachable():
        answers = [
            agent_api.get("/api/v1/tasks/"),
            agent_api.post("/api/v1/tasks/", {"title": "during the outage"}, format="json"),
            session.get("/api/v1/tasks/"),
            session.get("/"),
            agent_api.post("/api/v1/tasks/claim/", {}, format="json"),
            agent_api.get("/api/v1/events/"),
            agent_api.get("/api/v1/queues/"),
            agent_api.get("/api/v1/agents/"),
            agent_api.get("/api/v1/tasks/1/"),
        ]

    for response in answers:
        assert_unavailable(response)
    assert len({response.content for response in answers}) == 1, [
        response.content for response in answers
    ]


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


def test_healthz_answers_ok_when_the_server_dropped_a_kept_connection(
    open_raw_connection: Callable[..., Any],
) -> None:
    """The check makes a connection of its own: a kept one that PostgreSQL ended (a
    restart, an admin) does not fail it."""
    client = Client()
    assert_health(client.get("/healthz"), 200, "ok")
    default = connections["default"]
    with default.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]
    # The server ends the session under us, as a restart or an admin would.
    with open_raw_connection(autocommit=True) as admin:
        assert admin.execute("SELECT pg_terminate_backend(%s)", [pid]).fetchone()[0] is True

    try:
        assert_health(client.get("/healthz"), 200, "ok")
        assert_health(client.get("/healthz"), 200, "ok")
    finally:
        default.close()


@pytest.mark.parametrize("method", ["post", "put", "delete"])
def test_healthz_refuses_other_methods_with_a_json_405(method: str) -> None:
    """Not CSRF's HTML page (403): the contract's errors are JSON, and a health check has no
    state to protect."""
    client = Client(enforce_csrf_checks=True)
    response = getattr(client, method)("/healthz", data="{}", content_type="application/json")
    assert response.status_code == 405
    assert response["Content-Type"] == "application/json"
    assert response.json()["error"] == "method_not_allowed"
    assert response["Allow"] == "GET, HEAD"
