"""taskboard_agent.client without a server: its retries against a fake transport (a real
server cannot be made to answer 503 on cue), its errors without an answer, and the
stream's parser. The client against a live server is tested in the repository's tests/."""

from __future__ import annotations

import json
import socket
import time
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

import taskboard_agent.client as client_module
from taskboard_agent.client import (
    AuthenticationError,
    Client,
    ForbiddenQueue,
    IdempotencyConflict,
    InvalidTransition,
    LeaseLost,
    NotFound,
    PayloadTooLarge,
    PermissionDenied,
    RateLimited,
    TaskboardError,
    Throttled,
    Unavailable,
    ValidationError,
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def test_a_read_without_an_answer_does_not_say_it_may_have_changed_something() -> None:
    with Client("bogus", "token", retries=0) as board, pytest.raises(Unavailable) as refused:
        board.list_tasks()
    assert "may or may not have taken effect" not in refused.value.detail, refused.value.detail


# -- Retries (a fake transport: a real server cannot be made to answer 503 on cue) --------

TASK_JSON: dict[str, Any] = {
    "id": 7,
    "title": "t",
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
    "created_at": "2025-01-01T00:00:00Z",
    "updated_at": "2025-01-01T00:00:00Z",
}
UNAVAILABLE = {"error": "unavailable", "detail": "The database is unavailable. Try again shortly."}


class Script:
    """A fake server that answers each request with the next scripted answer (the last
    one repeats); an exception is raised instead of answering."""

    def __init__(self, *answers: httpx.Response | Exception) -> None:
        self.answers = list(answers)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


@pytest.fixture
def pauses(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Record the client's pauses between retries instead of sleeping them."""
    slept: list[float] = []
    fake_time = SimpleNamespace(sleep=slept.append, monotonic=time.monotonic)
    monkeypatch.setattr(client_module, "time", fake_time)
    return slept


def scripted(script: Script, **options: Any) -> Client:
    options = {"retries": 3, "backoff": 0.5, "max_backoff": 1.5, **options}
    return Client("http://board.test", "token", transport=httpx.MockTransport(script), **options)


def test_503_answers_are_retried_with_growing_pauses_until_one_succeeds(
    pauses: list[float],
) -> None:
    script = Script(
        httpx.Response(503, json=UNAVAILABLE),
        httpx.Response(503, json=UNAVAILABLE),
        httpx.Response(200, json=TASK_JSON),
    )

    task = scripted(script).get(7)

    assert task.id == 7
    assert len(script.requests) == 3
    assert len(pauses) == 2
    assert 0.25 <= pauses[0] <= 0.5 and 0.5 <= pauses[1] <= 1.0  # backoff * 2**n, jittered


def test_refused_connections_are_retried_then_raise_unavailable(pauses: list[float]) -> None:
    script = Script(httpx.ConnectError("Connection refused"))

    with pytest.raises(Unavailable) as gave_up:
        scripted(script).create("never sent")  # never sent, so safe to send again

    assert len(script.requests) == 4  # the first try and three retries
    assert gave_up.value.status is None and gave_up.value.code == "unreachable"
    assert isinstance(gave_up.value.__cause__, httpx.ConnectError)
    assert len(pauses) == 3 and all(pause <= 1.5 for pause in pauses)  # bounded
    assert pauses[2] >= 0.75


def test_503_after_the_retries_raises_unavailable_with_the_servers_detail(
    pauses: list[float],
) -> None:
    script = Script(httpx.Response(503, json=UNAVAILABLE, headers={"Retry-After": "5"}))

    with pytest.raises(Unavailable) as gave_up:
        scripted(script, retries=2).claim()

    assert len(script.requests) == 3
    assert (gave_up.value.status, gave_up.value.code) == (503, "unavailable")
    assert gave_up.value.detail == UNAVAILABLE["detail"]
    assert pauses == [1.5, 1.5]  # Retry-After is heeded, within max_backoff


@pytest.mark.parametrize(
    ("status", "body", "error"),
    [
        (
            400,
            {"error": "invalid", "detail": "Invalid.", "fields": {"title": ["Required."]}},
            ValidationError,
        ),
        (401, {"error": "not_authenticated", "detail": "Log in."}, AuthenticationError),
        (403, {"error": "permission_denied", "detail": "Staff only."}, PermissionDenied),
        (403, {"error": "forbidden_queue", "detail": "Not yours."}, ForbiddenQueue),
        (404, {"error": "not_found", "detail": "No task."}, NotFound),
        (409, {"error": "lease_lost", "detail": "Stop.", "status": "done"}, LeaseLost),
        (
            409,
            {"error": "invalid_transition", "detail": "No.", "status": "done"},
            InvalidTransition,
        ),
        (409, {"error": "idempotency_conflict", "detail": "Another body."}, IdempotencyConflict),
        (413, {"error": "payload_too_large", "detail": "Too big."}, PayloadTooLarge),
    ],
)
def test_4xx_answers_are_never_retried(
    pauses: list[float], status: int, body: dict[str, Any], error: type[TaskboardError]
) -> None:
    script = Script(httpx.Response(status, json=body), httpx.Response(200, json=TASK_JSON))

    with pytest.raises(error) as refused:
        scripted(script).get(7)

    assert len(script.requests) == 1 and pauses == []
    assert (refused.value.status, refused.value.code) == (status, body["error"])
    assert refused.value.fields == body.get("fields", {})


def test_a_throttled_answer_raises_throttled_with_retry_after_and_is_not_retried(
    pauses: list[float],
) -> None:
    throttled = httpx.Response(
        429,
        json={"error": "throttled", "detail": "Try again in 17 seconds."},
        headers={"Retry-After": "17"},
    )
    script = Script(throttled, httpx.Response(200, json=TASK_JSON))

    with pytest.raises(Throttled) as refused:
        scripted(script).complete(7, lease_token="t")

    assert isinstance(refused.value, TaskboardError)
    assert len(script.requests) == 1 and pauses == []
    assert (refused.value.status, refused.value.code) == (429, "throttled")
    assert refused.value.retry_after == 17.0


def test_a_rate_limited_answer_raises_rate_limited_with_retry_after_and_is_not_retried(
    pauses: list[float],
) -> None:
    limited = httpx.Response(
        429,
        json={"error": "rate_limited", "detail": "Rate limited: ... try again in 42 seconds."},
        headers={"Retry-After": "42"},
    )
    script = Script(limited, httpx.Response(201, json=TASK_JSON))

    with pytest.raises(RateLimited) as refused:
        scripted(script).create("t")

    assert isinstance(refused.value, TaskboardError) and not isinstance(refused.value, Throttled)
    assert len(script.requests) == 1 and pauses == []
    assert (refused.value.status, refused.value.code) == (429, "rate_limited")
    assert refused.value.retry_after == 42.0


def test_a_request_sent_without_an_answer_is_repeated_only_when_that_is_harmless(
    pauses: list[float],
) -> None:
    lost_answer = httpx.ReadError("connection reset")

    # A claim or a completion might have taken effect: sending it again could do it twice.
    claim = Script(lost_answer, httpx.Response(200, json={"tasks": []}))
    with pytest.raises(Unavailable) as unknown:
        scripted(claim).claim()
    assert len(claim.requests) == 1
    assert unknown.value.code == "no_answer"

    # A read, or a heartbeat, may be repeated.
    read = Script(lost_answer, httpx.Response(200, json=TASK_JSON))
    assert scripted(read).get(7).id == 7
    heartbeat = Script(lost_answer, httpx.Response(200, json=TASK_JSON))
    assert scripted(heartbeat).heartbeat(7, lease_token="t").id == 7
    assert len(read.requests) == len(heartbeat.requests) == 2

    # So may a create: the server makes one task of requests with one Idempotency-Key.
    create = Script(lost_answer, httpx.Response(201, json=TASK_JSON))
    board = scripted(create)
    assert board.create("t").id == 7
    first, retry = create.requests
    assert first.headers["Idempotency-Key"] == retry.headers["Idempotency-Key"]
    board.create("t")
    assert create.requests[-1].headers["Idempotency-Key"] != first.headers["Idempotency-Key"]
    board.create("t", idempotency_key="mine")
    assert create.requests[-1].headers["Idempotency-Key"] == "mine"


def test_a_server_that_is_not_there_raises_unavailable_after_the_retries() -> None:
    started = time.monotonic()
    nowhere = Client(f"http://127.0.0.1:{free_port()}", "t", retries=2, backoff=0.1)
    with nowhere, pytest.raises(Unavailable) as gave_up:
        nowhere.list_tasks()
    assert isinstance(gave_up.value.__cause__, httpx.ConnectError)
    assert 0.1 <= time.monotonic() - started < 5


BAD_GATEWAY = httpx.Response(502, text="Error while proxying to origin.\n")


def test_a_proxy_s_502_is_retried_only_when_that_is_harmless(pauses: list[float]) -> None:
    """Pushpin answers 502 to new requests it cannot pass on at once (a burst:
    docs/how-to/pushpin.md). As after a lost answer, a read or a create (one Idempotency-Key)
    is sent again; a claim may have run, so its 502 is raised."""
    read = Script(BAD_GATEWAY, httpx.Response(200, json=TASK_JSON))
    assert scripted(read).get(7).id == 7
    create = Script(BAD_GATEWAY, httpx.Response(201, json=TASK_JSON))
    assert scripted(create).create("t").id == 7
    assert len(read.requests) == len(create.requests) == 2

    claim = Script(BAD_GATEWAY, httpx.Response(200, json={"tasks": []}))
    with pytest.raises(TaskboardError) as refused:
        scripted(claim).claim()
    assert refused.value.status == 502
    assert len(claim.requests) == 1


def test_the_stream_reconnects_after_a_proxy_s_502(pauses: list[float]) -> None:
    event = {
        "id": 5,
        "task_id": 7,
        "type": "created",
        "status": "pending",
        "actor": "agent-smith",
        "payload": {},
        "created_at": "2025-01-01T00:00:00+00:00",
    }
    body = f"retry: 1000\nid: 5\nevent: task_event\ndata: {json.dumps(event)}\n\n"
    script = Script(
        BAD_GATEWAY,
        httpx.Response(200, text=body, headers={"Content-Type": "text/event-stream"}),
    )

    first = next(scripted(script).stream())

    assert (first.id, first.stream_id) == (5, "5")
    assert len(script.requests) == 2


def test_the_stream_resumes_after_the_last_event_received_whole_not_one_cut_off() -> None:
    """As EventSource: an ``id:`` counts once its block ends. A connection that drops after
    an event's ``id:`` line and before its end must resume before that event, or the event
    is never received."""
    parser = client_module.SSEParser()
    for line in ["retry: 1000", "id: 41", ": connected", ""]:
        assert parser.feed(line) is None
    assert parser.last_id == "41"

    parser.feed("id: 42")
    parser.feed("event: task_event")
    # The connection drops here: the client resumes with the id it has.
    assert parser.last_id == "41"
