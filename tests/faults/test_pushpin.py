"""The board as N processes behind a real Pushpin (``taskboard serve --pushpin --workers
2``), with 500 SSE clients spread over the processes: a server process killed with SIGKILL
mid-stream, or Pushpin killed and started again, and every client still receives every
event exactly once, in order, after resuming with Last-Event-ID as EventSource does."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import re
import shutil
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import httpx
import psutil
import psycopg
import pytest
from django.db import connection

from board import transitions
from board.models import Task
from taskboard_agent.client import SSEParser
from tests import processes
from tests.factories import UserFactory
from tests.processes import ServeProcess, eventually, free_port

pytestmark = [
    pytest.mark.slow,
    pytest.mark.once,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        shutil.which("pushpin") is None,
        reason="no pushpin (apt-get install pushpin; .ci/run installs it)",
    ),
]

CLIENTS = 500
T = TypeVar("T")
RETRY_SECONDS = 1.0  # what the stream's "retry:" tells EventSource


class Client:
    """One SSE client that reconnects with the last id it received, as EventSource does."""

    def __init__(self, port: int, token: str) -> None:
        self.port = port
        self.token = token
        self.ids: list[int] = []  # of the events received
        # The last id received, as EventSource keeps it: an event's, or the position a
        # stream opens with (an id without data).
        self.last_id: str | None = None
        self.connected = asyncio.Event()
        self.reconnects = 0
        # Reconnections before every client was connected (a burst of 500 connections
        # meets some 502s from Pushpin), which the tests do not count.
        self.reconnects_to_start = 0
        # What each connection attempt came to, for a failure's message: the status line,
        # or the error that ended it.
        self.attempts: list[str] = []

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self._follow(stop)
            except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                self.attempts.append(f"{type(exc).__name__}: {exc}")
            if stop.is_set():
                return
            self.reconnects += 1
            await asyncio.sleep(RETRY_SECONDS)

    async def _follow(self, stop: asyncio.Event) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            resume = f"Last-Event-ID: {self.last_id}\r\n" if self.last_id is not None else ""
            writer.write(
                (
                    "GET /api/v1/stream/ HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    f"Authorization: Bearer {self.token}\r\nAccept: text/event-stream\r\n"
                    f"{resume}\r\n"
                ).encode()
            )
            await writer.drain()
            status = await reader.readline()
            self.attempts.append(status.decode(errors="replace").strip() or "closed")
            if b" 200 " not in status:
                return
            chunked = False
            while (header := await reader.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = header.decode("latin-1").partition(":")
                if name.strip().lower() == "transfer-encoding":
                    chunked = "chunked" in value.lower()
            # The body is decoded (its chunks may end anywhere, also inside a line), then
            # read by taskboard_agent.client's parser (the EventSource rules: an event counts at
            # the blank line that ends it, and only then does its id become the one to
            # resume from; a block cut off before its end is dropped, id and all).
            decoder = codecs.getincrementaldecoder("utf-8")()
            parser = SSEParser()
            text = ""
            async for piece in body_of(reader, chunked):
                text += decoder.decode(piece)
                *lines, text = text.split("\n")
                for line in lines:
                    line = line.removesuffix("\r")
                    if line.startswith(": connected"):
                        self.connected.set()
                    event = parser.feed(line)
                    if parser.last_id is not None:
                        self.last_id = parser.last_id
                    if event is not None:
                        self.ids.append(event.id)
                if stop.is_set():
                    return
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


async def body_of(reader: asyncio.StreamReader, chunked: bool) -> AsyncIterator[bytes]:
    """The bytes of a response's body as they arrive, its chunked encoding taken off."""
    if not chunked:
        while piece := await reader.read(65536):
            yield piece
        return
    while size_line := await reader.readline():
        size = int(size_line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            return
        yield await reader.readexactly(size)
        await reader.readexactly(2)  # the CRLF after the chunk


@pytest.fixture
def behind_pushpin(tmp_path: Path) -> Iterator[ServeProcess]:
    server = ServeProcess(
        tmp_path / "serve.log",
        "--pushpin",
        "--workers",
        "2",
        env={"DATABASE_URL": processes.tests_database_url(), "TASKBOARD_DATA_DIR": str(tmp_path)},
        port=free_port(),
    )
    try:
        yield server.wait_healthy(timeout=120)
    finally:
        server.stop()


def in_thread(work: Callable[..., T], *args: object, **kwargs: object) -> T:
    """Run Django work in a worker thread, closing that thread's connection after it."""
    try:
        return work(*args, **kwargs)
    finally:
        connection.close()


def last_event_id() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT coalesce(max(id), 0) FROM task_events")
        return int(cursor.fetchone()[0])


def event_ids_after(event_id: int) -> list[int]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT id FROM task_events WHERE id > %s ORDER BY txid, id", [event_id])
        return [row[0] for row in cursor.fetchall()]


def run_clients(
    server: ServeProcess, token: str, fault: Callable[[], None], events: int = 40
) -> tuple[list[Client], list[int]]:
    """Open CLIENTS streams through Pushpin, make ``events`` events (the fault halfway),
    and return the clients once each has received them all (or the time is up), with the
    ids of the events made, in stream order."""
    agent = UserFactory.create(username="agent-smith")
    port = server.port

    async def main() -> tuple[list[Client], list[int]]:
        stop = asyncio.Event()
        clients = [Client(port, token) for _ in range(CLIENTS)]
        runners = [asyncio.create_task(client.run(stop)) for client in clients]
        await asyncio.wait_for(asyncio.gather(*(client.connected.wait() for client in clients)), 60)
        for client in clients:
            client.reconnects_to_start = client.reconnects
        before = await asyncio.to_thread(in_thread, last_event_id)
        for n in range(events):
            await asyncio.to_thread(in_thread, transitions.create, actor=agent, title=f"n{n}")
            if n == events // 2:
                await asyncio.to_thread(fault)
            await asyncio.sleep(0.05)
        expected = await asyncio.to_thread(in_thread, event_ids_after, before)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if all(client.ids[-1:] == expected[-1:] for client in clients):
                break
            await asyncio.sleep(0.2)
        stop.set()
        for runner in runners:
            runner.cancel()
        await asyncio.gather(*runners, return_exceptions=True)
        return clients, expected

    return asyncio.run(main())


def assert_every_client_got_every_event_once_in_order(
    clients: list[Client], expected: list[int]
) -> None:
    assert len(expected) >= 40
    wrong = [client for client in clients if client.ids != expected]
    assert not wrong, (
        f"{len(wrong)} of {len(clients)} clients differ; first: {wrong[0].ids[:5]}... "
        f"({len(wrong[0].ids)} ids, attempts {wrong[0].attempts[-6:]}) against "
        f"{expected[:5]}... ({len(expected)}); missing "
        f"{sorted(set(expected) - set(wrong[0].ids))}, extra "
        f"{sorted(set(wrong[0].ids) - set(expected))}; clients' missing ids: "
        f"{sorted({i for c in wrong for i in set(expected) - set(c.ids)})[:20]}"
    )


def server_processes(server: ServeProcess) -> list[psutil.Process]:
    """The uvicorn worker processes of ``serve --workers N`` (not Pushpin, not the
    resource tracker of multiprocessing)."""
    return children_running(server, "spawn_main")


def children_running(server: ServeProcess, word: str) -> list[psutil.Process]:
    """The processes under ``serve`` whose command line has ``word``; a killed one that is
    not yet reaped (a zombie) is none of them."""
    found = []
    for child in psutil.Process(server.process.pid).children():
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            if word in " ".join(child.cmdline()):
                found.append(child)
    return found


def publishing_process(server: ServeProcess) -> psutil.Process:
    """The server process whose relay holds the publisher's advisory lock (board.live.grip), as
    its log says ("relay: leading (process N, ...)"), once the lock is held."""
    from board.live.relay import LEADER_LOCK

    def held() -> bool:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted "
                "AND ((classid::bigint << 32) | objid::bigint) = %s",
                [LEADER_LOCK],
            )
            return cursor.fetchone() is not None

    eventually(held, timeout=10, what="a publisher")
    leading = re.findall(r"relay: leading \(process (\d+),", server.output)
    [process] = [p for p in server_processes(server) if p.pid == int(leading[-1])]
    return process


def test_every_client_gets_every_event_once_when_the_publishing_process_is_killed(
    behind_pushpin: ServeProcess, token_for: Callable[[str], str]
) -> None:
    workers = server_processes(behind_pushpin)
    assert len(workers) == 2

    def kill_the_publisher() -> None:
        in_thread(publishing_process, behind_pushpin).kill()

    clients, expected = run_clients(behind_pushpin, token_for("watcher"), kill_the_publisher)

    assert_every_client_got_every_event_once_in_order(clients, expected)
    # Pushpin held every stream: none ended with the process, another took over publishing.
    assert sum(client.reconnects - client.reconnects_to_start for client in clients) == 0
    eventually(lambda: len(server_processes(behind_pushpin)) == 2, timeout=30, what="a restart")


def test_every_client_gets_every_event_once_when_pushpin_restarts(
    behind_pushpin: ServeProcess, token_for: Callable[[str], str]
) -> None:
    def runner() -> psutil.Process:
        [found] = children_running(behind_pushpin, "pushpin")
        return found

    killed = threading.Event()

    def kill_pushpin() -> None:
        runner().kill()  # the board's watcher kills its services and starts it again
        killed.set()

    clients, expected = run_clients(behind_pushpin, token_for("watcher"), kill_pushpin)

    assert killed.is_set()
    assert_every_client_got_every_event_once_in_order(clients, expected)
    assert all(client.reconnects > client.reconnects_to_start for client in clients)


# --- a request whose server process dies while PostgreSQL holds it ------------------------


def sessions_waiting() -> list[tuple[int, int]]:
    """The (pid, client port) of the test database's sessions that wait for a lock, oldest
    first (behind the test's own lock, or behind another that waits for it: a second
    waiter for a row waits for the first)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid, client_port FROM pg_stat_activity "
            "WHERE datname = current_database() AND cardinality(pg_blocking_pids(pid)) > 0 "
            "ORDER BY backend_start"
        )
        rows = cursor.fetchall()
    connection.close()
    return [(int(pid), int(port)) for pid, port in rows]


def session_ended(pid: int) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [pid])
        ended = cursor.fetchone() is None
    connection.close()
    return ended


def process_of_session(server: ServeProcess, backend: int, port: int) -> psutil.Process | None:
    """The server process at the other end of database session ``backend``: the one whose
    connection leaves from local ``port`` over TCP, or over a Unix socket (the embedded
    database listens on one only, and the port is then -1) the one that holds the peer of
    the backend's socket, as ``ss`` tells."""
    for worker in server_processes(server):
        with contextlib.suppress(psutil.Error):
            if port > 0 and any(c.laddr.port == port for c in worker.net_connections("tcp")):
                return worker
            if port <= 0 and worker.pid == unix_socket_peer(backend):
                return worker
    return None


def unix_socket_peer(pid: int) -> int | None:
    """The process at the other end of a Unix socket that process ``pid`` holds (the first
    such, by ``ss -xp``), or None."""
    # Each line: netid, state, two queues, local address and inode, peer address and
    # inode, then the processes that hold the socket.
    line = re.compile(r"^\S+\s+\S+\s+\d+\s+\d+\s+\S+\s+(\d+)\s+\S+\s+(\d+)\s+(.*)$")
    holders: dict[int, list[int]] = {}
    peers: dict[int, int] = {}
    listing = subprocess.run(["ss", "-xpnH"], capture_output=True, text=True, check=True)
    for match in filter(None, map(line.match, listing.stdout.splitlines())):
        inode, peer, users = int(match[1]), int(match[2]), match[3]
        holders[inode] = [int(p) for p in re.findall(r"pid=(\d+)", users)]
        peers[inode] = peer
    for inode, pids in holders.items():
        if pid in pids and peers[inode] in holders and holders[peers[inode]]:
            return holders[peers[inode]][0]
    return None


@pytest.mark.parametrize("request_kind", ["create", "complete"])
def test_a_request_whose_process_is_killed_inside_the_database_is_not_sent_again(
    behind_pushpin: ServeProcess, token_for: Callable[[str], str], request_kind: str
) -> None:
    """The process that serves a POST is killed while its statement waits for a lock in
    PostgreSQL, which then carries it out when the lock is released: the client is told
    that the request failed (Pushpin's 502), and it is not sent to another process, which
    would carry it out a second time (two tasks from one create; a complete that answers
    409 lease_lost when its first run succeeded)."""
    headers = {"Authorization": f"Bearer {token_for('agent-under-lock')}"}
    api = httpx.Client(base_url=f"{behind_pushpin.url}/api/v1", headers=headers, timeout=60)
    created = api.post("/tasks/", json={"title": "to complete"})
    assert created.status_code == 201, created.text
    [claimed] = api.post("/tasks/claim/", json={}).json()["tasks"]
    # Requests first, so that Pushpin's connections to the server processes are open and
    # kept alive when the one that is killed is sent.
    for _ in range(6):
        assert api.get("/tasks/", params={"limit": 1}).status_code == 200

    with psycopg.connect(processes.tests_database_url(), autocommit=False) as locker:
        if request_kind == "create":
            # Holds the create's foreign-key check on its user, at its commit.
            locker.execute(
                "SELECT 1 FROM auth_user WHERE username = 'agent-under-lock' FOR UPDATE"
            ).fetchone()
            path, body = "/tasks/", {"title": "made once"}
        else:
            locker.execute("SELECT 1 FROM tasks WHERE id = %s FOR UPDATE", [claimed["id"]])
            path = f"/tasks/{claimed['id']}/complete/"
            body = {"lease_token": claimed["lease_token"]}
        answers: list[httpx.Response | Exception] = []

        def send() -> None:
            try:
                answers.append(api.post(path, json=body))
            except Exception as exc:
                answers.append(exc)

        sending = threading.Thread(target=send)
        sending.start()
        [(backend, port)] = eventually(
            lambda: sessions_waiting(), timeout=30, what="a session waiting"
        )
        worker = eventually(
            lambda: process_of_session(behind_pushpin, backend, port),
            what="the session's server process",
        )
        worker.kill()
        # Sent again, the request would reach the other process and wait behind the lock too.
        eventually(
            lambda: len(sessions_waiting()) > 1 or not sending.is_alive(),
            timeout=15,
            what="an answer or a second session waiting",
        )
        locker.rollback()
        sending.join(60)
    # The killed process's session carries its statement out once the lock is free, and
    # ends when it cannot answer.
    eventually(lambda: session_ended(backend), timeout=30, what="the killed process's session")

    [answer] = answers
    assert isinstance(answer, httpx.Response), answer
    if request_kind == "create":
        assert Task.objects.filter(title="made once").count() == 1
    else:
        assert Task.objects.get(pk=claimed["id"]).status == "done"
    assert answer.status_code == 502, answer.text
    if request_kind == "complete":
        # The client sends it again, and learns that the first one took effect.
        again = api.post(path, json=body)
        assert again.status_code == 409 and again.json()["status"] == "done", again.text
    api.close()


def test_a_pushpin_whose_directory_is_too_deep_for_its_sockets_starts_and_restarts(
    tmp_path: Path,
) -> None:
    # A data directory deep enough that "<dir>/run/pushpin-condure-out-stream" passes the
    # kernel's 107 bytes for a socket's path: condure refused to bind ("File name too
    # long") and Pushpin never answered. Its sockets then live elsewhere, and a runner
    # killed with SIGKILL must still have every service it left behind killed (condure's
    # command line names only that other directory), or the new one finds its port held.
    from taskboard.pushpin import Pushpin, run_directory

    deep = tmp_path / ("d" * 40) / ("e" * 40)
    edge = Pushpin(deep, http_port=free_port(), origin=f"127.0.0.1:{free_port()}")
    short = run_directory(deep)
    try:
        edge.start().wait_ready()
        assert edge.process is not None
        edge.process.kill()
        eventually(lambda: edge.restarts == 1, timeout=30, what="a restart")
        edge.wait_ready()
        assert edge.process.poll() is None, "the restarted Pushpin runs"
    finally:
        edge.stop()
    assert short != deep / "run" and len(str(short)) <= 60
    assert short.stat().st_mode & 0o777 == 0o700
    assert run_directory(deep) == short, "a restarted Pushpin finds the same directory"
    assert not [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if any(str(short) in part for part in p.info["cmdline"] or ())
    ], "stopped with every service it started"
