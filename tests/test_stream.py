"""The SSE stream and its relay, against a real uvicorn server on the test database."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import psutil
import psycopg
import pytest
from django.db import connection, transaction

from board import transitions
from board.access import EVERY_QUEUE
from board.live import relay as relay_module
from board.live import stream as stream_module
from board.models import TaskEvent
from tests import processes
from tests.factories import TokenFactory, UserFactory
from tests.live import (
    LiveServer,
    StreamCollector,
    live_server,
    live_server_behind_pushpin,
    relay_cut_off,
)
from tests.processes import ServeProcess, eventually


def committed_head_id() -> int:
    """The id of the last event below the horizon, as the relay, streams and pages read it."""
    _, head = relay_module.run_on_django(relay_module.head_below_horizon())
    return head.id


pytestmark = pytest.mark.django_db(transaction=True)


# Through Pushpin, the stream is the same SQL as without it: once is enough for that path.
@pytest.fixture(params=["direct", pytest.param("pushpin", marks=pytest.mark.once)])
def server(request: Any, tmp_path: Any, settings: Any) -> Iterator[LiveServer]:
    """The server of each test below: uvicorn itself, and uvicorn behind a real Pushpin
    that holds the streams (board.live.grip), so that every test here holds for both paths."""
    if request.param == "direct":
        with live_server() as running:
            yield running
        return
    if shutil.which("pushpin") is None:
        pytest.skip("no pushpin (apt-get install pushpin; .ci/run installs it)")
    with live_server_behind_pushpin(tmp_path / "pushpin", settings) as running:
        yield running


@pytest.fixture
def watcher() -> dict[str, str]:
    token = TokenFactory.create(user=UserFactory.create(username="watcher"))
    return {"Authorization": f"Bearer {token.key}"}


def stream_url(server: LiveServer | ServeProcess) -> str:
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


def test_a_new_event_reaches_an_open_stream_when_it_is_committed(
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
    assert elapsed < 5.0  # the notification, not the relay's 30 s check; room for load


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
        # Pushpin keeps a held stream alive in whole seconds, a little early at random.
        time.sleep(2.5 if server.url != server.origin_url else 0.7)
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


def test_a_subscriber_hands_over_what_was_offered_and_wakes_for_the_stop() -> None:
    """Subscriber.wait: what came meanwhile at once, [] after the timeout, a wake-up on the
    next offer, and the stop (None) even when the subscriber lags."""

    def event(n: int) -> relay_module.StreamEvent:
        return relay_module.StreamEvent(
            relay_module.Cursor(1, n), n, "created", "pending", "q", None, None, b""
        )

    async def scenario() -> None:
        subscriber = relay_module.Subscriber(relay_module.START, maxsize=3)
        subscriber.offer([event(1), event(2)])
        assert [e.task_id for e in await subscriber.wait(5) if e] == [1, 2]

        started = time.monotonic()
        assert await subscriber.wait(0.05) == []
        assert 0.04 < time.monotonic() - started < 1

        loop = asyncio.get_running_loop()
        loop.call_later(0.05, subscriber.offer, [event(3)])
        woken = await asyncio.wait_for(subscriber.wait(30), 5)
        assert [e.task_id for e in woken if e] == [3]

        subscriber.offer([event(4), event(5), event(6), event(7)])  # more than maxsize
        assert subscriber.lagging
        assert await asyncio.wait_for(subscriber.wait(30), 1) == []
        subscriber.close()
        assert await asyncio.wait_for(subscriber.wait(30), 1) == [None]

    asyncio.run(scenario())


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
    with psycopg.connect(relay_module.django_conninfo(), dbname="postgres") as elsewhere:
        elsewhere.execute("SELECT pg_current_xact_id()")  # takes a transaction id, stays open
        with StreamCollector(stream_url(server), watcher) as stream:
            started = time.monotonic()
            task = transitions.create(actor=agent, title="not held back")
            event = stream.get(timeout=5)
            elapsed = time.monotonic() - started
        elsewhere.rollback()

    assert event["json"]["task_id"] == task.id
    assert elapsed < 5.0  # the notification, not the relay's 30 s check; room for load


def test_the_stream_head_compares_transaction_ids_as_numbers(agent: Any) -> None:
    """Once transaction ids grow a digit (past 9,999, 99,999, ...), a head found by sorting
    them as text would be an old event, and the board would replay the log from there.

    Reaching the next digit can take millions of transactions, so the old event is
    written as the log holds it after that: by a transaction whose id has a digit fewer,
    all nines, which sorts after every newer id as text.
    """

    old = transitions.create(actor=agent, title="long ago")
    newest = transitions.create(actor=agent, title="now")
    newest_event = TaskEvent.objects.get(task_id=newest.id)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_current_xact_id()::text")
        digits = len(cursor.fetchone()[0])
        old_txid = 10 ** (digits - 1) - 1
        cursor.execute(
            "INSERT INTO task_events (task_id, type, status, actor, payload, txid) "
            "VALUES (%s, 'created', 'pending', 'system', '{}', %s::text::xid8)",
            [old.id, str(old_txid)],
        )
        cursor.execute("SELECT max(txid::text) FROM task_events")
        assert cursor.fetchone()[0] == str(old_txid), "as text, the old id sorts last"

    assert committed_head_id() == newest_event.id

    loop = asyncio.new_event_loop()
    relay = relay_module.Relay(relay_module.django_conninfo())
    try:
        loop.run_until_complete(relay.start())
        assert relay.head is not None
        assert relay.head.id == newest_event.id
    finally:
        loop.run_until_complete(relay.stop())
        loop.close()


def test_event_ids_past_two_to_the_31_resume_a_stream(
    server: LiveServer, watcher: dict[str, str], agent: Any
) -> None:

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT setval(pg_get_serial_sequence('task_events', 'id'), %s)", [2**31 + 10]
        )
    first = transitions.create(actor=agent, title="big id")
    second = transitions.create(actor=agent, title="bigger id")
    first_event = TaskEvent.objects.get(task_id=first.id)
    second_event = TaskEvent.objects.get(task_id=second.id)
    assert first_event.id > 2**31

    assert committed_head_id() == second_event.id
    with StreamCollector(
        stream_url(server), {**watcher, "Last-Event-ID": str(first_event.id)}
    ) as stream:
        [replayed] = stream.take(1)
        assert stream.nothing_within(0.3)
    assert replayed["id"] == str(second_event.id)


class BackgroundLoop:
    """An event loop in a thread of its own, as a server process has; ``pause()`` stops it
    dead (as SIGSTOP would stop a server) until ``resume()``."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.gate = threading.Event()
        self.thread.start()

    def run(self, coroutine: Any, timeout: float = 10) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def pause(self) -> None:
        self.gate.clear()
        self.loop.call_soon_threadsafe(self.gate.wait)

    def resume(self) -> None:
        self.gate.set()

    def close(self) -> None:
        self.gate.set()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def sse_ids(chunks: list[bytes]) -> list[int]:
    """The ids of the events sent (not the stream's opening position, an id without data)."""
    return [
        int(line[4:])
        for block in b"".join(chunks).decode().split("\n\n")
        if "\ndata: " in block
        for line in block.splitlines()
        if line.startswith("id: ")
    ]


def test_a_resume_ahead_of_a_relay_that_is_behind_repeats_nothing(agent: Any) -> None:
    """A server process that was stopped (or lost its LISTEN connection) has a relay behind
    the log. A client resuming there from the newest event must not be sent, as the
    relay catches up, the events it had already received from another process."""
    background = BackgroundLoop()
    # Small pages: the relay catches up on the 30 events in three reads.
    relay = relay_module.Relay(relay_module.django_conninfo(), batch=10)
    background.run(relay.start())
    chunks: list[bytes] = []
    try:
        background.pause()
        made_elsewhere = [transitions.create(actor=agent, title=f"via A {n}") for n in range(30)]
        with connection.cursor() as cursor:
            cursor.execute("SELECT txid::text, id FROM task_events ORDER BY id DESC LIMIT 1")
            txid, newest_id = cursor.fetchone()
        resume_from = relay_module.Cursor(int(txid), newest_id)
        assert relay.head is not None and relay.head < resume_from

        async def follow() -> None:
            async for chunk in stream_module.events(relay, resume_from):
                chunks.append(chunk)

        following = asyncio.run_coroutine_threadsafe(follow(), background.loop)
        background.resume()
        deadline = time.monotonic() + 10
        while relay.head < resume_from and time.monotonic() < deadline:
            time.sleep(0.02)
        assert relay.head >= resume_from, "the relay did not catch up"

        after = transitions.create(actor=agent, title="after the resume")
        after_event = TaskEvent.objects.get(task_id=after.id)
        deadline = time.monotonic() + 10
        while after_event.id not in sse_ids(chunks) and time.monotonic() < deadline:
            time.sleep(0.02)
        following.cancel()
    finally:
        background.run(relay.stop())
        background.close()

    assert len(made_elsewhere) == 30
    assert sse_ids(chunks) == [after_event.id]


def test_the_relay_reconnects_at_once_after_every_loss_of_a_healthy_connection() -> None:
    """The reconnect delay doubles while connecting fails, and starts over once a
    connection has been healthy: the eighth loss in a day costs no more than the first."""
    background = BackgroundLoop()
    relay = relay_module.Relay(relay_module.django_conninfo())
    relay.healthy_after = 0.2
    background.run(relay.start())
    delays = []
    try:
        for _ in range(8):
            time.sleep(0.3)  # healthy for longer than healthy_after
            pid = relay.backend_pid
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
            lost = time.monotonic()
            deadline = lost + 15
            while not (relay.connected.is_set() and relay.backend_pid != pid):
                assert time.monotonic() < deadline, "the relay did not reconnect"
                time.sleep(0.01)
            delays.append(time.monotonic() - lost)
    finally:
        background.run(relay.stop())
        background.close()

    assert relay.reconnects == 8
    assert max(delays) < 1.5, f"reconnect delays: {[round(d, 2) for d in delays]}"


def test_a_change_the_relay_heard_is_not_acted_on_again_when_it_reconnects() -> None:
    """A reconnecting relay acts on the users whose count of changes moved since it last
    read them (migration 0015); a change it heard and acted on meanwhile is not one."""
    from access import tokens

    user = UserFactory.create(username="heard-once")
    TokenFactory.create(user=user)
    background = BackgroundLoop()
    relay = relay_module.Relay(relay_module.django_conninfo())
    heard: list[int | None] = []
    relay.credential_listeners.add(heard.append)
    background.run(relay.start())
    try:
        deadline = time.monotonic() + 10
        while not relay.connected.is_set():
            assert time.monotonic() < deadline, "the relay did not connect"
            time.sleep(0.01)
        tokens.issue(user)
        deadline = time.monotonic() + 5
        while user.pk not in heard:
            assert time.monotonic() < deadline, "the change was not heard"
            time.sleep(0.01)
        time.sleep(0.3)  # the relay reads the user's count after acting on the change
        heard.clear()

        pid = relay.backend_pid
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
        while not (relay.connected.is_set() and relay.backend_pid != pid):
            assert time.monotonic() < deadline + 10, "the relay did not reconnect"
            time.sleep(0.01)
    finally:
        background.run(relay.stop())
        background.close()

    assert heard == [None]


def test_a_database_url_that_names_its_sessions_still_streams(
    server: LiveServer, watcher: dict[str, str], agent: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DATABASE_URL=...?application_name=... names the server's sessions: the relay's
    connection string took a second name and could not be made (a 500)."""
    options = connection.settings_dict.setdefault("OPTIONS", {})
    monkeypatch.setitem(options, "application_name", "taskboard-web")

    with StreamCollector(stream_url(server), watcher) as stream:
        assert stream.status == 200
        task = transitions.create(actor=agent, title="named sessions")
        assert stream.get()["json"]["task_id"] == task.id


def ended_within(stream: StreamCollector, seconds: float) -> bool:
    """Return whether the server ended ``stream`` within ``seconds``."""
    stream._thread.join(seconds)
    return not stream._thread.is_alive()


@pytest.fixture
def quick_recheck(settings: Any) -> None:
    settings.TASKBOARD_TOKEN_CACHE_SECONDS = 1
    settings.TASKBOARD_HELD_STREAM_RECHECK_SECONDS = 1


@pytest.mark.usefixtures("quick_recheck")
def test_an_open_stream_ends_when_its_token_is_rotated(server: LiveServer) -> None:
    from access import tokens

    user = UserFactory.create(username="leaky")
    old = TokenFactory.create(user=user).key
    with StreamCollector(stream_url(server), {"Authorization": f"Bearer {old}"}) as stream:
        assert stream.status == 200
        tokens.issue(user)

        assert ended_within(stream, 5), "the stream outlived its token"
    with StreamCollector(stream_url(server), {"Authorization": f"Bearer {old}"}) as again:
        assert again.status == 401


@pytest.mark.usefixtures("quick_recheck")
def test_an_open_stream_ends_when_its_user_is_deactivated(
    server: LiveServer, watcher: dict[str, str]
) -> None:
    with StreamCollector(stream_url(server), watcher) as stream:
        assert stream.status == 200
        UserFactory._meta.model.objects.filter(username="watcher").update(is_active=False)

        assert ended_within(stream, 5), "the stream outlived its user"


@pytest.mark.usefixtures("quick_recheck")
def test_an_open_stream_of_a_browser_ends_when_its_session_does(server: LiveServer) -> None:
    from django.contrib.sessions.models import Session
    from django.test import Client

    browser = Client()
    browser.force_login(UserFactory.create(username="person"))
    cookie = f"sessionid={browser.cookies['sessionid'].value}"
    with StreamCollector(stream_url(server), {"Cookie": cookie}) as stream:
        assert stream.status == 200
        assert not ended_within(stream, 1.5), "a valid session keeps its stream"
        Session.objects.all().delete()  # logged out, everywhere

        assert ended_within(stream, 5), "the stream outlived its session"


# How long a valid stream is seen to stay open before the change. Pushpin asks a held
# stream's next link about a second after it subscribes a channel (and the board then
# checks the credentials again): a change made after this long is not caught by that.
SETTLED = 2.5


@pytest.fixture
def direct_server() -> Iterator[LiveServer]:
    """uvicorn alone, for what only a stream open in the server has."""
    with live_server() as running:
        yield running


@pytest.fixture
def slow_recheck(settings: Any) -> None:
    """The backstops far away: what ends a stream within seconds is the announcement of
    the change (migration 0014, board.live.revocation), not a periodic re-check."""
    settings.TASKBOARD_TOKEN_CACHE_SECONDS = 60
    settings.TASKBOARD_HELD_STREAM_RECHECK_SECONDS = 600


@pytest.mark.usefixtures("slow_recheck")
def test_a_rotated_token_ends_its_stream_at_once_and_is_refused_at_once(
    server: LiveServer,
) -> None:
    from access import tokens

    user = UserFactory.create(username="rotated")
    old = TokenFactory.create(user=user).key
    headers = {"Authorization": f"Bearer {old}"}
    # The token's lookup is now cached in the server, as an agent's is.
    assert httpx.get(f"{server.url}/api/v1/tasks/", headers=headers).status_code == 200
    with StreamCollector(stream_url(server), headers) as stream:
        assert stream.status == 200
        assert not ended_within(stream, SETTLED), "a valid token keeps its stream"
        tokens.issue(user)

        assert ended_within(stream, 3), "the stream outlived its token"
    assert httpx.get(f"{server.url}/api/v1/tasks/", headers=headers).status_code == 401
    with StreamCollector(stream_url(server), headers) as again:
        assert again.status == 401


@pytest.mark.usefixtures("slow_recheck")
def test_a_deactivated_user_s_stream_ends_at_once(
    server: LiveServer, watcher: dict[str, str]
) -> None:
    with StreamCollector(stream_url(server), watcher) as stream:
        assert not ended_within(stream, SETTLED), "a valid user keeps their stream"
        # A queryset update, as a script would do it: no signal, only the database knows.
        UserFactory._meta.model.objects.filter(username="watcher").update(is_active=False)

        assert ended_within(stream, 3), "the stream outlived its user"
    with StreamCollector(stream_url(server), watcher) as again:
        assert again.status == 401


def logged_in(username: str) -> tuple[Any, dict[str, str]]:
    """A browser logged in as a new user, and the Cookie header of its session."""
    from django.test import Client

    browser = Client()
    browser.force_login(UserFactory.create(username=username))
    return browser, {"Cookie": f"sessionid={browser.cookies['sessionid'].value}"}


@pytest.mark.usefixtures("slow_recheck")
def test_a_changed_queue_limit_reaches_the_stream_at_once(
    server: LiveServer, watcher: dict[str, str], agent: Any
) -> None:
    """Open in the server, the stream takes the new limit up in place; held in Pushpin, it
    is closed and its client resumes under the new limit. Either way the client sees no
    event of a queue it lost, a second after the change."""
    from board.access import limit_queues

    user = UserFactory._meta.model.objects.get(username="watcher")
    with StreamCollector(stream_url(server), watcher) as stream:
        first = transitions.create(actor=agent, title="before", queue="secret")
        seen = stream.get()
        assert seen["json"]["task_id"] == first.id
        assert not ended_within(stream, SETTLED)
        limit_queues(user, ["open"])
        time.sleep(1.5)
        transitions.create(actor=agent, title="hidden now", queue="secret")
        visible = transitions.create(actor=agent, title="still seen", queue="open")
        if ended_within(stream, 0):
            resumed = {**watcher, "Last-Event-ID": seen["id"]}
            with StreamCollector(stream_url(server), resumed) as again:
                [event] = again.take(1)
                assert again.nothing_within(0.5)
        else:
            [event] = stream.take(1)
            assert stream.nothing_within(0.5)

    assert event["json"]["task_id"] == visible.id


@pytest.mark.usefixtures("slow_recheck")
def test_a_logout_ends_the_session_s_stream_at_once(server: LiveServer) -> None:
    browser, cookie = logged_in("leaving")
    with StreamCollector(stream_url(server), cookie) as stream:
        assert stream.status == 200
        assert not ended_within(stream, SETTLED), "a valid session keeps its stream"
        browser.logout()

        assert ended_within(stream, 3), "the stream outlived its session"
    with StreamCollector(stream_url(server), cookie) as again:
        assert again.status == 401


@pytest.mark.usefixtures("slow_recheck")
def test_a_change_made_while_the_relay_was_cut_off_ends_the_stream_once_it_listens_again(
    server: LiveServer,
) -> None:
    """The change's notification is lost (nobody in the process is listening): the relay
    learns whose credentials changed meanwhile from their counts (migration 0015) when it
    connects again, and the user's streams end then, held in Pushpin too."""
    from access import tokens

    user = UserFactory.create(username="rotated-in-the-dark")
    headers = {"Authorization": f"Bearer {TokenFactory.create(user=user).key}"}
    relay = relay_of(server)
    with StreamCollector(stream_url(server), headers) as stream:
        assert stream.status == 200
        assert not ended_within(stream, SETTLED), "a valid token keeps its stream"

        with relay_cut_off(relay):
            tokens.issue(user)

        assert ended_within(stream, 3), "the stream outlived its token"
    with StreamCollector(stream_url(server), headers) as again:
        assert again.status == 401


def test_a_logout_ends_the_session_before_it_is_announced() -> None:
    """The announcement wakes the re-check of the session's streams: by then the session
    must be gone, or the re-check finds it and keeps the stream (Django sends
    user_logged_out before it flushes the session)."""
    from django.contrib.auth.signals import user_logged_out
    from django.contrib.sessions.models import Session

    browser, _ = logged_in("leaving-first")
    key = browser.cookies["sessionid"].value
    seen: list[bool] = []

    def after_the_announcement(**kwargs: Any) -> None:  # connected after access's receiver
        seen.append(Session.objects.filter(session_key=key).exists())

    user_logged_out.connect(after_the_announcement, dispatch_uid="test.after")
    try:
        browser.logout()
    finally:
        user_logged_out.disconnect(dispatch_uid="test.after")
    assert seen == [False]


def task_as_the_api_shows_it(task_id: int, headers: dict[str, str], server: LiveServer) -> Any:
    task = httpx.get(f"{server.url}/api/v1/tasks/{task_id}/", headers=headers).json()
    task.pop("events", None)
    task.pop("links", None)
    return task


def test_each_streamed_event_carries_the_task_as_it_is_after_the_event(
    server: LiveServer, watcher: dict[str, str], agent: Any
) -> None:
    with StreamCollector(stream_url(server), watcher) as stream:
        task = transitions.create(actor=agent, title="follow me", payload={"n": 1})
        created = stream.get(timeout=5)["json"]["task"]
        [claim] = transitions.claim(actor=agent)
        claimed = stream.get(timeout=5)["json"]["task"]
        transitions.heartbeat(
            task_id=task.id, actor=agent, lease_token=claim.lease_token, progress={"step": 2}
        )
        beat = stream.get(timeout=5)["json"]["task"]
        transitions.complete(
            task_id=task.id, actor=agent, lease_token=claim.lease_token, result={"ok": True}
        )
        completed = stream.get(timeout=5)["json"]["task"]

    assert (created["status"], created["title"], created["payload"]) == (
        "pending",
        "follow me",
        {"n": 1},
    )
    assert (claimed["status"], claimed["leased_by"]) == ("in_progress", agent.username)
    assert claimed["attempt_started_at"] is not None
    assert beat["progress"] == {"step": 2}
    assert beat["leased_until"] >= claimed["leased_until"]
    assert (completed["status"], completed["result"], completed["leased_by"]) == (
        "done",
        {"ok": True},
        None,
    )
    # The last one is the task exactly as the API shows it.
    assert completed == task_as_the_api_shows_it(task.id, watcher, server)


def test_an_event_whose_task_changed_since_is_sent_without_a_stale_task(
    watcher: dict[str, str], agent: Any
) -> None:
    """Replayed from the database, only each task's latest event can say how the task is
    after it; the earlier ones carry null, never a task as it was later."""
    task = transitions.create(actor=agent, title="strike out", max_failures=1)
    with live_server() as server, StreamCollector(stream_url(server), watcher) as stream:
        transitions.create(actor=agent, title="marker")
        last_seen = stream.get(timeout=5)["id"]
    [claim] = transitions.claim(actor=agent)
    # At max_failures, one statement records "failed" and then "escalated".
    transitions.fail(task_id=task.id, actor=agent, lease_token=claim.lease_token, error="boom")

    # A new server: its relay's memory is empty, so the replay reads the database.
    with (
        live_server() as server,
        StreamCollector(stream_url(server), {**watcher, "Last-Event-ID": last_seen}) as stream,
    ):
        replayed = [event["json"] for event in stream.take(3)]
        shown = task_as_the_api_shows_it(task.id, watcher, server)

    assert [(event["type"], event["task"]) for event in replayed[:2]] == [
        ("claimed", None),
        ("failed", None),
    ]
    assert replayed[2]["type"] == "escalated"
    assert replayed[2]["task"] == shown
    assert shown["status"] == "escalated"


def test_a_resume_longer_than_a_page_gets_every_event_in_order(
    server: LiveServer, watcher: dict[str, str], agent: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Behind Pushpin a replay is answered a page at a time, the next page asked for by
    Pushpin (board.live.grip): the pages join without a gap or an event twice."""
    from board.live import grip

    monkeypatch.setattr(grip, "PAGE_EVENTS", 7)
    made = [transitions.create(actor=agent, title=f"early {n}").id for n in range(30)]

    with StreamCollector(stream_url(server), watcher, lastEventId="0") as stream:
        replayed = stream.take(30)
        assert stream.nothing_within(0.3)
        later = transitions.create(actor=agent, title="live")
        assert stream.get()["json"]["task_id"] == later.id

    assert [event["json"]["task_id"] for event in replayed] == made


def test_a_client_cannot_ask_for_a_held_streams_next_link_itself(
    server: LiveServer, watcher: dict[str, str], agent: Any
) -> None:
    """The next link of a held stream carries its credentials sealed (board.live.grip): a request
    for it with anything else is held nowhere and sent nothing."""
    transitions.create(actor=agent, title="secret")
    for params in ({"link": "next"}, {"link": "next", "auth": "forged", "after": "0"}):
        with StreamCollector(stream_url(server), {"Grip-Last": "events; last-id=0"}, **params) as s:
            assert s.status in {204, 401}
            assert s.nothing_within(0.3)
    # A next link with its credentials in the query: behind Pushpin the
    # stream is ended (204; its client resumes), not answered for those credentials.
    from access import tokens
    from board.live import grip

    credentials = ["token", tokens.digest(watcher["Authorization"].split()[1])]
    sealed = grip.seal(("token", credentials[1]), 1)
    with StreamCollector(stream_url(server), link="next", auth=sealed, after="0") as s:
        assert s.status == (204 if server.origin_url != server.url else 401)
        assert s.nothing_within(0.3)
    # A next link sealed before held streams had a user channel (no user id in it): the
    # stream ends (204), and its client resumes into a stream that has one.
    encrypted = grip._cipher().encrypt(json.dumps(credentials).encode(), None)
    old = base64.urlsafe_b64encode(encrypted).decode().rstrip("=")
    with StreamCollector(
        f"{stream_url(server)}next/{old}/", {"Grip-Last": "events; last-id=0"}
    ) as s:
        assert s.status == (204 if server.origin_url != server.url else 404)
        assert s.nothing_within(0.3)
    for path in ("next/forged/", "next//", "next/forged"):
        with StreamCollector(
            stream_url(server) + path, {"Grip-Last": "events; last-id=0"}, after="0"
        ) as s:
            # Through Pushpin, signed, with credentials that unseal to nothing: 204 (Pushpin
            # ends the stream); anything else is no next link.
            assert s.status in {204, 404}
            assert s.nothing_within(0.3)


def test_one_relay_at_a_time_leads_and_the_lead_is_taken_again_when_it_is_cut_off() -> None:
    """Behind Pushpin the relays of all server processes compete for one advisory lock
    (board.live.relay.LEADER_LOCK); its holder publishes. When the holder's session ends, the
    lock is free at once, and a relay (another, or the same one reconnected) takes it
    within about a second."""
    background = BackgroundLoop()
    relays = [
        relay_module.Relay(relay_module.django_conninfo(), leader_key=relay_module.LEADER_LOCK)
        for _ in range(3)
    ]
    for relay in relays:
        background.run(relay.start())
    try:
        deadline = time.monotonic() + 5
        while sum(relay.leading for relay in relays) == 0:
            assert time.monotonic() < deadline, "no relay leads"
            time.sleep(0.05)
        time.sleep(1.5)  # the others have tried again meanwhile
        [leader] = [relay for relay in relays if relay.leading]

        cut_off = leader.backend_pid
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [cut_off])
        deadline = time.monotonic() + 5
        while not any(r.leading and r.backend_pid != cut_off for r in relays):
            assert time.monotonic() < deadline, "nobody took the lead again"
            time.sleep(0.05)
        time.sleep(1.5)
        assert sum(relay.leading for relay in relays) == 1
    finally:
        for relay in relays:
            background.run(relay.stop())
        background.close()


def test_a_new_stream_starts_after_what_is_committed_even_if_the_relay_is_behind(
    server: LiveServer, watcher: dict[str, str], agent: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that made an event and then opens a stream is not sent that event, though
    the relay of the process that answers has not read it yet (it was a race: the stream
    started at the relay's head)."""
    catch_up = relay_module.Relay._catch_up

    async def late_catch_up(self: relay_module.Relay, conn: Any) -> bool:
        await asyncio.sleep(0.5)
        return await catch_up(self, conn)

    time.sleep(0.6)  # the relay is idle: its next read is a late one
    monkeypatch.setattr(relay_module.Relay, "_catch_up", late_catch_up)
    transitions.create(actor=agent, title="before")
    with StreamCollector(stream_url(server), watcher) as stream:
        after = transitions.create(actor=agent, title="after")
        assert stream.get(timeout=5)["json"]["task_id"] == after.id


def test_a_new_stream_answers_503_when_the_database_fails_where_it_starts(
    server: LiveServer, watcher: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a new stream starts is read from the database: if that fails, the answer is
    the API's 503, not a 500 page."""
    from django.db import OperationalError

    def unavailable() -> Any:
        raise OperationalError("the database went away")

    monkeypatch.setattr(stream_module, "committed_head", unavailable)
    response = httpx.get(stream_url(server), headers=watcher, timeout=10)
    assert response.status_code == 503
    assert response.json()["error"] == "unavailable"


def committed_cursor() -> relay_module.Cursor:
    with connection.cursor() as cursor:
        cursor.execute("SELECT txid::text, id FROM task_events ORDER BY txid DESC, id DESC LIMIT 1")
        txid, event_id = cursor.fetchone()
    return relay_module.Cursor(int(txid), event_id)


def test_a_relay_that_nobody_listens_to_leaves_events_unread_until_asked(agent: Any) -> None:
    """Every server process's relay is notified of every event. One with no stream and no
    waiting claim reads them now and then (IDLE_READ_SECONDS), not on each notification;
    a stream that opens reads them first (current()); a waiting claim or an open stream
    has each event read as it commits."""
    background = BackgroundLoop()
    relay = relay_module.Relay(relay_module.django_conninfo())
    relay.IDLE_READ_SECONDS = 60.0
    background.run(relay.start())
    try:
        started_at = relay.head
        for n in range(5):
            transitions.create(actor=agent, title=f"unread {n}")
        time.sleep(0.5)
        assert relay.head == started_at, "read on each notification with nobody listening"
        assert relay.unread

        # A stream opening here reads them first, and is replayed them.
        assert background.run(relay.current()) == committed_cursor()
        assert not relay.unread

        # A waiting claim makes the relay read each event as it commits.
        waiting = {"claims": True}
        # (Added on the relay's loop, which iterates the set.)
        background.loop.call_soon_threadsafe(relay.demands.add, lambda: waiting["claims"])
        transitions.create(actor=agent, title="read at once")
        deadline = time.monotonic() + 5
        while relay.head != committed_cursor() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert relay.head == committed_cursor()

        # And once nobody listens, it leaves them again.
        waiting["claims"] = False
        before = relay.head
        time.sleep(0.1)
        transitions.create(actor=agent, title="unread again")
        time.sleep(0.5)
        assert relay.head == before and relay.unread

        # A stream subscribing after such a notification (after its current(), before it
        # subscribed) is handed the event at once.
        async def subscribe_and_wait() -> list[int]:
            subscriber = relay.subscribe()
            try:
                return [event.task_id for event in await subscriber.wait(5) if event]
            finally:
                relay.unsubscribe(subscriber)

        started = time.monotonic()
        task_ids = background.run(subscribe_and_wait())
        newest = TaskEvent.objects.order_by("-id").first()
        assert newest is not None and task_ids == [newest.task_id]
        assert time.monotonic() - started < 3
    finally:
        background.run(relay.stop())
        background.close()


def test_a_stream_opened_on_an_idle_relay_gets_what_it_left_unread_at_once(
    direct_server: LiveServer, watcher: dict[str, str], agent: Any, monkeypatch: Any
) -> None:
    """A client resuming on a process whose relay left the newest events unread (nobody
    listened there) gets them at once, not at the relay's next idle read. (Behind Pushpin
    the publishing relay reads every event; hold() asks current() all the same, for the
    other processes.)"""
    server = direct_server
    monkeypatch.setattr(relay_module.Relay, "IDLE_READ_SECONDS", 60.0)
    with StreamCollector(stream_url(server), watcher) as stream:
        task = transitions.create(actor=agent, title="first")
        last_seen = stream.get()["id"]
    # The stream closed: once the server notices, nobody listens to its relay.
    deadline = time.monotonic() + 5
    while relay_of(server).wanted() and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.1)

    [claim] = transitions.claim(actor=agent)
    transitions.complete(task_id=task.id, actor=agent, lease_token=claim.lease_token)
    time.sleep(0.3)
    assert relay_of(server).unread

    started = time.monotonic()
    with StreamCollector(stream_url(server), {**watcher, "Last-Event-ID": last_seen}) as stream:
        missed = stream.take(2, timeout=5)
    assert [event["json"]["type"] for event in missed] == ["claimed", "completed"]
    assert time.monotonic() - started < 3


def test_events_held_back_when_the_last_listener_left_are_read_for_the_next_stream(
    agent: Any,
) -> None:
    """Events held back behind an older transaction, when the relay's last listener leaves,
    stay to be read: the next stream's current() reads them once that transaction ends
    (which notifies nothing), not at the relay's next notification."""
    background = BackgroundLoop()
    relay = relay_module.Relay(relay_module.django_conninfo())
    relay.IDLE_READ_SECONDS = 60.0
    background.run(relay.start())
    older = psycopg.connect(relay_module.django_conninfo())
    try:
        waiting = {"claims": True}
        background.loop.call_soon_threadsafe(relay.demands.add, lambda: waiting["claims"])
        older.execute("SELECT pg_current_xact_id()")  # an older writer, still running
        transitions.create(actor=agent, title="held back")
        time.sleep(0.5)  # read, and held back: the relay looks again every 50 ms
        held = relay.head
        assert held is not None and held < committed_cursor()

        waiting["claims"] = False
        time.sleep(0.3)  # the relay sees nobody listens any more
        older.commit()  # no event, no notification
        time.sleep(0.2)
        assert background.run(relay.current()) == committed_cursor()
    finally:
        older.close()
        background.run(relay.stop())
        background.close()


def test_a_relay_whose_session_stops_answering_connects_again_and_delivers_what_it_missed(
    agent: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relay's session that stops answering without closing (its backend stopped here; a
    database host that hangs, or a network path or NAT that drops the connection
    silently) was waited on for ever: the process's streams and waiting claims heard
    nothing more. Now a read that takes longer than QUERY_TIMEOUT_SECONDS ends the session,
    and the relay connects again and reads what it missed."""
    import os
    import signal

    monkeypatch.setattr(relay_module.Relay, "QUERY_TIMEOUT_SECONDS", 1.0)
    monkeypatch.setattr(relay_module.Relay, "CHECK_SECONDS", 1.0)
    background = BackgroundLoop()
    relay = relay_module.Relay(relay_module.django_conninfo())
    received: list[int] = []
    relay.listeners.add(lambda events: received.extend(event.cursor.id for event in events))
    relay.demands.add(lambda: True)  # read each event at once, as with a stream open
    background.run(relay.start())
    try:
        stalled = relay.backend_pid
        assert stalled is not None
        if not psutil.pid_exists(stalled):
            pytest.skip("the database server is not on this machine: its session cannot be stopped")
        os.kill(stalled, signal.SIGSTOP)
        try:
            task = transitions.create(actor=agent, title="made while the relay's session hangs")
            made = TaskEvent.objects.get(task_id=task.id).id
            deadline = time.monotonic() + 30
            while made not in received:
                assert time.monotonic() < deadline, "the relay still waits on its stopped session"
                time.sleep(0.05)
        finally:
            os.kill(stalled, signal.SIGCONT)
        assert relay.backend_pid != stalled
        assert relay.reconnects == 1
    finally:
        background.run(relay.stop())
        background.close()


def test_a_leading_relay_whose_session_goes_silent_takes_the_lead_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A leading relay's connection dropped silently on the way (a NAT, a firewall or a
    proxy in between): the relay gives the session up and connects again, but the database
    still sees the old session, idle, holding the leader lock, and would until its TCP
    keepalive gave up on it (hours by default): no relay could lead, and nothing was
    published to Pushpin. Now a relay that connects again ends its previous session first."""
    leader_silenced_and_leading_again(monkeypatch, timeout=20)


def leader_silenced_and_leading_again(monkeypatch: pytest.MonkeyPatch, timeout: float) -> int:
    """Start a leading relay whose connection goes through a SilentProxy, silence it, and
    wait for the relay to lead again on a new session; return the silenced backend's pid."""
    from tests.silent_proxy import SilentProxy

    monkeypatch.setattr(relay_module.Relay, "QUERY_TIMEOUT_SECONDS", 1.0)
    monkeypatch.setattr(relay_module.Relay, "CHECK_SECONDS", 1.0)
    proxy = SilentProxy(relay_module.django_conninfo())
    background = BackgroundLoop()
    relay = relay_module.Relay(proxy.conninfo(), leader_key=relay_module.LEADER_LOCK)
    background.run(relay.start())
    try:
        deadline = time.monotonic() + 5
        while not relay.leading:
            assert time.monotonic() < deadline, "the relay does not lead"
            time.sleep(0.05)
        silenced = relay.backend_pid
        assert silenced is not None
        assert relay.reconnects == 0  # the session silenced is the one that leads
        proxy.silence()

        deadline = time.monotonic() + timeout
        while not (relay.leading and relay.backend_pid != silenced):
            assert time.monotonic() < deadline, (
                f"no lead again (reconnects: {relay.reconnects}, leading: {relay.leading})"
            )
            time.sleep(0.05)
        with connection.cursor() as cursor:  # ended, not only freed of its lock
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [silenced])
            assert cursor.fetchone()[0] == 0
        return silenced
    finally:
        background.run(relay.stop(), timeout=30)
        background.close()
        proxy.close()


def test_a_listen_url_gets_the_connect_timeout_of_the_database_settings(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DATABASE_LISTEN_URL (the relay's direct connection, where DATABASE_URL goes through
    PgBouncer) was used as given: without a connect_timeout a relay connecting to a database
    host that accepts the connection and never answers waited without end, where Django's
    connections give up after DATABASE_CONNECT_TIMEOUT. A timeout in the URL still wins."""
    import socket

    mute = socket.create_server(("127.0.0.1", 0))  # accepts connections, never answers
    try:
        port = mute.getsockname()[1]
        options = connection.settings_dict.setdefault("OPTIONS", {})
        monkeypatch.setitem(options, "connect_timeout", 1)
        settings.DATABASE_LISTEN_URL = f"postgresql://taskboard@127.0.0.1:{port}/taskboard"
        outcome: list[BaseException] = []

        def connect() -> None:
            try:
                psycopg.connect(relay_module.django_conninfo()).close()
            except psycopg.OperationalError as exc:
                outcome.append(exc)

        started = time.monotonic()
        attempt = threading.Thread(target=connect, daemon=True)
        attempt.start()
        attempt.join(15)
        assert outcome, "the relay's connection still waits on a database that never answers"
        assert time.monotonic() - started < 10

        settings.DATABASE_LISTEN_URL += "?connect_timeout=3"
        params = psycopg.conninfo.conninfo_to_dict(relay_module.django_conninfo())
        assert params["connect_timeout"] == "3"
    finally:
        mute.close()


@pytest.mark.parametrize("error", [TimeoutError, psycopg.OperationalError])
def test_a_stream_whose_replay_fails_ends_cleanly_and_says_why(
    server: LiveServer,
    watcher: dict[str, str],
    agent: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    error: type[Exception],
) -> None:
    """A replay that fails (the database away, or too slow) ends the stream: the client
    resumes after its last event a second later. A TimeoutError ended it without a word in
    the log, and a psycopg error escaped the view as an unhandled exception; now both end
    the response properly and log the cause. (Behind Pushpin the replay comes before the
    answer, which is then the API's 503: Pushpin's client retries as EventSource does.)"""
    first = transitions.create(actor=agent, title="seen")
    transitions.create(actor=agent, title="missed")
    resume_from = str(TaskEvent.objects.get(task_id=first.id).id)

    async def failing_replay(self: Any, after: Any, upto: Any) -> Any:
        raise error("the database did not answer")
        yield  # an async generator, as Relay.replay is

    monkeypatch.setattr(relay_module.Relay, "replay", failing_replay)
    resuming = {**watcher, "Last-Event-ID": resume_from}
    with (
        caplog.at_level("WARNING", logger="board.live.stream"),
        StreamCollector(stream_url(server), resuming) as stream,
    ):
        assert stream.status == (503 if server.origin_url != server.url else 200)
        assert ended_within(stream, 5)
    assert any(
        "the database did not answer" in record.getMessage()
        for record in caplog.records
        if record.name == "board.live.stream"
    ), [record.getMessage() for record in caplog.records]


@pytest.mark.usefixtures("quick_recheck")
def test_held_streams_of_different_agents_are_never_answered_for_each_other(
    tmp_path: Any, settings: Any, agent: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pushpin shares one request of a held stream's ``next`` link among the streams that
    ask the same link at the same time, and matches the link by its path and Grip-Last
    only, not its query. The stream's credentials were in the query: an agent limited to
    one queue and an unlimited one, both held at the same event, were answered with one
    of theirs, so the limited stream was then sent every queue's events (or the other
    missed them). The credentials are now in the path."""
    from board.access import limit_queues

    if shutil.which("pushpin") is None:
        pytest.skip("no pushpin (apt-get install pushpin; .ci/run installs it)")
    limited_user = UserFactory.create(username="limited")
    limit_queues(limited_user, ["open"])
    limited = {"Authorization": f"Bearer {TokenFactory.create(user=limited_user).key}"}
    unlimited_user = UserFactory.create(username="all")
    unlimited = {"Authorization": f"Bearer {TokenFactory.create(user=unlimited_user).key}"}
    slow_next_link = stream_module.next_link

    async def next_link(*args: Any) -> None:
        await asyncio.sleep(0.6)  # long enough for both streams' requests to overlap
        await slow_next_link(*args)

    monkeypatch.setattr(stream_module, "next_link", next_link)
    with (
        live_server_behind_pushpin(tmp_path / "pushpin", settings) as server,
        StreamCollector(stream_url(server), limited) as limited_stream,
        StreamCollector(stream_url(server), unlimited) as unlimited_stream,
    ):
        for _ in range(3):
            time.sleep(2.2)  # the streams' next links are asked again every second
            secret = transitions.create(actor=agent, title="secret", queue="secret")
            seen = transitions.create(actor=agent, title="seen", queue="open")
            assert [e["json"]["task_id"] for e in unlimited_stream.take(2, timeout=5)] == [
                secret.id,
                seen.id,
            ]
            assert [e["json"]["task_id"] for e in limited_stream.take(1, timeout=5)] == [seen.id]
            assert limited_stream.nothing_within(0.3)


def test_a_client_that_has_received_no_event_yet_resumes_without_a_gap(
    server: LiveServer, watcher: dict[str, str], agent: Any
) -> None:
    """A stream starts by giving the client its position (an ``id:`` with no data, which
    sets EventSource's lastEventId and dispatches nothing). Without it, a client whose
    connection dropped before its first event (a Pushpin restart: a CI run saw 188 of 500
    clients behind Pushpin lose the 20 events made meanwhile) reconnected without
    Last-Event-ID and started again from the events made after its reconnection."""
    transitions.create(actor=agent, title="before the stream")
    position = None
    with httpx.stream(
        "GET", stream_url(server), headers={**watcher, "Accept": "text/event-stream"}, timeout=10
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("id:"):
                position = line.removeprefix("id:").strip()
            if line.startswith(": connected"):
                break
    assert position is not None, "the stream gave no position before its first event"

    missed = [transitions.create(actor=agent, title=f"missed {n}").id for n in range(3)]
    with StreamCollector(stream_url(server), {**watcher, "Last-Event-ID": position}) as stream:
        assert [event["json"]["task_id"] for event in stream.take(3)] == missed
        assert stream.nothing_within(0.3)


def test_a_relay_ends_a_silent_session_even_if_its_first_attempt_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The session that ends a silent predecessor may itself fail before it has (the network
    still flaky): the predecessor, which holds the leader lock, is not forgotten, and the
    next session ends it."""
    execute = relay_module.Relay._execute
    failed: list[str] = []

    async def flaky_execute(self: Any, conn: Any, query: str, params: Any = None) -> Any:
        if "pg_terminate_backend" in query and not failed:
            failed.append(query)
            await conn.close()
            raise TimeoutError("the database did not answer (made to fail once)")
        return await execute(self, conn, query, params)

    monkeypatch.setattr(relay_module.Relay, "_execute", flaky_execute)
    leader_silenced_and_leading_again(monkeypatch, timeout=30)
    assert failed, "the first attempt to end the silent session was not made to fail"


def test_a_recheck_that_a_change_of_credentials_overtakes_is_not_remembered(
    monkeypatch: pytest.MonkeyPatch, watcher: dict[str, str]
) -> None:
    """As the API's token cache: a held stream's re-check (its next link) that read the
    credentials before a revocation and ended after the process heard of it is not kept
    for the next re-checks."""
    from access import tokens
    from board.api import authentication

    credentials = ("token", tokens.digest(watcher["Authorization"].split()[1]))
    looked_up = stream_module.reauthorize

    def overtaken(*args: Any, **kwargs: Any) -> Any:
        found = looked_up(*args, **kwargs)
        authentication.forget(None)
        return found

    monkeypatch.setattr(stream_module, "reauthorize", overtaken)
    stream_module._rechecked.clear()
    assert stream_module._still_allowed(credentials) is not None
    assert credentials not in stream_module._rechecked


def test_a_stream_answered_across_a_change_of_credentials_is_not_held(
    watcher: dict[str, str],
) -> None:
    """The close that a change of credentials publishes (board.live.revocation) may reach
    Pushpin before an answer that was being made meanwhile subscribes the user's channel:
    such an answer does not hold the stream. A new stream is sent what it was due and
    ends, a held one (its next link) is ended; each client resumes and is checked again."""
    from board.api import authentication

    class Head:
        head = relay_module.Cursor(1, 5)

    def answer(preamble: bool, generation: int) -> list[Any]:
        sent: list[Any] = []

        async def send(message: Any) -> None:
            sent.append(message)

        asyncio.run(
            stream_module.hold(
                send,
                Head(),  # type: ignore[arg-type]
                None,
                ("token", "digest"),
                1,
                EVERY_QUEUE,
                preamble=preamble,
                generation=generation,
            )
        )
        return sent

    now = authentication.generation()
    held = dict(answer(preamble=True, generation=now)[0]["headers"])
    assert held[b"grip-hold"] == b"stream"

    authentication.forget(None)
    start, body = answer(preamble=True, generation=now)
    assert start["status"] == 200
    assert b"grip-hold" not in dict(start["headers"])
    assert b"id: 5" in body["body"]
    assert answer(preamble=False, generation=now)[0]["status"] == 204


def test_a_publisher_losing_the_lead_keeps_the_closes_it_has_queued() -> None:
    """Events queued by a publisher that loses the lead are the new leader's to send; a
    close on a user's channel is every process's, and is still sent."""
    from board.live import grip

    class Relay:
        head = relay_module.Cursor(1, 5)
        leading = True

    publisher = grip.Publisher(Relay(), None)  # type: ignore[arg-type]
    event = relay_module.StreamEvent(
        cursor=relay_module.Cursor(2, 6),
        task_id=1,
        type="created",
        status="pending",
        queue="default",
        run_after=None,
        leased_until=None,
        source=b"id: 6\n\n",
    )
    publisher.on_events([event])
    publisher.close_streams_of(7)
    publisher.on_leadership(False)

    [queued] = [publisher.pending.get_nowait() for _ in range(publisher.pending.qsize())]
    assert [item["channel"] for item in queued] == [grip.user_channel(7)]


def test_a_publish_that_fails_is_sent_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pushpin failing to take a publish loses neither a close nor the news of an event:
    the close is sent again until it goes through, and so is the latest event (from which
    a stream that missed the lost ones recovers them through its next link)."""
    from board.live import grip
    from tests.receivers import WebhookReceiver

    monkeypatch.setattr(grip, "RETRY_SECONDS", (0.2, 0.4))

    class Relay:
        head = relay_module.Cursor(1, 5)
        leading = True
        listeners: set[Any] = set()
        leadership_listeners: set[Any] = set()

    def event(n: int) -> relay_module.StreamEvent:
        return relay_module.StreamEvent(
            relay_module.Cursor(2, n), 1, "created", "pending", "q", None, None, b"id: %d\n\n" % n
        )

    def items(received: Any) -> list[tuple[str, str | None]]:
        return [(i["channel"], i.get("id")) for i in received.json["items"]]

    async def run(receiver: WebhookReceiver) -> None:
        publisher = grip.Publisher(
            Relay(),  # type: ignore[arg-type]
            grip.Grip(receiver.url, None, None, None, None),
        )
        publisher.start()
        try:
            publisher.on_events([event(6)])
            publisher.close_streams_of(7)
            deadline = time.monotonic() + 10
            while len(receiver.accepted()) < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)  # nothing more is sent once it went through
        finally:
            await publisher.stop()

    with WebhookReceiver(500, 503, then=200) as receiver:
        asyncio.run(run(receiver))
    first, second, third = receiver.received
    assert [first.answer, second.answer, third.answer] == [500, 503, 200]
    assert set(items(first)) == {("events", "6"), ("user-7", None)}
    assert set(items(third)) == set(items(first))
    assert third.at - second.at > 0.3  # backing off


@pytest.mark.slow
@pytest.mark.once
def test_a_huge_task_with_a_heartbeat_flood_leaves_every_server_process_s_memory_flat(
    tmp_path: Any, watcher: dict[str, str]
) -> None:
    """One agent creates a task with a 0.93 MB description, claims it and sends 150
    heartbeats while one stream is open: every server process reads every event, and none
    may keep the description with each of them (nor send it to the stream)."""
    hoarder = UserFactory.create(username="hoarder")
    token = TokenFactory.create(user=hoarder)
    headers = {"Authorization": f"Bearer {token.key}"}
    server = ServeProcess(
        tmp_path / "serve.log",
        "--workers",
        "2",
        env={"DATABASE_URL": processes.tests_database_url()},
    ).wait_healthy()
    try:
        workers = eventually(lambda: processes.server_workers(server.pid, 2), what="two workers")
        api = httpx.Client(base_url=f"{server.url}/api/v1/", headers=headers, timeout=30)
        with api, StreamCollector(stream_url(server), watcher) as stream:
            # Warm both processes up (a new connection per request reaches either).
            for n in range(20):
                httpx.post(
                    f"{api.base_url}tasks/",
                    json={"title": f"warm {n}", "queue": "warm"},
                    headers=headers,
                )
            stream.take(20, timeout=30)
            before = [worker.memory_info().rss for worker in workers]

            task = api.post("tasks/", json={"title": "huge", "description": "x" * 930_000})
            assert task.status_code == 201, task.text
            task_id = task.json()["id"]
            claimed = api.post("tasks/claim/", json={"queues": ["default"]})
            [lease] = [t["lease_token"] for t in claimed.json()["tasks"] if t["id"] == task_id]
            # The heartbeats are sent from here, straight to the database: what is measured
            # is what the server processes make of the events. (Through the API, each
            # heartbeat's answer is the whole task, and the memory of 150 such answers
            # comes and goes with the allocator, whatever the stream does.)
            for n in range(150):
                transitions.heartbeat(
                    task_id=task_id, actor=hoarder, lease_token=lease, progress={"step": n}
                )
            # The creation, the claim and the 150 heartbeats.
            received = stream.take(1 + 1 + 150, timeout=60)
            after = [worker.memory_info().rss for worker in workers]
    finally:
        server.stop()

    largest = max(len(event["data"].encode()) for event in received)
    grown = [(a - b) / 2**20 for a, b in zip(after, before, strict=True)]
    print(f"RSS before {before}, after {after}, grown MiB {grown}, largest event {largest} B")
    assert largest <= 64 * 1024
    assert all(growth < 64 for growth in grown), grown
    huge = [event["json"]["task"] for event in received if event["json"]["task_id"] == task_id]
    assert all(
        t is None or (t["description"], t["elided"]) == (None, ["description"]) for t in huge
    )


def test_a_streamed_event_carries_each_large_value_only_up_to_8_kib(
    server: LiveServer, watcher: dict[str, str], agent: Any
) -> None:
    """A task's description, payload, result and progress, and an event's payload values,
    larger than 8 KiB as JSON in the event are null and named in ``elided``; smaller ones
    are sent as they are. Characters that JSON escapes count as they are sent."""
    kept = {"notes": "k" * 7000}
    big = {"rows": list(range(3000))}  # 14 kB
    with StreamCollector(stream_url(server), watcher) as stream:
        # Each change once the stream has the last: then each event carries its task.
        task = transitions.create(actor=agent, title="large", description="é" * 3000, payload=kept)
        events = [stream.get()]
        [claim] = transitions.claim(actor=agent)
        events.append(stream.get())
        transitions.heartbeat(
            task_id=task.id, actor=agent, lease_token=claim.lease_token, progress=big
        )
        events.append(stream.get())
        transitions.complete(
            task_id=task.id, actor=agent, lease_token=claim.lease_token, result=kept
        )
        events.append(stream.get())

    created, claimed, beat, completed = (event["json"] for event in events)
    # 3,000 "é" are 6 kB in the database, and 18 kB as the stream writes them (\u00e9).
    assert (created["task"]["description"], created["task"]["elided"]) == (None, ["description"])
    assert created["task"]["payload"] == kept
    assert "elided" not in created
    assert claimed["task"]["elided"] == ["description"]
    assert (beat["payload"]["progress"], beat["elided"]) == (None, ["progress"])
    assert beat["payload"]["lease_until"] is not None
    assert (beat["task"]["progress"], beat["task"]["elided"]) == (None, ["description", "progress"])
    # The result is small enough to be sent; the last progress stays, too large.
    assert (completed["payload"], completed["task"]["result"]) == ({"result": kept}, kept)
    assert completed["task"]["elided"] == ["description", "progress"]
    assert max(len(event["data"].encode()) for event in events) <= relay_module.MAX_EVENT_BYTES
    # The API has every value.
    shown = task_as_the_api_shows_it(task.id, watcher, server)
    assert (shown["description"], shown["status"]) == ("é" * 3000, "done")


def test_a_value_too_large_to_read_is_named_without_being_read(agent: Any) -> None:
    """Larger than the relay reads (twice 8 KiB), a value stays in the database: the row the
    relay holds has it null and names it, and the event sent is the same."""
    task = transitions.create(
        actor=agent, title="huge", description="d" * 100_000, payload={"p": "p" * 100_000}
    )
    [claim] = transitions.claim(actor=agent)
    transitions.fail(task_id=task.id, actor=agent, lease_token=claim.lease_token, error="e" * 9000)
    background = BackgroundLoop()
    relay = relay_module.Relay(relay_module.django_conninfo())
    try:
        background.run(relay.start())
        background.run(relay.open_pool())

        async def read() -> list[relay_module.StreamEvent]:
            assert relay.head is not None
            return [
                event
                async for page in relay.replay(relay_module.START, relay.head)
                for event in page
                if event.task_id == task.id
            ]

        events = background.run(read())
        rows = [event.source for event in events]
        sent = [json.loads(event.sse.decode().split("data: ", 1)[1]) for event in events]
    finally:
        background.run(relay.stop())
        background.close()

    assert [row["task_elided"] for row in rows if row["task_is_current"]] == [
        ["description", "payload"]
    ]
    assert all(row["description"] is None for row in rows)
    [failed] = [event for event in sent if event["type"] == "failed"]
    # 9,000 characters of error: read (under 16 KiB), but not sent (over 8 KiB).
    assert (failed["payload"]["error"], failed["elided"]) == (None, ["error"])
    assert failed["task"]["elided"] == ["description", "payload", "last_error"]
    assert failed["task"]["failure_count"] == 1


def test_an_event_is_never_larger_than_64_kib_however_many_values_it_has(agent: Any) -> None:
    """Each value under 8 KiB, but many of them: the largest are elided until it fits."""
    transitions.create(actor=agent, title="many")
    background = BackgroundLoop()
    relay = relay_module.Relay(relay_module.django_conninfo())
    try:
        background.run(relay.start())
        background.run(relay.open_pool())

        async def read() -> dict[str, Any]:
            assert relay.head is not None
            async for page in relay.replay(relay_module.START, relay.head):
                source = page[-1].source
                assert isinstance(source, dict)  # the row, as nothing asked for its SSE yet
                return dict(source)
            raise AssertionError("no event")

        row = background.run(read())
    finally:
        background.run(relay.stop())
        background.close()
    row["event_payload"] = json.dumps({f"k{n:02}": "v" * (7000 + n) for n in range(12)})

    data = json.loads(relay_module._encode(row).decode().split("data: ", 1)[1])

    assert len(relay_module._dumps(data)) <= relay_module.MAX_EVENT_BYTES
    assert data["elided"] == ["k09", "k10", "k11"]  # the largest
    assert [data["payload"][f"k{n:02}"] for n in range(9)] == ["v" * (7000 + n) for n in range(9)]


def test_the_relay_keeps_events_within_its_bytes_and_replays_older_ones_from_the_log(
    agent: Any,
) -> None:
    """The relay's memory is bounded in bytes, as events are read and as they are encoded:
    the oldest go; a resume within what it keeps is answered from memory, an older one
    from task_events, in order either way."""
    background = BackgroundLoop()
    relay = relay_module.Relay(relay_module.django_conninfo(), buffer_bytes=200_000)
    try:
        background.run(relay.start())
        background.run(relay.open_pool())
        start = relay.head
        assert start is not None
        made = [
            transitions.create(actor=agent, title=f"t{n}", description="d" * 8000).id
            for n in range(60)
        ]
        eventually(lambda: relay.head is not None and relay.head.id >= max_event_id())

        def held() -> tuple[int, int, int]:
            return relay.held_bytes, sum(event.size for event in relay.buffer), len(relay.buffer)

        held_bytes, summed, kept = background.run(asyncio.to_thread(held))
        assert held_bytes == summed <= 200_000
        assert 10 < kept < 60
        assert relay.buffer_floor is not None and relay.buffer_floor > start

        async def encode_all() -> None:
            for event in list(relay.buffer):
                assert event.sse

        background.run(encode_all())
        held_bytes, summed, _ = background.run(asyncio.to_thread(held))
        assert held_bytes == summed <= 200_000

        async def replay(after: relay_module.Cursor) -> tuple[list[int], bool]:
            assert relay.head is not None
            in_memory = relay._from_buffer(after, relay.head) is not None
            ids = [e.task_id async for page in relay.replay(after, relay.head) for e in page]
            return ids, in_memory

        floor = relay.buffer_floor
        assert background.run(replay(start)) == (made, False)
        recent = [event.task_id for event in relay.buffer]
        assert background.run(replay(floor)) == (recent, True)
        assert recent == made[-len(recent) :]
    finally:
        background.run(relay.stop())
        background.close()


def max_event_id() -> int:
    return int(TaskEvent.objects.order_by("-id").values_list("id", flat=True)[0])


@pytest.mark.parametrize(
    ("changes", "restricted"),
    [
        ({}, False),
        ({"assignee": "agent-jones"}, True),
        ({"requires": ["gpu"]}, True),
        # Held for 5 minutes more (the time is taken when the test runs, not collected).
        ({"held_until": timedelta(minutes=5)}, True),
        # A hold that ended stays on the row until the next claim: anyone may claim now.
        ({"held_until": timedelta(minutes=-5)}, False),
    ],
)
def test_an_event_says_whether_only_some_claimants_may_take_its_task(
    changes: dict[str, Any], restricted: bool
) -> None:
    if isinstance(changes.get("held_until"), timedelta):
        changes = {**changes, "held_until": datetime.now(UTC) + changes["held_until"]}
    row: dict[str, Any] = {
        "txid": "7",
        "event_id": 3,
        "id": 1,
        "event_type": "answered",
        "event_status": "pending",
        "queue": "q",
        "run_after": None,
        "leased_until": None,
        "answer_by": None,
        "held_until": None,
        "assignee": None,
        "requires": [],
        **changes,
    }

    assert relay_module._stream_event(row).restricted is restricted
