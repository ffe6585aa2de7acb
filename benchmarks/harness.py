"""What every scenario shares: figures and targets, timing, progress, scratch databases,
the server under test, and the bulk SQL that sets up data.

Nothing here ever touches the application's own database: every scenario runs in a fresh
scratch database cloned from a migrated template on the same PostgreSQL server, and every
connection the benchmark opens to it is named ``taskboard-benchmark`` so that the
server's own connections can be counted apart.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

APPLICATION_NAME = "taskboard-benchmark"
AGENT_PREFIX = "bench-agent-"
# The checkout that holds benchmarks/ (not installed: -m finds it from there).
CHECKOUT = Path(__file__).resolve().parent.parent


# -- figures ------------------------------------------------------------------------------


@dataclass
class Figure:
    """One measured number, with the target it is held to (if any)."""

    name: str
    value: float
    unit: str = ""
    target: str = ""  # e.g. ">= 0.40", "< 100"
    detail: str = ""

    @property
    def passed(self) -> bool | None:
        if not self.target:
            return None
        op, _, bound = self.target.partition(" ")
        limit = float(bound)
        return {
            ">=": self.value >= limit,
            ">": self.value > limit,
            "<=": self.value <= limit,
            "<": self.value < limit,
        }[op]

    def formatted(self) -> str:
        return format_value(self.value, self.unit)


def format_value(value: float, unit: str) -> str:
    if unit == "x":
        return f"{value:.2f}x"
    if unit == "MB":
        return f"{value:.0f} MB" if value >= 10 else f"{value:.1f} MB"
    if math.isfinite(value) and value == int(value) and abs(value) < 1e15:
        text = f"{int(value):,}"
    elif abs(value) >= 100:
        text = f"{value:,.0f}"
    elif abs(value) >= 10:
        text = f"{value:.1f}"
    else:
        text = f"{value:.2f}"
    return f"{text} {unit}".strip()


@dataclass
class ScenarioResult:
    name: str
    title: str
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    error: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def add(
        self, name: str, value: float, unit: str = "", target: str = "", detail: str = ""
    ) -> Figure:
        figure = Figure(name, float(value), unit, target, detail)
        self.figures.append(figure)
        return figure

    def note_reopened(self, readies: list[dict[str, Any]]) -> None:
        """Note the connections that the helpers had to open again (their ``ready``
        answers), with the first few reasons, if there were any."""
        reopened = [reason for ready in readies for reason in ready.get("reopened", [])]
        if reopened:
            self.note(
                f"{len(reopened)} connections failed to open and were opened again, "
                f"first: {'; '.join(reopened[:3])}"
            )

    def note(self, text: str) -> None:
        self.notes.append(text)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for figure, raw in zip(self.figures, data["figures"], strict=True):
            raw["passed"] = figure.passed
        return data


def count_label(count: int) -> str:
    """Return ``count`` as a figure's name says it: 950, 100k, 1M."""
    if count >= 1_000_000 and count % 1_000_000 == 0:
        return f"{count // 1_000_000:,}M"
    if count >= 1_000 and count % 1_000 == 0:
        return f"{count // 1_000:,}k"
    return f"{count:,}"


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else math.inf


def percentile(values: Sequence[float], q: float) -> float:
    """Return the q-th percentile (0..100) of ``values``, linearly interpolated."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


# -- progress ---------------------------------------------------------------------------


class Progress:
    """Progress lines on stderr, each stamped with the time since the run began."""

    def __init__(self, stream: Any = None, enabled: bool = True) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.started = time.monotonic()
        self.scenario = ""

    def __call__(self, message: str) -> None:
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.started
        prefix = f"{self.scenario}: " if self.scenario else ""
        self.stream.write(f"[{elapsed:6.1f}s] {prefix}{message}\n")
        self.stream.flush()


# -- databases ----------------------------------------------------------------------------


@dataclass
class ServerParams:
    """Where the PostgreSQL server is: libpq keywords without a database name."""

    host: str
    port: int | None
    user: str
    password: str = ""

    def conninfo(self, dbname: str, application_name: str = APPLICATION_NAME) -> str:
        keywords: dict[str, Any] = {"host": self.host, "user": self.user, "dbname": dbname}
        if self.port:
            keywords["port"] = self.port
        if self.password:
            keywords["password"] = self.password
        return psycopg.conninfo.make_conninfo(**keywords, application_name=application_name)

    def url(self, dbname: str) -> str:
        """Return a DATABASE_URL for ``dbname`` (a socket directory is percent-encoded)."""
        host = urllib.parse.quote(self.host, safe="") if self.host.startswith("/") else self.host
        auth = urllib.parse.quote(self.user, safe="")
        if self.password:
            auth += ":" + urllib.parse.quote(self.password, safe="")
        port = f":{self.port}" if self.port else ""
        return f"postgresql://{auth}@{host}{port}/{dbname}"

    def django_settings(self, dbname: str, base: dict[str, Any]) -> dict[str, Any]:
        settings = copy.deepcopy(base)
        settings.update(
            ENGINE="django.db.backends.postgresql",
            NAME=dbname,
            HOST=self.host,
            PORT=str(self.port or ""),
            USER=self.user,
            PASSWORD=self.password,
            CONN_MAX_AGE=0,
            CONN_HEALTH_CHECKS=False,
            OPTIONS={"application_name": APPLICATION_NAME, "connect_timeout": 10},
        )
        return settings

    @classmethod
    def from_url(cls, url: str) -> ServerParams:
        import dj_database_url

        parsed = dj_database_url.parse(url)
        return cls(
            host=parsed.get("HOST") or "localhost",
            port=int(parsed["PORT"]) if parsed.get("PORT") else None,
            user=parsed.get("USER") or "postgres",
            password=parsed.get("PASSWORD") or "",
        )

    @classmethod
    def from_django(cls) -> ServerParams:
        """Read the configured default database's server (starting the embedded one)."""
        from django.db import connection

        params = connection.get_connection_params()
        return cls(
            host=str(params.get("host") or "localhost"),
            port=int(params["port"]) if params.get("port") else None,
            user=str(params.get("user") or "postgres"),
            password=str(params.get("password") or ""),
        )


class Scratch:
    """The benchmark's databases on one server: a migrated template, and one fresh clone
    per scenario, all named ``<prefix>_...`` and dropped at the end unless kept."""

    def __init__(
        self,
        server: ServerParams,
        prefix: str,
        progress: Progress,
        keep: bool,
        *,
        in_place: bool = False,
    ) -> None:
        self.server = server
        # True when the server is the configured one: Django's settings then only need
        # another database name.
        self.in_place = in_place
        self.prefix = prefix
        self.progress = progress
        self.keep = keep
        self.template = f"{prefix}_template"
        self._original_default: dict[str, Any] | None = None

    def maintenance(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.server.conninfo("postgres"), autocommit=True)

    def server_version(self) -> str:
        with self.maintenance() as conn:
            row = conn.execute("SHOW server_version").fetchone()
        return str(row[0]) if row else "?"

    def _create(self, name: str, template: str | None = None) -> None:
        with self.maintenance() as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
            statement = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
            if template:
                statement += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
            conn.execute(statement)

    def drop(self, name: str) -> None:
        with self.maintenance() as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )

    def prepare_template(self, application_database: str | None) -> None:
        """Create and migrate the template database, refusing the application's own name."""
        if self.template == application_database:
            raise RuntimeError(f"refusing to benchmark in the application database {self.template}")
        from django.core.management import call_command

        self.progress(f"creating and migrating the scratch template {self.template}")
        self._create(self.template)
        self.use(self.template)
        call_command("migrate", database="default", interactive=False, verbosity=0)
        self.release()

    @contextlib.contextmanager
    def database(self, scenario: str) -> Iterator[Database]:
        """Clone the template into a fresh database for ``scenario``; Django's default
        connection points at it while the block runs."""
        name = f"{self.prefix}_{scenario}"
        self._create(name, template=self.template)
        database = Database(name, self.server, self)
        self.use(name)
        try:
            yield database
        finally:
            self.release()
            if self.keep:
                self.progress(f"kept the scratch database {name}")
            else:
                self.drop(name)

    def use(self, dbname: str) -> None:
        """Point Django's default connection (in every thread) at ``dbname``.

        On the configured server only the name changes, in place, so that the connection
        objects (and anything patched onto them) stay; on another server (--database-url)
        the settings are replaced and the connection object made anew.
        """
        from django.db import connections

        connections.close_all()
        current = connections.settings["default"]
        if self._original_default is None:
            self._original_default = copy.deepcopy(current)
        if self.in_place:
            replacement = copy.deepcopy(self._original_default)
            replacement["NAME"] = dbname
            replacement["OPTIONS"] = {
                **replacement.get("OPTIONS", {}),
                "application_name": APPLICATION_NAME,
            }
        else:
            replacement = self.server.django_settings(dbname, self._original_default)
            with contextlib.suppress(AttributeError):
                del connections["default"]
        current.clear()
        current.update(replacement)

    def release(self) -> None:
        from django.db import connections

        connections.close_all()

    def restore(self) -> None:
        """Point Django back at the application database; drop the template unless kept."""
        from django.db import connections

        self.release()
        if self._original_default is not None:
            current = connections.settings["default"]
            current.clear()
            current.update(self._original_default)
            if not self.in_place:
                with contextlib.suppress(AttributeError):
                    del connections["default"]
        if not self.keep:
            with contextlib.suppress(psycopg.Error):
                self.drop(self.template)


@dataclass
class Database:
    name: str
    server: ServerParams
    scratch: Scratch

    @property
    def conninfo(self) -> str:
        return self.server.conninfo(self.name)

    @property
    def url(self) -> str:
        return self.server.url(self.name)

    def connect(self, *, autocommit: bool = True) -> psycopg.Connection[Any]:
        """Open a raw connection configured as Django configures its own (client-side
        binding, which the claim statement's literal true/false relies on)."""
        return psycopg.connect(
            self.conninfo, autocommit=autocommit, cursor_factory=psycopg.ClientCursor
        )

    def execute(self, statement: str, params: dict[str, Any] | None = None) -> list[Any]:
        with self.connect() as conn:
            cur = conn.execute(statement, params)
            return cur.fetchall() if cur.description else []

    def server_connections(self) -> tuple[int, int]:
        """Return (open, active) client connections to this database that are not the
        benchmark's own: the server's worker threads, relays and replay pools."""
        with self.scratch.maintenance() as conn:
            row = conn.execute(
                """
                SELECT count(*), count(*) FILTER (WHERE state <> 'idle')
                FROM pg_stat_activity
                WHERE datname = %s AND backend_type = 'client backend'
                  AND application_name <> %s
                """,
                [self.name, APPLICATION_NAME],
            ).fetchone()
        assert row is not None
        return int(row[0]), int(row[1])


# -- data ---------------------------------------------------------------------------------

INSERT_TASKS = """
INSERT INTO tasks (
    title, description, payload, queue, priority, max_failures, status, failure_count,
    created_by, created_at, updated_at, result
)
SELECT 'bench ' || g, '', '{}'::jsonb, 'default', 0, 3, %(status)s, 0,
       %(created_by)s, now(), now(),
       CASE WHEN %(status)s = 'done' THEN '{"ok": true}'::jsonb END
FROM generate_series(1, %(count)s) g
"""


def create_agents(count: int) -> list[tuple[str, str]]:
    """Create ``count`` agents with API tokens in the current database; return
    (username, token) pairs."""
    from django.contrib.auth import get_user_model

    from access import tokens

    User = get_user_model()
    agents = []
    for index in range(count):
        user = User.objects.create(username=f"{AGENT_PREFIX}{index}")
        agents.append((user.username, str(tokens.issue(user).key)))
    return agents


def insert_tasks(
    database: Database, count: int, *, status: str = "pending", created_by: str
) -> None:
    """Insert ``count`` tasks in one statement (no events: nothing reads them here)."""
    database.execute(INSERT_TASKS, {"status": status, "count": count, "created_by": created_by})


# What GET queues/ counts, by a scan of tasks: blocked apart from pending.
COUNT_BY_QUEUE = """
SELECT queue,
       count(*) FILTER (WHERE status = 'pending' AND open_dependencies = 0) AS pending,
       count(*) FILTER (WHERE status = 'pending' AND open_dependencies > 0) AS blocked,
       count(*) FILTER (WHERE status = 'in_progress') AS in_progress,
       count(*) FILTER (WHERE status = 'escalated') AS escalated,
       count(*) FILTER (WHERE status = 'done') AS done,
       count(*) FILTER (WHERE status = 'cancelled') AS cancelled
FROM tasks
GROUP BY queue
ORDER BY queue
"""
STATUS_COUNTS = ("pending", "blocked", "in_progress", "escalated", "done", "cancelled")


def count_mismatches(counted: dict[str, dict[str, int]], listed: list[dict[str, Any]]) -> list[str]:
    """Compare queue items as GET queues/ lists them with counts by a scan; return what
    differs, one line per queue (empty when they agree). A queue listed with all counts
    zero is the same as a queue not listed."""
    kept = {
        item["name"]: {k: int(item["counts"].get(k, 0)) for k in STATUS_COUNTS} for item in listed
    }
    zero = dict.fromkeys(STATUS_COUNTS, 0)
    lines = []
    for queue in sorted(set(counted) | set(kept)):
        scanned = counted.get(queue, zero)
        answered = kept.get(queue, zero)
        if scanned != answered:
            lines.append(f"{queue}: listed {answered}, COUNT(*) {scanned}")
    return lines


def queue_count_mismatches(scratch: Scratch, database: Database) -> list[str]:
    """Compare board.queues.queue_list() on ``database`` with a COUNT(*) of its tasks."""
    from board.queues import queue_list

    counted = {}
    with database.connect() as conn:
        cur = conn.execute(COUNT_BY_QUEUE)
        for row in cur.fetchall():
            counted[row[0]] = dict(zip(STATUS_COUNTS, map(int, row[1:]), strict=True))
    scratch.use(database.name)
    try:
        listed = queue_list()
    finally:
        scratch.release()
    return count_mismatches(counted, listed)


# -- the server under test ----------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def short_temp_dir() -> str:
    """The temporary directory, or /tmp when its path is too long for Unix sockets in it."""
    directory = tempfile.gettempdir()
    return directory if len(directory) <= 40 else "/tmp"


def raise_file_limit() -> None:
    """Raise this process's open-file limit to its hard limit (1,000 sockets and more)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class Server:
    """``taskboard serve --no-migrate`` in a subprocess, on a free port, on one database.

    ``serve`` runs its defaults: one server process per CPU (uvicorn's workers, children
    of ``serve``), unless ``workers`` says otherwise. With ``pushpin``, Pushpin listens on
    the public port (:attr:`url`) in front of them (``serve --pushpin``), with its own data
    directory so that it never touches another board's Pushpin.
    """

    def __init__(
        self,
        database: Database,
        log_path: Path,
        progress: Progress,
        *,
        workers: int | None = None,
        pushpin: bool = False,
    ) -> None:
        self.database = database
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.progress = progress
        self.workers = workers
        self.pushpin = pushpin
        self.process: subprocess.Popen[bytes] | None = None
        self.data_dir: Path | None = None
        self.peak_rss = 0

    def command(self) -> list[str]:
        command = [sys.executable, "-m", "taskboard.commands", "serve", "--no-migrate"]
        command += ["--port", str(self.port)]
        if self.workers is not None:
            command += ["--workers", str(self.workers)]
        if self.pushpin:
            command.append("--pushpin")
        return command

    def start(self, timeout: float = 60) -> Server:
        import httpx

        from board import conf

        env = {
            **os.environ,
            "DATABASE_URL": self.database.url,
            # The access log would cost as much as the requests it records.
            "LOG_LEVEL": "WARNING",
            "PYTHONUNBUFFERED": "1",
        }
        if self.pushpin:
            # serve --pushpin keeps Pushpin's configuration and sockets under the data
            # directory and kills what runs from there: give it one of its own (with the
            # same secret key, which a fresh directory would otherwise make anew), short
            # enough for the paths of Pushpin's Unix sockets (108 bytes at most).
            self.data_dir = Path(tempfile.mkdtemp(prefix="tb-bench-", dir=short_temp_dir()))
            env["TASKBOARD_DATA_DIR"] = str(self.data_dir)
            env["SECRET_KEY"] = conf.secret_key()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            self.command(),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=raise_file_limit,
        )
        log.close()
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"the server exited; see {self.log_path}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(self.url + "/healthz", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the server did not start in {timeout} s; see {self.log_path}"
                    )
                time.sleep(0.2)
        except BaseException:
            self.stop()  # no __exit__ follows a failed start: stop what did start
            raise
        processes = self.server_processes()
        self.progress(
            f"server up on port {self.port} (pid {self.process.pid}, "
            f"{len(processes)} server process{'es' if len(processes) > 1 else ''}"
            f"{', behind Pushpin' if self.pushpin else ''})"
        )
        return self

    def stop(self) -> None:
        import psutil

        if self.process is not None and self.process.poll() is None:
            # Found now, while serve is their parent: what a killed serve leaves behind.
            descendants = []
            with contextlib.suppress(psutil.Error):
                descendants = psutil.Process(self.process.pid).children(recursive=True)
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
            for child in descendants:
                with contextlib.suppress(psutil.Error):
                    child.kill()
        if self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def server_processes(self) -> list[Any]:
        """The processes that serve requests: uvicorn's workers (children of ``serve``
        started by multiprocessing's spawn, not Pushpin, not its resource tracker), or
        ``serve`` itself when it runs one process."""
        import psutil

        assert self.process is not None
        try:
            serve = psutil.Process(self.process.pid)
            workers = [
                child for child in serve.children() if "spawn_main" in " ".join(child.cmdline())
            ]
        except psutil.Error:
            return []
        return workers or [serve]

    def all_processes(self) -> list[Any]:
        """``serve`` and every process under it (workers, Pushpin and its services)."""
        import psutil

        assert self.process is not None
        try:
            serve = psutil.Process(self.process.pid)
            return [serve, *serve.children(recursive=True)]
        except psutil.Error:
            return []

    def rss_mb(self) -> float:
        """Return the resident memory of the server (its process and any children), MB."""
        total = sum(_rss(process) for process in self.all_processes())
        self.peak_rss = max(self.peak_rss, total)
        return total / 2**20

    def rss_per_process_mb(self) -> list[float]:
        """Return the resident memory of each server process (:meth:`server_processes`)."""
        return [_rss(process) / 2**20 for process in self.server_processes()]

    def connections_per_process(self) -> tuple[list[int], int, int]:
        """Return the server's database connections: how many each server process holds
        (its sockets), all of them and how many are active (not idle), as PostgreSQL
        counts them. The benchmark's own connections are not counted."""
        processes = self.server_processes()
        per_process = database_sockets([p.pid for p in processes], self.database.server)
        open_, active = self.database.server_connections()
        return per_process, open_, active

    def cpu_percent(self, interval: float) -> float:
        """Return the CPU use of ``serve`` and everything under it over ``interval``, in
        percent of one CPU (200 is two CPUs busy)."""
        import psutil

        def times() -> dict[int, float]:
            spent = {}
            for process in self.all_processes():
                with contextlib.suppress(psutil.Error):
                    cpu = process.cpu_times()
                    spent[process.pid] = cpu.user + cpu.system
            return spent

        before = times()
        time.sleep(interval)
        after = times()
        used = sum(after[pid] - before.get(pid, after[pid]) for pid in after)
        return 100 * used / interval

    def settle(self, *, below: float = 15.0, timeout: float = 30.0) -> None:
        """Wait (bounded) until the server's CPU use drops below ``below`` percent."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.cpu_percent(0.5) < below:
                return


def _rss(process: Any) -> int:
    import psutil

    try:
        return int(process.memory_info().rss)
    except psutil.Error:
        return 0


def database_sockets(pids: Sequence[int], server: ServerParams) -> list[int]:
    """Return how many connections to the PostgreSQL ``server`` each process of ``pids``
    holds, counted from the client's side (its sockets), in one look at each process.

    Over TCP, a connection is a socket whose remote end is the server's port; over a Unix
    socket (the embedded server's), one whose peer (``ss -x`` lists the peers) is a socket
    of the server's ``.s.PGSQL.<port>`` (/proc/PID/fd names each process's sockets).
    """
    import psutil

    port = server.port or 5432
    if not server.host.startswith("/"):
        counts = []
        for pid in pids:
            try:
                found = psutil.Process(pid).net_connections(kind="tcp")
            except psutil.Error:
                found = []
            counts.append(sum(1 for conn in found if conn.raddr and conn.raddr.port == port))
        return counts
    try:
        listing = subprocess.run(
            ["ss", "-x", "-n", "-H"], capture_output=True, text=True, timeout=10, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return [0 for _ in pids]
    listening = os.path.join(server.host, f".s.PGSQL.{port}")
    peer_of: dict[int, int] = {}
    server_ends: set[int] = set()
    for line in listing.splitlines():
        # u_str ESTAB 0 0 <local path or *> <inode> <peer path or *> <peer inode>
        fields = line.split()
        if len(fields) < 8 or not (fields[5].isdigit() and fields[7].isdigit()):
            continue
        local, peer = int(fields[5]), int(fields[7])
        peer_of[local] = peer
        if fields[4] == listening:
            server_ends.add(local)
    return [
        sum(1 for inode in socket_inodes(pid) if peer_of.get(inode) in server_ends) for pid in pids
    ]


def socket_inodes(pid: int) -> set[int]:
    """Return the inodes of the sockets that process ``pid`` has open."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
    return inodes


class Sampler:
    """Sample the server's connections and memory in a thread while a block runs: the
    most any one server process held, and the most all of them held together."""

    def __init__(self, server: Server, interval: float = 0.25) -> None:
        self.server = server
        self.interval = interval
        self.max_open = 0  # all server processes together
        self.max_open_per_process = 0
        self.max_active = 0
        self.max_unattributed = 0
        self.max_rss_mb = 0.0  # serve and everything under it
        self.max_rss_per_process_mb = 0.0
        self.max_processes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> None:
        with contextlib.suppress(psycopg.Error):
            per_process, open_, active = self.server.connections_per_process()
            self.max_open = max(self.max_open, open_)
            # Held by no server process found (serve itself, or one starting or ending).
            self.max_unattributed = max(self.max_unattributed, open_ - sum(per_process))
            self.max_open_per_process = max(self.max_open_per_process, *per_process, 0)
            self.max_active = max(self.max_active, active)
            self.max_processes = max(self.max_processes, len(per_process))
        self.max_rss_mb = max(self.max_rss_mb, self.server.rss_mb())
        self.max_rss_per_process_mb = max(
            self.max_rss_per_process_mb, *self.server.rss_per_process_mb(), 0.0
        )

    def __enter__(self) -> Sampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sample()

    def add_figures(self, result: ScenarioResult, *, rss_target: str = "< 300") -> None:
        """Add the connection and memory figures: per server process against the targets,
        and all processes together beside them."""
        result.add(
            "server database connections per process (max)",
            self.max_open_per_process,
            "",
            "<= 5",
        )
        result.add(
            f"server database connections, {self.max_processes} processes (max)", self.max_open
        )
        result.add(
            "server memory per process (max RSS)", self.max_rss_per_process_mb, "MB", rss_target
        )
        result.add("server memory, serve and all under it (max RSS)", self.max_rss_mb, "MB")


# -- helper processes ---------------------------------------------------------------------


class Helper:
    """A load-generating helper (benchmarks.clients) in its own process, so that
    its CPU is not the server's or the benchmark's. It speaks JSON lines on stdin/stdout."""

    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.clients", *args],
            cwd=CHECKOUT,  # where -m finds benchmarks/: it is not installed
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            preexec_fn=raise_file_limit,
            text=True,
        )

    def read(self, timeout: float) -> dict[str, Any]:
        """Return the helper's next JSON line (bounded by ``timeout``)."""
        import selectors

        assert self.process.stdout is not None
        selector = selectors.DefaultSelector()
        selector.register(self.process.stdout, selectors.EVENT_READ)
        try:
            if not selector.select(timeout):
                raise TimeoutError(f"the helper said nothing in {timeout} s")
        finally:
            selector.close()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the helper exited ({self.process.wait()})")
        return dict(json.loads(line))

    def send(self, message: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(5)


# -- timing -------------------------------------------------------------------------------


def run_threads(count: int, target: Callable[[int], None]) -> float:
    """Run ``target(index)`` in ``count`` threads started together; return the wall time."""
    barrier = threading.Barrier(count + 1)
    errors: list[BaseException] = []

    def body(index: int) -> None:
        try:
            barrier.wait()
            target(index)
        except BaseException as exc:
            errors.append(exc)
        finally:
            from django.db import connection

            connection.close()

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    barrier.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    if errors:
        raise errors[0]
    return elapsed
