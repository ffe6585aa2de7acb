"""``taskboard serve`` with its database behind a real PgBouncer in transaction pooling mode,
its relay's LISTEN on a direct connection (DATABASE_LISTEN_URL): agents in parallel
threads, more of them than PgBouncer has server connections, complete every task exactly
once, a waiting claim is woken by a create, and a stream sees every event once, each task's
in order.

Debian's ``pgbouncer`` package (.ci/run installs it); skipped where it is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from django.db import connection

from benchmarks.harness import ServerParams
from board.models import Task, TaskEvent
from taskboard_agent.client import Client
from tests.processes import ServeProcess, StreamFollower, eventually, free_port
from tests.processes import tests_database_url as direct_database_url

pytestmark = [pytest.mark.slow, pytest.mark.once, pytest.mark.django_db(transaction=True)]

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
SERVER_CONNECTIONS = 2
AGENTS = 4
TASKS = 40


def _run_as(host: str) -> str:
    """The unprivileged user PgBouncer runs as (it refuses root): the owner of the
    database's socket directory, who may open the socket in it, or postgres for TCP."""
    if host.startswith("/"):
        return pwd.getpwuid(os.stat(host).st_uid).pw_name
    return "postgres"


@pytest.fixture
def bouncer() -> Iterator[str]:
    """Start PgBouncer (transaction pooling, two server connections) in front of the test
    database; return a DATABASE_URL through it."""
    if not os.path.exists(PGBOUNCER):
        pytest.skip("pgbouncer is not installed (Debian's pgbouncer package)")
    server = ServerParams.from_django()
    name = connection.settings_dict["NAME"]
    # Readable by the user PgBouncer switches to (pytest's tmp_path is not).
    directory = Path(tempfile.mkdtemp(prefix="taskboard-pgbouncer-"))
    directory.chmod(0o755)
    port = free_port()
    target = f"host={server.host} dbname={name} user={server.user}"
    if server.port:
        target += f" port={server.port}"
    if server.password:
        target += f" password={server.password}"
    (directory / "users.txt").write_text(f'"{server.user}" ""\n')
    (directory / "pgbouncer.ini").write_text(
        f"""[databases]
board = {target}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {directory}/users.txt
admin_users = {server.user}
pool_mode = transaction
default_pool_size = {SERVER_CONNECTIONS}
max_client_conn = 200
"""
    )
    for path in directory.iterdir():
        path.chmod(0o644)
    command = [PGBOUNCER, str(directory / "pgbouncer.ini")]
    if os.geteuid() == 0:
        command[1:1] = ["-u", _run_as(server.host)]
    log = (directory / "pgbouncer.log").open("wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:

        def listening() -> bool:
            assert process.poll() is None, (directory / "pgbouncer.log").read_text()
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                return True
            return False

        eventually(listening, timeout=10, what="PgBouncer listening")
        yield f"postgresql://{server.user}@127.0.0.1:{port}/board"
    finally:
        process.terminate()
        process.wait(10)
        log.close()
        shutil.rmtree(directory, ignore_errors=True)


def _admin(url: str, command: str) -> list[dict[str, object]]:
    """Run a command on PgBouncer's admin console (``SHOW POOLS``, ...)."""
    admin = url.rsplit("/", 1)[0] + "/pgbouncer"
    with psycopg.connect(admin, autocommit=True, prepare_threshold=None) as conn:
        cur = conn.execute(command)
        names = [column.name for column in cur.description or []]
        return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


def test_the_board_through_pgbouncer_in_transaction_mode_with_a_direct_listen(
    bouncer: str,
    start_serve: Callable[..., ServeProcess],
    token_for: Callable[[str], str],
) -> None:
    server = start_serve(
        DATABASE_URL=bouncer,
        DATABASE_LISTEN_URL=direct_database_url(),
        TASKBOARD_THREADS=str(AGENTS),
    )
    planner = Client(server.url, token_for("planner"))
    follower = StreamFollower(server.url, token_for("watcher")).start()
    tokens = [token_for(f"agent-{n}") for n in range(AGENTS)]

    # A claim that waits on an empty queue is woken by the create that the relay hears
    # (its LISTEN goes around PgBouncer).
    waited: list[float] = []

    def wait_for_work() -> None:
        with Client(server.url, tokens[0]) as client:
            started = time.monotonic()
            claimed = client.claim(queues=["later"], wait=20)
            assert claimed, "the waiting claim was not woken"
            client.complete(claimed[0], result="waited")
            waited.append(time.monotonic() - started)

    waiter = threading.Thread(target=wait_for_work)
    waiter.start()
    time.sleep(1)
    planner.create("wake up", queue="later")
    waiter.join(25)
    assert waited and waited[0] < 10

    for n in range(TASKS):
        planner.create(f"task {n}", queue="busy")
    done: list[int] = []
    errors: list[BaseException] = []

    def agent(token: str) -> None:
        try:
            with Client(server.url, token) as client:
                while claimed := client.claim(queues=["busy"], lease_seconds=30):
                    task = claimed[0]
                    client.heartbeat(task, progress={"half": True})
                    client.complete(task, result={"by": token[:6]})
                    done.append(task.id)
        except BaseException as exc:
            errors.append(exc)

    crew = [threading.Thread(target=agent, args=(token,)) for token in tokens]
    for thread in crew:
        thread.start()
    for thread in crew:
        thread.join(60)
    assert not errors, errors
    assert len(done) == len(set(done)) == TASKS

    assert Task.objects.filter(status="done").count() == TASKS + 1
    assert TaskEvent.objects.filter(type="completed").count() == TASKS + 1
    events = dict(TaskEvent.objects.values_list("id", "task_id"))
    every = sorted(events)
    eventually(lambda: len(follower.ids) >= len(every), timeout=10, what="the stream's every event")
    follower.close()
    # Every event once (the stream's order is commit order, which concurrent transactions
    # need not commit in id order), and each task's events in order.
    assert sorted(follower.ids) == every
    for task_id in set(events.values()):
        mine = [event_id for event_id in follower.ids if events[event_id] == task_id]
        assert mine == sorted(mine)

    # It all went through PgBouncer's pool, in transaction mode, on at most two server
    # connections.
    pools = [pool for pool in _admin(bouncer, "SHOW POOLS") if pool["database"] == "board"]
    assert [pool["pool_mode"] for pool in pools] == ["transaction"]
    servers = [row for row in _admin(bouncer, "SHOW SERVERS") if row["database"] == "board"]
    assert 0 < len(servers) <= SERVER_CONNECTIONS
    stats = next(row for row in _admin(bouncer, "SHOW STATS") if row["database"] == "board")
    assert int(str(stats["total_xact_count"])) > TASKS * 3


def test_a_relay_through_pgbouncer_never_ends_the_server_connections_it_leaves(
    bouncer: str,
) -> None:
    """A relay that connects again ends its earlier sessions that the database still has
    (board.live.relay, for a session dropped silently on the way). Through a pooler, the
    server connection a relay's session ran on is lent on to other clients when it leaves:
    ending it would cut off someone else, or the relay's own new session. None is recorded
    there (the server's pid is not the one the connection announced)."""
    from board.live.relay import Relay

    async def connect_twice() -> int | None:
        relay = Relay(psycopg.conninfo.make_conninfo(bouncer))
        await relay.start()
        first = relay.backend_pid
        await relay.stop()
        await relay.start()
        await asyncio.sleep(0.5)  # an ended backend is gone by now
        await relay.stop()
        return first

    server_connection = asyncio.run(connect_twice())
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [server_connection])
        assert cursor.fetchone()[0] == 1, "a server connection of PgBouncer's pool was ended"
