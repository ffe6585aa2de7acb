"""The SSE stream and its relay, against a real uvicorn server on the test database."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import psycopg
import pytest
from django.db import connection, transaction

from board import relay as relay_module
from board import stream as stream_module
from board import transitions
from board.models import TaskEvent
from tests.factories import TokenFactory, UserFactory
from tests.live import LiveServer, StreamCollector, live_server

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def watcher() -> dict[str, str]:
    token = TokenFactory(user=UserFactory(username="watcher"))
    return {"Authorization": f"Bearer {token.key}"}


def stream_url(server: LiveServer) -> str:
    return f"{server.url}/api/v1/stream/"


def relay_of(server: LiveServer) -> relay_module.Relay:
    [relay] = [r for loop, r in relay_module._relays.items() if not loop.is_closed()]
    return relay


def database_connections() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid()"
        )
        return int(cursor.fetchone()[0])


def test_a_new_event_reaches_an_open_stream_within_a_second(
    server: LiveServer, watcher: dict[str, str], agent: Any
) -> None:
    with StreamCollector(stream_url(server), watcher) as stream:
        assert stream.status == 200
        assert stream.content_type.startswith("text/event-stream")
        started = time.monotonic()
        task = transitions.create(actor=agent, title="watch me")
        event = stream.get(timeout=5)
        elapsed = time.monotonic() - started

    assert event["event"] == "task_event"
    assert event["json"]["task_id"] == task.id
    assert event["json"]["type"] == "created"
    assert event["json"]["actor"] == agent.username
    assert event["id"]
    assert elapsed < 1.0


def test_the_stream_refuses_a_client_without_credentials(server: LiveServer) -> None:
    with StreamCollector(stream_url(server)) as stream:
        assert stream.status == 401


@pytest.mark.parametrize("resume", ["\u00b2", "\u00b3", "1\u00b9"])
def test_a_resume_id_that_is_not_ascii_digits_starts_the_stream_with_the_next_event(
    server: LiveServer, watcher: dict[str, str], agent: Any, resume: str
) -> None:
    # "²".isdigit() is true and int("²") raises: this was a 500.
    transitions.create(actor=agent, title="before")
    with StreamCollector(stream_url(server), {**watcher, "Last-Event-ID": resume}) as stream:
        assert stream.status == 200
        task = transitions.create(actor=agent, title="after")
        assert stream.get(timeout=5)["json"]["task_id"] == task.id


def test_the_stream_refuses_a_resume_id_given_twice_with_400(
    server: LiveServer, watcher: dict[str, str]
) -> None:
    response = httpx.get(
        stream_url(server), params=[("lastEventId", "1"), ("lastEventId", "2")], headers=watcher
    )

    assert response.status_code == 400
    assert response.json()["error"] == "invalid"
    assert response.json()["fields"] == {"lastEventId": ["Give this parameter once."]}


def test_a_client_that_reconnects_is_replayed_what_it_missed_in_order(
    server: LiveServer, watcher: dict[str, str], agent: Any
) -> None:
    with StreamCollector(stream_url(server), watcher) as stream:
        task = transitions.create(actor=agent, title="first")
        last_seen = stream.get()["id"]

    [claim] = transitions.claim(actor=agent)
    transitions.heartbeat(task_id=task.id, actor=agent, lease_token=claim.lease_token)
    transitions.complete(task_id=task.id, actor=agent, lease_token=claim.lease_token)

    with StreamCollector(stream_url(server), {**watcher, "Last-Event-ID": last_seen}) as stream:
        missed = stream.take(3)
        assert stream.nothing_within(0.3), "no event twice"
    assert [event["json"]["type"] for event in missed] == ["claimed", "heartbeat", "completed"]

    # The query parameter does the same for clients that cannot set the header.
    with StreamCollector(stream_url(server), watcher, lastEventId=last_seen) as stream:
        again = stream.take(3)
    assert [event["id"] for event in again] == [event["id"] for event in missed]


def test_replay_works_across_a_server_restart(watcher: dict[str, str], agent: Any) -> None:
    with live_server() as first, StreamCollector(stream_url(first), watcher) as stream:
        transitions.create(actor=agent, title="before the restart")
        last_seen = stream.get()["id"]

    made_while_down = [transitions.create(actor=agent, title=f"down {n}").id for n in range(3)]

    with (
        live_server() as second,
        StreamCollector(stream_url(second), {**watcher, "Last-Event-ID": last_seen}) as stream,
    ):
        replayed = stream.take(3)
    assert [event["json"]["task_id"] for event in replayed] == made_while_down


def test_the_relay_reconnects_and_delivers_what_happened_while_it_was_cut_off(
    server: LiveServer, watcher: dict[str, str], agent: Any
) -> None:
    with StreamCollector(stream_url(server), watcher) as stream:
        transitions.create(actor=agent, title="warm up")
        stream.get()
        relay = relay_of(server)
        reconnects = relay.reconnects
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [relay.backend_pid])
        during_gap = [transitions.create(actor=agent, title=f"gap {n}").id for n in range(5)]

        events = stream.take(5, timeout=10)

    assert [event["json"]["task_id"] for event in events] == during_gap
    assert relay.reconnects == reconnects + 1


def test_an_event_that_commits_late_is_not_skipped(
    server: LiveServer, watcher: dict[str, str], agent: Any
) -> None:
    """T1 takes event id N and commits after T2 (id N+1) has committed: a reader that
    followed ids would have moved past N. The stream holds N+1 back until T1 finishes."""
    inserted, release = threading.Event(), threading.Event()
    early: dict[str, int] = {}

    def slow_transaction() -> None:
        try:
            with transaction.atomic():
                early["task"] = transitions.create(actor=agent, title="early id, late commit").id
                inserted.set()
                release.wait(10)
        finally:
            connection.close()

    with StreamCollector(stream_url(server), watcher) as stream:
        thread = threading.Thread(target=slow_transaction)
        thread.start()
        assert inserted.wait(10)
        late = transitions.create(actor=agent, title="later id, early commit")
        assert stream.nothing_within(0.5), "nothing may pass the open transaction"
        release.set()
        thread.join(10)
        events = stream.take(2)

    early_event = TaskEvent.objects.get(task_id=early["task"])
    late_event = TaskEvent.objects.get(task_id=late.id)
    assert early_event.id < late_event.id
    assert [event["json"]["id"] for event in events] == [early_event.id, late_event.id]

    # A client resuming from the late event must not be handed the early one again.
    with StreamCollector(
        stream_url(server), {**watcher, "Last-Event-ID": str(late_event.id)}
    ) as stream:
        assert stream.nothing_within(0.3)


def test_streams_hold_no_database_connection(
    server: LiveServer, watcher: dict[str, str], agent: Any
) -> None:
    with StreamCollector(stream_url(server), watcher) as first:
        transitions.create(actor=agent, title="start the relay")
        first.get()
        before = database_connections()
        streams = [StreamCollector(stream_url(server), watcher).__enter__() for _ in range(25)]
        try:
            time.sleep(0.3)
            during = database_connections()
            transitions.create(actor=agent, title="to everyone")
            for stream in streams:
                assert stream.get()["event"] == "task_event"
        finally:
            for stream in streams:
                stream.close()

    assert during <= before, f"{during - before} connections more for 25 open streams"


def test_an_idle_stream_gets_keep_alive_comments(
    server: LiveServer, watcher: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stream_module, "KEEPALIVE_SECONDS", 0.2)
    with StreamCollector(stream_url(server), watcher) as stream:
        time.sleep(0.7)
        comments = list(stream.comments)

    assert ": connected" in comments
    assert comments.count(": keep-alive") >= 2
    assert stream_module.KEEPALIVE_SECONDS < 30


def test_a_lagging_subscriber_catches_up_without_gaps(agent: Any) -> None:
    """A subscriber whose queue overflows is replayed from the relay's memory."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result(10)

    relay = relay_module.Relay(relay_module.django_conninfo(), subscriber_queue=2)
    run(relay.start())
    try:
        subscriber = relay.subscribe()
        expected = [transitions.create(actor=agent, title=f"burst {n}").id for n in range(6)]
        deadline = time.monotonic() + 5
        while len(relay.buffer) < 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert subscriber.lagging

        async def catch_up() -> list[int]:
            upto = relay.resume(subscriber)
            return [
                event.task_id
                async for page in relay.replay(subscriber.start, upto)
                for event in page
            ]

        assert run(catch_up()) == expected
    finally:
        run(relay.stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def test_resuming_from_id_zero_replays_the_whole_log(
    server: LiveServer, watcher: dict[str, str], agent: Any
) -> None:
    """A page drawn from an empty log resumes from 0: nothing made since may be lost."""
    made = [transitions.create(actor=agent, title=f"early {n}").id for n in range(2)]

    with StreamCollector(stream_url(server), watcher, lastEventId="0") as stream:
        replayed = stream.take(2)

    assert [event["json"]["task_id"] for event in replayed] == made


def test_a_transaction_in_another_database_does_not_hold_the_stream_back(
    server: LiveServer, watcher: dict[str, str], agent: Any
) -> None:
    """Only this database's transactions can add events: a long write transaction in
    another database on the same server must not delay delivery."""
    params = psycopg.conninfo.conninfo_to_dict(relay_module.django_conninfo())
    with psycopg.connect(**{**params, "dbname": "postgres"}) as elsewhere:
        elsewhere.execute("SELECT pg_current_xact_id()")  # takes a transaction id, stays open
        with StreamCollector(stream_url(server), watcher) as stream:
            started = time.monotonic()
            task = transitions.create(actor=agent, title="not held back")
            event = stream.get(timeout=5)
            elapsed = time.monotonic() - started
        elsewhere.rollback()

    assert event["json"]["task_id"] == task.id
    assert elapsed < 1.0
