"""A server process stopped (SIGSTOP) while another serves, then continued: a stream
resumed on it must not repeat what the client has already seen, and
a worker of ``serve --workers N`` stopped for longer than uvicorn's own health check
allows is still there to carry on (TASKBOARD_WORKER_TIMEOUT)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import psutil
import pytest

from board.models import TaskEvent
from tests.live import StreamCollector
from tests.processes import ServeProcess, eventually, server_workers

pytestmark = [pytest.mark.slow, pytest.mark.once, pytest.mark.django_db(transaction=True)]

TASKS = 1_500


def relay_backend(server: ServeProcess) -> int | None:
    """The backend of ``server``'s relay LISTEN session, as its log says ("relay: listening
    (backend N)", at each connection), once it has connected. (Counting the database's
    "taskboard-relay" sessions before and after the server starts also counts a reconnect
    of another server's relay, or a replay pool's connection, under load.)"""
    found = re.findall(r"relay: listening \(backend (\d+)\)", server.output)
    return int(found[-1]) if found else None


@contextmanager
def stalled(pid: int) -> Iterator[None]:
    """Stop a PostgreSQL backend (SIGSTOP) for the block: its client waits on it."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_resume_on_a_server_that_was_stopped_repeats_nothing(
    start_serve: Callable[..., ServeProcess], token_for: Callable[[str], str]
) -> None:
    headers = {"Authorization": f"Bearer {token_for('agent-under-load')}"}
    # One process each: the test stalls B's relay, and reads which session that is from
    # the one relay that B's start adds.
    a = start_serve("--workers", "1")
    b = start_serve("--workers", "1")
    relay_pid = eventually(lambda: relay_backend(b), what="B's relay")
    client = httpx.Client(base_url=f"{a.url}/api/v1", headers=headers, timeout=30)

    def create(title: str) -> int:
        response = client.post("/tasks/", json={"title": title})
        assert response.status_code == 201, response.text
        return int(response.json()["id"])

    # A stream on B, so that B's relay runs and is at the head.
    with StreamCollector(f"{b.url}/api/v1/stream/", headers) as warm:
        create("warm up")
        warm.get(timeout=10)
    if not psutil.pid_exists(relay_pid):
        pytest.skip("the database server is not on this machine: its session cannot be stopped")

    b.pause()
    try:
        with ThreadPoolExecutor(4) as pool:
            created = list(pool.map(lambda n: create(f"while B sleeps {n}"), range(TASKS)))
        newest = TaskEvent.objects.latest("id").id
        # B continues, but (so that the outcome does not hang on which of B's coroutines
        # runs first) its relay's session stays stalled until the client has resumed: the
        # relay is behind the client, as it was the moment B continued.
        with stalled(relay_pid):
            b.resume()
            resumed = StreamCollector(
                f"{b.url}/api/v1/stream/", {**headers, "Last-Event-ID": str(newest)}
            ).start()
            eventually(lambda: ": connected" in resumed.comments, timeout=30, what="the resume")
            assert resumed.status == 200
            after = create("after the resume")
            # (That the session stalled is the relay's: B delivers nothing meanwhile.)
            assert resumed.nothing_within(1.0), "B's relay is not the session stalled"
    finally:
        b.resume()

    assert len(created) == TASKS
    try:
        # Whatever B sends before the next event is a repeat: the client has seen it.
        delivered = [resumed.get(timeout=30)]
        while delivered[-1]["json"]["task_id"] != after:
            delivered.append(resumed.get(timeout=30))
    finally:
        resumed.close()
        client.close()
    repeated = [int(event["id"]) for event in delivered[:-1]]
    assert repeated == [], (
        f"B sent {len(repeated)} events again, ids {repeated[0]}..{repeated[-1]} (<= {newest})"
    )


def test_a_worker_stopped_for_longer_than_uvicorns_check_carries_on_when_continued(
    start_serve: Callable[..., ServeProcess],
) -> None:
    server = start_serve("--workers", "2")
    first, second = eventually(
        lambda: server_workers(server.pid, 2), timeout=30, what="two workers"
    )

    first.suspend()
    try:
        # uvicorn's supervisor killed a worker that left its check unanswered for 5 s:
        # nothing shows that it has not, but time past it (the other serves meanwhile).
        stopped_until = time.monotonic() + 8
        while time.monotonic() < stopped_until:
            assert server.health(timeout=5) == 200
            time.sleep(0.5)
        assert first.is_running(), "the stopped worker was killed"
        assert first.status() == psutil.STATUS_STOPPED
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            first.resume()

    # With the other stopped, only the one continued can answer.
    second.suspend()
    try:
        assert server.health(timeout=10) == 200
    finally:
        second.resume()
    assert server_workers(server.pid, 2) == [first, second]
    assert "died" not in server.output


def test_a_worker_killed_while_its_check_waits_is_replaced_at_once(
    start_serve: Callable[..., ServeProcess],
) -> None:
    """Stopped, the worker leaves the supervisor's check waiting for its answer; killed
    then, it is replaced at once, not when TASKBOARD_WORKER_TIMEOUT (30 s) has passed."""
    server = start_serve("--workers", "2")
    first, second = eventually(
        lambda: server_workers(server.pid, 2), timeout=30, what="two workers"
    )

    first.suspend()
    time.sleep(1)  # the supervisor checks every half second: a check now waits on it
    first.kill()

    eventually(
        lambda: f"Child process [{first.pid}] died" in server.output,
        timeout=5,
        what="the killed worker's replacement",
    )
    replaced = eventually(
        lambda: server_workers(server.pid, 2), timeout=30, what="two workers again"
    )
    assert second in replaced and first not in replaced
    assert server.health(timeout=5) == 200
