"""Fixtures of the fault tests: ``taskboard serve`` processes on the test database, and
agents' tokens."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.factories import TokenFactory, UserFactory
from tests.processes import EmbeddedCluster, ServeProcess, tests_database_url

# The server processes' Django sessions carry this name (libpq's PGAPPNAME; the relay names
# its own "taskboard-relay"), so that a test can terminate them and no other session.
SERVER_APPLICATION_NAME = "taskboard-server"


@pytest.fixture
def start_serve(tmp_path: Path) -> Iterator[Callable[..., ServeProcess]]:
    """Return a function that starts ``taskboard serve ARGS`` on the test database and
    waits until it is healthy (without ``--workers``: as many processes as CPUs, serve's
    default). Every server started is stopped at teardown."""
    servers: list[ServeProcess] = []

    def start(*args: str, **env: str) -> ServeProcess:
        log = tmp_path / f"serve-{len(servers)}.log"
        environment = {
            "DATABASE_URL": tests_database_url(),
            "PGAPPNAME": SERVER_APPLICATION_NAME,
            **env,
        }
        server = ServeProcess(log, *args, env=environment)
        servers.append(server)
        return server.wait_healthy()

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def token_for(fast_password_hashing: None) -> Callable[[str], str]:
    """Return a function that makes a user with an API token and returns the token."""

    def make(username: str) -> str:
        token = TokenFactory.create(user=UserFactory.create(username=username))
        return str(token.key)

    return make


@dataclass
class FreshBoard:
    """A first ``taskboard serve`` on a new data directory (its own embedded PostgreSQL),
    with the secrets it printed."""

    server: ServeProcess
    cluster: EmbeddedCluster
    admin_password: str
    agent_token: str


@pytest.fixture
def fresh_board(tmp_path: Path) -> Iterator[FreshBoard]:
    """Serve a new board on its own embedded PostgreSQL; stop both at teardown."""
    data_dir = tmp_path / "data"
    cluster = EmbeddedCluster(data_dir)
    server = ServeProcess(tmp_path / "fresh-serve.log", data_dir=data_dir, migrate=True)
    try:
        server.wait_healthy(120)
        password = re.search(r"admin\s+password (\S+)", server.output)
        token = re.search(r"demo-agent\s+token\s+(\S+)", server.output)
        assert password and token, server.output
        yield FreshBoard(server, cluster, password[1], token[1])
    finally:
        server.stop()
        # The server stops its PostgreSQL on exit; if it did not, stop
        # it here so that no test leaves one running.
        cluster.stop()
