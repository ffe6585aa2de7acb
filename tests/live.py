"""A real ASGI server (uvicorn) in a thread of the test process, on the test database."""

from __future__ import annotations

import contextlib
import http.client
import json
import queue
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import uvicorn


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LiveServer:
    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.origin_url = self.url  # the server itself, where url may be a proxy in front
        config = uvicorn.Config(
            "taskboard.asgi:application",
            host="127.0.0.1",
            port=self.port,
            lifespan="on",
            log_level="warning",
            timeout_graceful_shutdown=2,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the live server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)


@contextmanager
def live_server(port: int | None = None) -> Iterator[LiveServer]:
    server = LiveServer(port).start()
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def relay_cut_off(relay: Any) -> Iterator[None]:
    """Cut ``relay`` (board.live.relay.Relay) off from the database and keep it from reconnecting
    for the block, so that what is announced meanwhile is lost to it; after the block,
    wait until it listens again on a new connection."""
    from django.db import connection

    conninfo, cut_off = relay.conninfo, relay.backend_pid
    relay.conninfo = "host=127.0.0.1 port=1 connect_timeout=1"
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [cut_off])
    deadline = time.monotonic() + 5
    while relay.connected.is_set():
        assert time.monotonic() < deadline, "the relay did not notice"
        time.sleep(0.01)
    try:
        yield
    finally:
        relay.conninfo = conninfo
    while not (relay.connected.is_set() and relay.backend_pid != cut_off):
        assert time.monotonic() < deadline + 10, "the relay did not reconnect"
        time.sleep(0.02)


class StreamCollector:
    """Hold an SSE stream open in a thread and collect its events and comment lines."""

    def __init__(self, url: str, headers: dict[str, str] | None = None, **params: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.path = parts.path + ("?" + urlencode(params) if params else "")
        self.headers = headers or {}
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.comments: list[str] = []
        self.status: int | None = None
        self.content_type = ""
        self.opened = threading.Event()
        self._socket: socket.socket | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._closed = False

    def start(self) -> StreamCollector:
        """Send the request in the background, without waiting for the answer (to a server
        that is stopped, say)."""
        self._thread.start()
        return self

    def __enter__(self) -> StreamCollector:
        self.start()
        if not self.opened.wait(10):
            raise RuntimeError("the stream did not open")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Hang up, as a browser closing its tab would."""
        self._closed = True
        if self._socket is not None:
            with contextlib.suppress(OSError):
                self._socket.shutdown(socket.SHUT_RDWR)
        self._thread.join(5)

    def _run(self) -> None:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        try:
            conn.connect()
            self._socket = conn.sock
            conn.request("GET", self.path, headers={"Accept": "text/event-stream", **self.headers})
            response = conn.getresponse()
            self.status = response.status
            self.content_type = response.getheader("content-type", "")
            self.opened.set()
            fields: dict[str, str] = {}
            while True:
                raw = response.readline()
                if not raw:
                    return
                line = raw.decode().rstrip("\r\n")
                if line == "":
                    # A block without data (such as "retry:") dispatches no event.
                    if "data" in fields:
                        self.events.put(self._parse(fields))
                    fields = {}
                elif line.startswith(":"):
                    self.comments.append(line)
                else:
                    name, _, value = line.partition(":")
                    fields[name] = value[1:] if value.startswith(" ") else value
        except (OSError, http.client.HTTPException, ValueError):
            if not self._closed:
                raise
        finally:
            self.opened.set()
            conn.close()

    @staticmethod
    def _parse(fields: dict[str, str]) -> dict[str, Any]:
        event: dict[str, Any] = dict(fields)
        if event.get("event") == "task_event":
            event["json"] = json.loads(event["data"])
        return event

    def get(self, timeout: float = 5) -> dict[str, Any]:
        """Return the next event, waiting up to ``timeout`` seconds."""
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no event within {timeout} s") from None

    def take(self, count: int, timeout: float = 5) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        return [self.get(max(0.01, deadline - time.monotonic())) for _ in range(count)]

    def nothing_within(self, seconds: float) -> bool:
        try:
            self.events.get(timeout=seconds)
        except queue.Empty:
            return True
        return False


@contextmanager
def live_server_behind_pushpin(directory: Path, settings: Any) -> Iterator[LiveServer]:
    """A LiveServer with a real Pushpin in front (taskboard.pushpin, Debian's pushpin), on
    the GRIP path of board.live.grip: streams held in Pushpin, events published to it. The
    server it yields has the LiveServer's relay and the Pushpin's ``url``."""
    from board.live import grip
    from taskboard.pushpin import Pushpin

    origin_port = free_port()
    edge = Pushpin(directory, http_port=free_port(), origin=f"127.0.0.1:{origin_port}")
    settings.GRIP_URL = edge.grip_url
    grip._config.clear()
    edge.start().wait_ready()
    try:
        with live_server(origin_port) as server:
            server.url = f"http://127.0.0.1:{edge.http_port}"
            deadline = time.monotonic() + 30
            while not _answers(f"{server.url}/healthz"):
                if time.monotonic() > deadline:
                    raise RuntimeError("Pushpin did not pass requests to the server")
                time.sleep(0.1)
            yield server
    finally:
        edge.stop()
        grip._config.clear()


def _answers(url: str) -> bool:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=2)
    try:
        conn.request("GET", parts.path)
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()
