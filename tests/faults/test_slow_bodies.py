"""Clients that send their request bodies a byte at a time.

Django runs on TASKBOARD_THREADS (4) worker threads. A body read from inside one would
hold it, so four slow bodies would hold all four and every other request, /healthz
included, would wait for as long as they lasted. No login is needed: the login form takes
a POST from anyone with a self-made csrftoken cookie.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.factories import TokenFactory, UserFactory
from tests.live import LiveServer

pytestmark = [pytest.mark.slow, pytest.mark.once, pytest.mark.django_db(transaction=True)]

SLOW_CLIENTS = 6  # more than TASKBOARD_THREADS
BODY_TIMEOUT = 8


class SlowBody:
    """A raw connection that declares a 100,000-byte body and sends a byte now and then."""

    def __init__(self, server: LiveServer) -> None:
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
        csrf = "a" * 32
        self.sock.sendall(
            (
                "POST /accounts/login/ HTTP/1.1\r\n"
                f"Host: 127.0.0.1:{server.port}\r\n"
                "Content-Type: application/x-www-form-urlencoded\r\n"
                "Content-Length: 100000\r\n"
                f"Cookie: csrftoken={csrf}\r\n"
                "\r\n"
                f"csrfmiddlewaretoken={csrf}&username=x&password="
            ).encode()
        )
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._dribble, daemon=True)
        self.thread.start()

    def _dribble(self) -> None:
        while not self.stop.wait(0.5):
            try:
                self.sock.sendall(b"x")
            except OSError:  # the server hung up on us: what it answered is read below
                return

    def response(self) -> tuple[int, dict[str, Any]]:
        """Read the server's answer: (status, JSON body)."""
        data = b""
        with contextlib.suppress(OSError):
            while chunk := self.sock.recv(65536):
                data += chunk
        self.stop.set()
        head, _, body = data.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        return status, json.loads(body)

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


@pytest.fixture
def slow_bodies(server: LiveServer) -> Iterator[list[SlowBody]]:
    clients = [SlowBody(server) for _ in range(SLOW_CLIENTS)]
    yield clients
    for client in clients:
        client.close()


@pytest.fixture(autouse=True)
def short_body_timeout(settings: Any) -> None:
    settings.TASKBOARD_BODY_TIMEOUT = BODY_TIMEOUT


def test_slow_bodies_hold_no_thread_and_are_refused_with_408_when_their_time_is_up(
    server: LiveServer, slow_bodies: list[SlowBody]
) -> None:
    token = TokenFactory.create(user=UserFactory.create(username="busy-agent"))
    headers = {"Authorization": f"Bearer {token.key}"}
    started = time.monotonic()
    time.sleep(1)  # every slow client is well into its body

    # Meanwhile the server answers everyone else, at once. (Before the fix, these waited
    # for the slow bodies: the timeout below is what they ran into.)
    with httpx.Client(base_url=server.url, timeout=4) as client:
        for _ in range(3):
            asked = time.monotonic()
            assert client.get("/healthz").status_code == 200
            listed = client.get("/api/v1/tasks/", headers=headers)
            assert listed.status_code == 200, listed.text
            created = client.post("/api/v1/tasks/", json={"title": "meanwhile"}, headers=headers)
            assert created.status_code == 201, created.text
            assert time.monotonic() - asked < 3
    assert time.monotonic() - started < BODY_TIMEOUT, "the checks ran while the bodies were slow"

    for slow in slow_bodies:
        status, body = slow.response()
        assert status == 408
        assert body["error"] == "request_timeout"
        assert body["detail"]
    # Each was refused when its time was up, not when it finished (100,000 s from now).
    assert time.monotonic() - started < BODY_TIMEOUT + 10
