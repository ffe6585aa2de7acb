"""The README's promise, end to end: ``taskboard serve`` on a fresh data directory boots an
embedded PostgreSQL, prints the first-run secrets once, and serves the API with them."""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from taskboard.management.commands.serve import Command
from tests.factories import TokenFactory, UserFactory
from tests.processes import ServeProcess, free_port

# `taskboard serve`'s processes and listener: the same on any PostgreSQL.
pytestmark = pytest.mark.once


@pytest.mark.slow
def test_a_first_run_prints_the_secrets_once_and_serves_an_agent(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = ServeProcess(tmp_path / "first.log", data_dir=data_dir, migrate=True, port=port)
    try:
        server.wait_healthy()
    finally:
        server.stop()
    first_output = server.output

    assert "Board       http://127.0.0.1:" in first_output
    assert "/api/v1/docs/" in first_output
    password = re.search(r"admin\s+password (\S+)", first_output)
    token = re.search(r"demo-agent\s+token\s+(\S+)", first_output)
    assert password and token, first_output

    server = ServeProcess(tmp_path / "second.log", data_dir=data_dir, migrate=True, port=port)
    try:
        server.wait_healthy()
        headers = {"Authorization": f"Bearer {token[1]}"}
        created = httpx.post(f"{url}/api/v1/tasks/", json={"title": "hello"}, headers=headers)
        assert created.status_code == 201, created.text
        claimed = httpx.post(f"{url}/api/v1/tasks/claim/", json={}, headers=headers).json()
        assert [task["id"] for task in claimed["tasks"]] == [created.json()["id"]]
        assert claimed["tasks"][0]["leased_by"] == "demo-agent"
        login = httpx.get(f"{url}/admin/login/")
        assert login.status_code == 200
    finally:
        server.stop()
    second_output = server.output

    assert "password" not in second_output, "the secrets are printed on the first run only"


def default_workers() -> int:
    return int(Command().create_parser("manage.py", "serve").parse_args([]).workers)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity here")
def test_serve_runs_a_process_per_cpu_it_may_use_unless_told(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("WEB_CONCURRENCY", raising=False)
    allowed = os.sched_getaffinity(0)
    assert default_workers() == len(allowed)
    try:
        # Held to one CPU (as by taskset or a container's cpuset): one process.
        os.sched_setaffinity(0, {min(allowed)})
        assert default_workers() == 1
    finally:
        os.sched_setaffinity(0, allowed)

    monkeypatch.setenv("WEB_CONCURRENCY", "3")
    assert default_workers() == 3


@pytest.mark.django_db
def test_a_request_the_server_cannot_parse_gets_the_apis_json_error(tmp_path: Path) -> None:
    """A header with a control character never reaches Django: uvicorn refuses it, and
    its answer is the contract's JSON error too, not plain text."""
    import json
    import socket

    from tests.processes import tests_database_url

    server = ServeProcess(
        tmp_path / "serve.log", "--workers", "1", env={"DATABASE_URL": tests_database_url()}
    )
    try:
        server.wait_healthy()
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(
                b"POST /api/v1/tasks/ HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Idempotency-Key: k\x7f\r\nContent-Type: application/json\r\n"
                b"Content-Length: 2\r\n\r\n{}"
            )
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
    finally:
        server.stop()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), answer
    assert b"content-type: application/json" in head.lower(), head
    error = json.loads(body)
    assert error["error"] == "invalid" and error["detail"], error


def test_an_operators_metrics_directory_must_exist_and_is_emptied_of_an_earlier_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A missing one crashed serve with a traceback; an earlier run's files were summed in.
    from django.core.exceptions import ImproperlyConfigured

    from taskboard import server

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "missing"))
    with pytest.raises(ImproperlyConfigured, match="PROMETHEUS_MULTIPROC_DIR is not a directory"):
        server._share_metrics()

    (tmp_path / "histogram_123.db").write_bytes(b"old")
    (tmp_path / "notes.txt").write_text("kept")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    assert server._share_metrics() is None  # the operator's: not removed at the end
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_busy_port_is_named_in_one_line_before_any_banner(tmp_path: Path, workers: str) -> None:
    import socket

    from tests.processes import tests_database_url

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = ServeProcess(
            tmp_path / "serve.out",
            "--workers",
            workers,
            env={"DATABASE_URL": tests_database_url()},
            data_dir=tmp_path / "data",
            port=port,
            stderr=tmp_path / "serve.err",
        )
        status = server.wait()

    assert status != 0
    assert "Board" not in server.output, "no banner for a board that is not served"
    assert server.error_output.strip().splitlines() == [
        f"CommandError: port {port} is taken (something listens on 127.0.0.1:{port}): stop "
        "it, or serve on another port (--port)"
    ]


def serve_on_the_test_database(tmp_path: Path, **env: str) -> ServeProcess:
    """Start ``serve --workers 1`` on the test database (committed data: a transactional
    test's) with ``env``, and return it once healthy."""
    from tests.processes import tests_database_url

    server = ServeProcess(
        tmp_path / "serve.log", "--workers", "1", env={"DATABASE_URL": tests_database_url(), **env}
    )
    try:
        return server.wait_healthy()
    except BaseException:
        server.stop()
        raise


def closed_after(sock: socket.socket, opened: float, limit: float) -> tuple[float, bytes]:
    """Read ``sock`` until the server closes it; return the seconds from ``opened`` that
    took (at most ``limit``, else fail) and what the server sent."""
    sock.settimeout(max(0.1, opened + limit - time.monotonic()))
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except TimeoutError:
        raise AssertionError(f"the connection was still open after {limit} s") from None
    except ConnectionResetError:
        pass
    return time.monotonic() - opened, received


HEADER_TIMEOUT = 2
MARGIN = 3


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_connections_that_never_finish_their_headers_are_closed_but_streams_run_on(
    tmp_path: Path,
) -> None:
    user = UserFactory.create(username="header-watcher")
    token = TokenFactory.create(user=user).key
    assert token is not None
    server = serve_on_the_test_database(tmp_path, TASKBOARD_HEADER_TIMEOUT=str(HEADER_TIMEOUT))
    address = ("127.0.0.1", server.port)
    try:
        stream = socket.create_connection(address, timeout=10)
        stream.sendall(
            b"GET /api/v1/stream/ HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Authorization: Bearer " + token.encode() + b"\r\nAccept: text/event-stream\r\n\r\n"
        )
        head = stream.recv(65536)
        assert head.startswith(b"HTTP/1.1 200 "), head
        stream_opened = time.monotonic()

        idle = socket.create_connection(address)
        dripper = socket.create_connection(address)
        opened = time.monotonic()
        dripper.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        stop = threading.Event()

        def drip() -> None:
            # A header line every half second: a timer restarted at each line would keep the
            # connection open.
            with contextlib.suppress(OSError):
                while not stop.wait(0.5):
                    dripper.sendall(b"X-Drip: 1\r\n")

        dripping = threading.Thread(target=drip, daemon=True)
        dripping.start()
        try:
            idle_for, said_to_idle = closed_after(idle, opened, HEADER_TIMEOUT + MARGIN)
            _, said_to_dripper = closed_after(dripper, opened, HEADER_TIMEOUT + MARGIN)
        finally:
            stop.set()
            dripping.join()
            idle.close()
            dripper.close()
        assert idle_for >= HEADER_TIMEOUT - 0.5, "closed before the deadline"
        assert said_to_idle == b"", "no answer to a connection that asked nothing"
        assert said_to_dripper.startswith(b"HTTP/1.1 408 "), said_to_dripper

        # A request that sends its headers at once is served, twice on one connection.
        normal = http.client.HTTPConnection(*address, timeout=10)
        try:
            for _ in range(2):
                normal.request("GET", "/healthz")
                answer = normal.getresponse()
                assert answer.status == 200, answer.read()
                answer.read()
        finally:
            normal.close()

        # The stream, open well past the deadline, still carries events.
        time.sleep(max(0.0, stream_opened + HEADER_TIMEOUT + MARGIN - time.monotonic()))
        created = httpx.post(
            f"{server.url}/api/v1/tasks/",
            json={"title": "after the deadline"},
            headers={"Authorization": f"Bearer {token}"},
        )
        assert created.status_code == 201, created.text
        received = b""
        stream.settimeout(10)
        while b"after the deadline" not in received:
            chunk = stream.recv(65536)
            assert chunk, f"the stream was closed: {received[-500:]!r}"
            received += chunk
        stream.close()
    finally:
        server.stop()


def failed_logins(server: ServeProcess, forwarded_for: list[str]) -> list[int]:
    """Fail to log in at /admin/login/ once per entry, each sent with that
    ``X-Forwarded-For``; return the statuses."""
    statuses = []
    with httpx.Client(base_url=server.url) as browser:
        browser.get("/admin/login/")
        for address in forwarded_for:
            response = browser.post(
                "/admin/login/",
                data={
                    "username": "nobody",
                    "password": "wrong",
                    "csrfmiddlewaretoken": browser.cookies["csrftoken"],
                },
                headers={"X-Forwarded-For": address},
            )
            statuses.append(response.status_code)
    return statuses


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_by_default_a_local_client_cannot_name_its_address_to_the_throttle(
    tmp_path: Path,
) -> None:
    """A client on the server's own host is no proxy: what it says in X-Forwarded-For
    neither spreads its failures over addresses nor spends another address's."""
    from tests.test_tokens import fresh_window

    agent = UserFactory.create(username="local-agent")
    valid = {"Authorization": f"Bearer {TokenFactory.create(user=agent).key}"}
    server = serve_on_the_test_database(tmp_path)
    try:
        fresh_window(seconds_needed=20)
        # Half the limit as failed logins, each from a "new" address...
        assert failed_logins(server, [f"10.9.{n}.1" for n in range(15)]) == [200] * 15
        # ...half as wrong tokens "from" 10.9.9.9.
        with httpx.Client(base_url=server.url) as client:
            for _ in range(15):
                wrong = client.get(
                    "/api/v1/tasks/",
                    headers={"Authorization": "Bearer wrong", "X-Forwarded-For": "10.9.9.9"},
                )
                assert wrong.status_code == 401, wrong.text
            # All 30 counted against the peer, 127.0.0.1: its valid token is refused now...
            refused = client.get("/api/v1/tasks/", headers=valid)
            assert refused.status_code == 429, refused.text
            # ...and a valid token "from" 10.9.9.9 is refused too (it is the same peer).
            refused = client.get("/api/v1/tasks/", headers={**valid, "X-Forwarded-For": "10.9.9.9"})
            assert refused.status_code == 429, refused.text
        assert failed_logins(server, ["10.9.200.1"]) == [429]
    finally:
        server.stop()


def test_serve_trusts_forwarded_headers_only_from_the_named_proxies_and_its_own_pushpin(
    settings: Any,
) -> None:
    from taskboard.management.commands.serve import trusted_proxies

    settings.FORWARDED_ALLOW_IPS = []
    assert trusted_proxies(pushpin=False) == []
    assert trusted_proxies(pushpin=True) == ["127.0.0.1"]
    settings.FORWARDED_ALLOW_IPS = ["192.0.2.0/24"]
    assert trusted_proxies(pushpin=False) == ["192.0.2.0/24"]
    assert trusted_proxies(pushpin=True) == ["192.0.2.0/24", "127.0.0.1"]


def test_pushpin_drops_the_clients_x_forwarded_for_unless_proxies_stand_in_front(
    tmp_path: Path,
) -> None:
    from taskboard.pushpin import render

    def x_forwarded_for(proxies_in_front: bool) -> str:
        config = render(
            tmp_path / str(proxies_in_front),
            http_port=1,
            origin="127.0.0.1:2",
            port_offset=100,
            sig_key="k",
            proxies_in_front=proxies_in_front,
        ).read_text()
        [line] = [line for line in config.splitlines() if line.startswith("x_forwarded_for=")]
        return line

    assert x_forwarded_for(False) == "x_forwarded_for=truncate:0,append"
    assert x_forwarded_for(True) == "x_forwarded_for=append"


def test_forwarded_allow_ips_must_be_addresses_or_networks() -> None:
    import subprocess
    import sys

    from tests.processes import ROOT

    def settings_with(value: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", "import taskboard.settings"],
            cwd=ROOT,
            env={**os.environ, "FORWARDED_ALLOW_IPS": value},
            capture_output=True,
            text=True,
        )

    assert settings_with("10.0.0.1, 192.0.2.0/24,::1").returncode == 0
    refused = settings_with("proxy.example.com")
    assert "FORWARDED_ALLOW_IPS must be IP addresses or networks" in refused.stderr
