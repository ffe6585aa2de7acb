"""Per-user write rates (access.rates): creates and comments past a user's rate are refused
with 429 rate_limited and Retry-After, write nothing, and are counted in the database, so
that every server process and connection enforces one limit."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from django.db import connection
from rest_framework.test import APIClient

from access import rates
from access.models import WriteCount
from board.exceptions import RateLimited
from board.models import Task, TaskEvent
from tests.factories import TokenFactory, UserFactory
from tests.live import LiveServer
from tests.test_api import post
from tests.test_mcp import call, mcp_session, run, text_of
from tests.test_tokens import serve_process  # noqa: F401 (a fixture)

pytestmark = pytest.mark.django_db


def fresh_window(seconds_needed: float = 10) -> None:
    """Wait, if need be, until the current minute's window has ``seconds_needed`` left and
    the previous one weighs nothing, so that a test's writes all count in one window."""
    import time

    with connection.cursor() as cursor:
        cursor.execute("SELECT extract(epoch FROM statement_timestamp())::float8")
        now = cursor.fetchone()[0]
    left = rates.WINDOW_SECONDS - now % rates.WINDOW_SECONDS
    if left < seconds_needed:
        time.sleep(left + 0.05)


def assert_rate_limited(response: Any) -> int:
    """Assert that ``response`` is the rate's refusal; return its Retry-After."""
    assert response.status_code == 429, response.content
    body = response.json()
    assert body["error"] == "rate_limited"
    assert "try again in" in body["detail"]
    seconds = int(response.headers["Retry-After"])
    assert 1 <= seconds <= 2 * rates.WINDOW_SECONDS
    assert f"try again in {seconds} seconds" in body["detail"]
    return seconds


def test_a_create_past_the_rate_is_refused_with_retry_after_and_writes_nothing(
    api: Callable[[Any], APIClient], agent: Any, settings: Any
) -> None:
    settings.TASKBOARD_CREATE_RATE = 3
    fresh_window()
    client = api(agent)
    for n in range(3):
        assert post(client, "tasks/", {"title": f"ok {n}"}).status_code == 201

    assert_rate_limited(post(client, "tasks/", {"title": "one too many"}))
    # Refused ones do not count: the next is refused as well, not later than this one.
    assert_rate_limited(post(client, "tasks/", {"title": "one too many"}))

    assert not Task.objects.filter(title="one too many").exists()
    assert Task.objects.count() == 3
    assert TaskEvent.objects.count() == 3  # the three "created", nothing of the refused
    assert WriteCount.objects.get().count == 3


def test_an_idempotent_create_past_the_rate_is_refused_too_and_creates_nothing(
    api: Callable[[Any], APIClient], agent: Any, settings: Any
) -> None:
    settings.TASKBOARD_CREATE_RATE = 1
    fresh_window()
    client = api(agent)
    assert post(client, "tasks/", {"title": "first"}).status_code == 201
    response = client.post(
        "/api/v1/tasks/", {"title": "keyed"}, format="json", HTTP_IDEMPOTENCY_KEY="k-1"
    )
    assert_rate_limited(response)
    assert not Task.objects.filter(idempotency_key="k-1").exists()


def test_comments_past_the_rate_are_refused_and_write_no_event(
    api: Callable[[Any], APIClient], agent: Any, make_task: Callable[..., Any], settings: Any
) -> None:
    settings.TASKBOARD_COMMENT_RATE = 2
    fresh_window()
    task = make_task()
    client = api(agent)
    for n in range(2):
        assert post(client, f"tasks/{task.pk}/comments/", {"body": f"c{n}"}).status_code == 201

    assert_rate_limited(post(client, f"tasks/{task.pk}/comments/", {"body": "c2"}))
    bodies = [e.payload["body"] for e in TaskEvent.objects.filter(type="commented")]
    assert bodies == ["c0", "c1"]
    # Creates have a rate of their own.
    assert post(client, "tasks/", {"title": "still fine"}).status_code == 201


def test_each_user_has_a_rate_of_their_own(
    api: Callable[[Any], APIClient], agent: Any, other_agent: Any, settings: Any
) -> None:
    settings.TASKBOARD_CREATE_RATE = 1
    fresh_window()
    assert post(api(agent), "tasks/", {"title": "a"}).status_code == 201
    assert_rate_limited(post(api(agent), "tasks/", {"title": "a again"}))
    assert post(api(other_agent), "tasks/", {"title": "b"}).status_code == 201


def test_a_rate_of_zero_is_no_limit_and_counts_nothing(
    api: Callable[[Any], APIClient], agent: Any, make_task: Callable[..., Any], settings: Any
) -> None:
    settings.TASKBOARD_CREATE_RATE = 0
    settings.TASKBOARD_COMMENT_RATE = 0
    client = api(agent)
    task = make_task()
    for n in range(30):
        assert post(client, "tasks/", {"title": f"t{n}"}).status_code == 201
        assert post(client, f"tasks/{task.pk}/comments/", {"body": "c"}).status_code == 201
    assert not WriteCount.objects.exists()


def test_invalid_or_forbidden_creates_do_not_count(
    api: Callable[[Any], APIClient], agent: Any, settings: Any
) -> None:
    settings.TASKBOARD_CREATE_RATE = 1
    fresh_window()
    client = api(agent)
    for _ in range(3):
        assert post(client, "tasks/", {"title": ""}).status_code == 400
        assert post(client, "tasks/", {"title": "x", "depends_on": [999_999]}).status_code == 404
    assert post(client, "tasks/", {"title": "counted"}).status_code == 201


def test_the_previous_minutes_writes_still_weigh_after_the_window_turns(
    agent: Any, settings: Any
) -> None:
    """The sliding estimate: a user who spent the whole rate late in the last minute is not
    handed the full rate again the moment a new minute begins."""
    settings.TASKBOARD_CREATE_RATE = 10
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO write_counts (window_end, user_id, kind, count) VALUES "
            "(to_timestamp(floor(extract(epoch FROM statement_timestamp()) / 60) * 60), "
            "%s, 'create', 10)",
            [agent.pk],
        )
        cursor.execute("SELECT extract(epoch FROM statement_timestamp())::float8")
        left = 60 - cursor.fetchone()[0] % 60
    # The previous window's 10 weigh 10 * left / 60: the room is what remains of the 10.
    room = int(10 - 10 * left / 60)
    spent = 0
    with pytest.raises(RateLimited) as refused:
        for _ in range(11):
            rates.spend(agent, rates.Write.CREATE)
            spent += 1
    assert spent in (room, room + 1)  # a second may pass between the two readings
    assert 1 <= refused.value.retry_after <= 60


def creates_at_once(url: str, tokens: list[str], count: int) -> list[int]:
    """Send ``count`` creates at once, from as many threads, one token each in turn, each
    with a connection of its own; return the statuses."""
    barrier = threading.Barrier(count)
    statuses: list[int] = []

    def create(n: int) -> None:
        headers = {"Authorization": f"Bearer {tokens[n % len(tokens)]}"}
        with httpx.Client(timeout=30) as http:
            barrier.wait()
            statuses.append(
                http.post(
                    f"{url}/api/v1/tasks/", json={"title": f"t{n}"}, headers=headers
                ).status_code
            )

    threads = [threading.Thread(target=create, args=(n,)) for n in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return statuses


@pytest.mark.django_db(transaction=True)
def test_concurrent_creates_never_pass_the_rate_together(
    server: LiveServer, agent: Any, settings: Any
) -> None:
    settings.TASKBOARD_CREATE_RATE = 5
    fresh_window(20)
    token = str(TokenFactory.create(user=agent).key)

    statuses = creates_at_once(server.url, [token], 16)

    assert sorted(statuses) == [201] * 5 + [429] * 11
    assert Task.objects.count() == 5


@pytest.mark.slow
@pytest.mark.once
@pytest.mark.django_db(transaction=True)
def test_the_count_is_shared_by_two_server_processes(
    server: LiveServer,
    serve_process: str,  # noqa: F811
    agent: Any,
    settings: Any,
    monkeypatch: Any,
) -> None:
    """Each process alone sees half the creates: the limit holds because the count lives
    in the database. The serve process reads its rate from the environment."""
    settings.TASKBOARD_CREATE_RATE = 6000  # the default, which the serve process has too
    fresh_window(20)
    token = str(TokenFactory.create(user=agent).key)
    headers = {"Authorization": f"Bearer {token}"}
    # Most of the default rate spent through the database, as a third process would.
    with connection.cursor() as cursor:
        cursor.execute(
            rates.QUERIES["spend"],
            {"user_id": agent.pk, "kind": "create", "count": 5990, "limit": 6000, "window": 60},
        )
    statuses = []
    for n in range(20):
        url = server.url if n % 2 else serve_process
        statuses.append(
            httpx.post(f"{url}/api/v1/tasks/", json={"title": f"t{n}"}, headers=headers).status_code
        )
    assert statuses == [201] * 10 + [429] * 10
    assert Task.objects.count() == 10


@pytest.mark.slow
@pytest.mark.once
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_an_mcp_tool_past_the_rate_says_rate_limited_and_when_to_retry(
    server: LiveServer, settings: Any, transport: str
) -> None:
    settings.TASKBOARD_CREATE_RATE = 1
    settings.TASKBOARD_COMMENT_RATE = 1
    fresh_window(20)
    token = str(TokenFactory.create(user=UserFactory.create(username="llm-agent")).key)

    async def test() -> None:
        async with mcp_session(server, token, transport) as session:
            await session.initialize()
            task_id = (await call(session, "create_task", title="one"))["id"]
            refused = await session.call_tool("create_task", {"title": "two"})
            assert refused.is_error, text_of(refused)
            assert "rate_limited: " in text_of(refused), text_of(refused)
            assert "try again in" in text_of(refused)
            await call(session, "comment_task", task_id=task_id, body="a")
            again = await session.call_tool("comment_task", {"task_id": task_id, "body": "b"})
            assert "rate_limited: " in text_of(again), text_of(again)

    run(test)
    assert list(Task.objects.values_list("title", flat=True)) == ["one"]
