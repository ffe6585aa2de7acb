"""The server's database sessions terminated (pg_terminate_backend) every second, the
relay's LISTEN session among them, while agents work, a client creates tasks and streams
follow: no stream misses or repeats an event, the API answers 503 and never 500, and
nothing acknowledged is lost."""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.db import connection

from board.models import Task, TaskEvent
from taskboard_agent.client import Client, TaskboardError
from tests.faults.conftest import SERVER_APPLICATION_NAME
from tests.live import StreamCollector
from tests.processes import ServeProcess, StreamFollower, WorkerProcess, eventually

pytestmark = [pytest.mark.slow, pytest.mark.once, pytest.mark.django_db(transaction=True)]

QUEUE = "cut-off"
FAULT_SECONDS = 8


TERMINATE = """
SELECT pid, application_name, pg_terminate_backend(pid)
FROM pg_stat_activity
WHERE datname = current_database() AND application_name = ANY(%s)
"""


def events_in_stream_order(after: int) -> list[int]:
    """Return the ids of the events after ``after`` in the stream's (commit-safe) order."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT id FROM task_events WHERE id > %s ORDER BY txid, id", [after])
        return [int(row[0]) for row in cursor.fetchall()]


class Background(threading.Thread):
    """A loop in a thread until stopped; an exception in it is kept for the test."""

    def __init__(self, step: Callable[[], None], pause: Callable[[], float]) -> None:
        super().__init__(daemon=True)
        self.step, self.pause = step, pause
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                self.step()
                self.stopping.wait(self.pause())
        except BaseException as exc:
            self.error = exc

    def stop(self) -> None:
        self.stopping.set()
        self.join(30)
        if self.error is not None:
            raise self.error


def server_sessions(killer: Any) -> int:
    row = killer.execute(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND application_name = %s",
        [SERVER_APPLICATION_NAME],
    ).fetchone()
    return int(row[0])


def test_sessions_ended_between_requests_are_replaced_before_the_next_request(
    start_serve: Callable[..., ServeProcess],
    token_for: Callable[[str], str],
    open_raw_connection: Callable[..., Any],
) -> None:
    """A kept connection that PostgreSQL ended while it was idle is found and replaced
    when the next request starts (taskboard/postgresql): no request answers 503 for it.
    Without the check, the first request on each of the server's threads answered 503."""
    token = token_for("idle-agent")
    server = start_serve("--workers", "1")  # one process: its threads' connections are known
    killer = open_raw_connection(autocommit=True)
    headers = {"Authorization": f"Bearer {token}"}
    statuses: Counter[int] = Counter()
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as http:

        def burst() -> None:
            def one(n: int) -> None:
                response = http.post("/api/v1/tasks/", json={"title": f"t{n}", "queue": QUEUE})
                statuses[response.status_code] += 1

            threads = [threading.Thread(target=one, args=(n,)) for n in range(16)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30)

        burst()  # every thread of the server keeps a connection now
        assert statuses == Counter({201: 16}), statuses
        kept = server_sessions(killer)
        assert kept >= 2, kept
        killer.execute(TERMINATE, [[SERVER_APPLICATION_NAME]])
        eventually(lambda: server_sessions(killer) == 0, what="the sessions ended")
        statuses.clear()
        burst()
        for _ in range(8):
            statuses[http.get("/api/v1/tasks/?limit=1").status_code] += 1
    assert statuses == Counter({201: 16, 200: 8}), statuses
    assert server.server_errors() == []


def test_terminated_backends_lose_no_event_and_answer_503_not_500(
    start_serve: Callable[..., ServeProcess],
    token_for: Callable[[str], str],
    open_raw_connection: Callable[..., Any],
    tmp_path: Path,
) -> None:
    token = token_for("steady-agent")
    server = start_serve()
    killer = open_raw_connection(autocommit=True)
    rng = random.Random(8)
    start = TaskEvent.objects.order_by("-id").values_list("id", flat=True).first() or 0

    # Two plain streams that must never need to reconnect, and one client that would.
    headers = {"Authorization": f"Bearer {token}"}
    plain = [StreamCollector(f"{server.url}/api/v1/stream/", headers).__enter__() for _ in range(2)]
    follower = StreamFollower(server.url, token, last_event_id=start).start()
    eventually(lambda: all(": connected" in s.comments for s in plain), what="the streams")

    creator = Client(server.url, token, retries=4, backoff=0.2, max_backoff=1.0)
    acknowledged: list[int] = []
    refused: list[str] = []

    def create() -> None:
        try:
            acknowledged.append(creator.create(f"task {len(acknowledged)}", queue=QUEUE).id)
        except TaskboardError as exc:  # gave up after its retries: not acknowledged
            refused.append(str(exc))

    probe = httpx.Client(base_url=server.url, headers=headers, timeout=30)
    statuses: Counter[int] = Counter()

    def look() -> None:
        for path in ("/healthz", "/api/v1/tasks/?limit=5", f"/api/v1/events/?after={start}"):
            statuses[probe.get(path).status_code] += 1

    terminated: Counter[str] = Counter()

    def terminate() -> None:
        names = [SERVER_APPLICATION_NAME, "taskboard-relay"]
        for _, name, done in killer.execute(TERMINATE, [names]).fetchall():
            terminated[name] += bool(done)

    agents = [
        WorkerProcess(
            server,
            token,
            tmp_path / f"agent-{n}.log",
            ["--queue", QUEUE, "--lease", "10", "--concurrency", "2"],
            ["true"],  # done at once: the faults are elsewhere
        )
        for n in range(2)
    ]
    loops = [
        *(Background(create, lambda: 0.05) for _ in range(3)),
        Background(look, lambda: 0.05),
        Background(terminate, lambda: rng.uniform(0.7, 1.3)),
    ]
    try:
        for loop in loops:
            loop.start()
        time.sleep(FAULT_SECONDS)  # the faults run for this long (not an assertion)
        for loop in loops:
            loop.stop()
        eventually(
            lambda: not Task.objects.filter(queue=QUEUE).exclude(status="done").exists(),
            timeout=60,
            what="every task done",
        )
        expected = events_in_stream_order(after=start)
        receivers = {"plain 1": plain[0], "plain 2": plain[1]}

        def received(name: str) -> list[int]:
            if name == "follower":
                return list(follower.ids)
            return [int(event["id"]) for event in list(receivers[name].events.queue)]

        names = [*receivers, "follower"]
        eventually(
            lambda: all(len(received(name)) >= len(expected) for name in names),
            timeout=60,
            what="every stream's catching up",
        )
        for name in names:
            assert received(name) == expected, f"stream {name} differs from task_events"
    finally:
        for loop in loops:
            loop.stopping.set()
        for agent in agents:
            agent.kill()
        for stream in plain:
            stream.close()
        follower.close()
        creator.close()
        probe.close()

    in_database = set(Task.objects.filter(queue=QUEUE).values_list("id", flat=True))
    assert set(acknowledged) <= in_database, "an acknowledged create is lost"
    assert refused == [], "the client's retries did not cope"
    assert set(statuses) <= {200, 503}, f"answers under the faults: {statuses}"
    assert server.server_errors() == []
    assert terminated["taskboard-relay"] >= 3, terminated
    print(
        json.dumps(
            {
                "terminated sessions": dict(terminated),
                "probe answers": dict(statuses),
                "tasks acknowledged": len(acknowledged),
                "creates given up": len(refused),
                "events per stream": len(expected),
            }
        )
    )
