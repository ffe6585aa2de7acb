from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.management.color import Style
from django.db import connection
from rest_framework.test import APIClient

from board.models import Task
from tests.factories import StaffFactory, TaskFactory, TokenFactory, UserFactory


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (pyproject's addopts): two workers a core. Much of the suite's time is
    spent waiting on real servers, processes and leases rather than on the CPU: on a 2-core
    machine the whole suite took 1,119 s on one worker (PostgreSQL 15, without the browser
    and Pushpin tests) and 596 s on four (embedded PostgreSQL, all of it)."""
    return 2 * (os.cpu_count() or 1)


# What puts a test in the server tier: a committed database that other connections see, or
# a server of its own.
SERVER_FIXTURES = frozenset(
    {
        "transactional_db",
        "live_server",
        "server",
        "module_server",
        "start_serve",
        "browser",
        "page",
        "person",
    }
)


def tier(item: pytest.Item) -> str:
    """The tier of a test: ``fault`` (tests/faults/: faults caused on real processes),
    ``server`` (a real server, processes, or a committed database; and whatever is marked
    ``slow`` or ``once``), or ``unit`` (a transaction rolled back, in the test process)."""
    if "faults" in item.path.parts:
        return "fault"
    if (
        item.get_closest_marker("slow")
        or item.get_closest_marker("once")
        or SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ()))
        or any(m.kwargs.get("transaction") for m in item.iter_markers("django_db"))
    ):
        return "server"
    return "unit"


# Seconds that each test of a second or more took in a run of the whole suite (junit XML:
# `pytest --junitxml`), for the order below. Stale figures only make the order worse.
DURATIONS = Path(__file__).with_name("durations.json")


def database_rank(item: pytest.Item) -> int:
    """0 for a test whose transaction is rolled back, 1 for the rest. pytest-django runs
    the first kind first, as Django does: a transactional test's flush empties the rows
    that migrations seed, and a test's own server or processes commit what they write.
    Among the rest the order does not matter (a transactional test's flush runs after it)."""
    marker = item.get_closest_marker("django_db")
    fixtures = getattr(item, "fixturenames", ())
    if (marker and (marker.kwargs.get("transaction") or marker.kwargs.get("reset_sequences"))) or (
        "transactional_db" in fixtures or "live_server" in fixtures
    ):
        return 1
    return 0 if marker or "db" in fixtures else 1


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with its tier (``pytest -m unit`` runs the fast tier alone), and run
    the longest tests first within the order of :func:`database_rank`, so that
    xdist's workers end together instead of one finishing a fault test alone at the end
    (longest processing time first). A test not in DURATIONS counts by its marks: ``once``
    (faults, the browser, scale), ``slow``, or neither. xdist has no such scheduling of its
    own: it hands tests out in collection order, and ``--dist load`` in chunks, with which
    the first worker took the longest quarter of the suite at once; ``--dist loadgroup``
    (pyproject's addopts) hands them out one at a time (one group at a time, for tests
    marked with an ``xdist_group``)."""
    seconds: dict[str, float] = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}

    def own(item: pytest.Item) -> float:
        if item.nodeid in seconds:
            return seconds[item.nodeid]
        if item.get_closest_marker("once"):
            return 5.0
        return 2.0 if item.get_closest_marker("slow") else 0.1

    # The tests of a module that share its server (module_server) run one after the other
    # on one worker, as a block as long as all of them: otherwise the order above would
    # mix them with others' and each would start the module's server again.
    blocks: dict[str, float] = {}
    for item in items:
        item.add_marker(tier(item))
        if "module_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group(item.path.name))
            blocks[item.path.name] = blocks.get(item.path.name, 0.0) + own(item)

    def expected(item: pytest.Item) -> tuple[int, float, str, float]:
        block = item.path.name if "module_server" in getattr(item, "fixturenames", ()) else ""
        if block:
            return database_rank(item), -blocks[block], block, -own(item)
        return database_rank(item), -own(item), block, 0.0

    items.sort(key=expected)


def _event_log_triggers(action: str) -> str:
    """A statement that runs ``ALTER TABLE ... {action} TRIGGER USER`` on task_events and
    on each of its partitions."""
    return f"""
        DO $$
        DECLARE
            log regclass;
        BEGIN
            FOR log IN
                SELECT 'task_events'::regclass
                UNION ALL
                SELECT inhrelid::regclass FROM pg_inherits
                WHERE inhparent = 'task_events'::regclass
            LOOP
                EXECUTE format('ALTER TABLE %s {action} TRIGGER USER', log);
            END LOOP;
        END;
        $$;
    """


@pytest.fixture(autouse=True, scope="session")
def _flush_past_the_append_only_trigger() -> Iterator[None]:
    """Let transactional tests' teardown empty task_events.

    Django's ``flush`` (run after every ``transaction=True`` test) TRUNCATEs all tables,
    which the append-only trigger refuses, as it should in production. Tests only: wrap the
    flush so the owner disables the table's triggers for that one TRUNCATE: the parent's
    (which reaches the row triggers PostgreSQL cloned onto the partitions) and each
    partition's own TRUNCATE trigger (board/sql/schema/event_log.sql).
    """
    original = connection.ops.sql_flush

    def sql_flush(
        style: Style,
        tables: Sequence[str],
        *,
        reset_sequences: bool = False,
        allow_cascade: bool = False,
    ) -> list[str]:
        statements = original(
            style, tables, reset_sequences=reset_sequences, allow_cascade=allow_cascade
        )
        if "task_events" not in tables:
            return statements
        return [_event_log_triggers("DISABLE"), *statements, _event_log_triggers("ENABLE")]

    connection.ops.sql_flush = sql_flush  # type: ignore[method-assign]
    yield
    connection.ops.sql_flush = original  # type: ignore[method-assign]


@pytest.fixture
def agent(db: None) -> User:
    return UserFactory.create(username="agent-smith")


@pytest.fixture
def other_agent(db: None) -> User:
    return UserFactory.create(username="agent-jones")


@pytest.fixture
def staff(db: None) -> User:
    return StaffFactory.create(username="ops-alice")


@pytest.fixture
def make_task(db: None, agent: User) -> Callable[..., Task]:
    def make(**kwargs: Any) -> Task:
        kwargs.setdefault("created_by", agent)
        return TaskFactory.create(**kwargs)

    return make


@pytest.fixture
def api() -> Callable[[User | None], APIClient]:
    """Return a client authenticated as the given user with a Bearer token."""

    def client_for(user: User | None) -> APIClient:
        client = APIClient()
        if user is not None:
            token = TokenFactory.create(user=user)
            client.credentials(HTTP_AUTHORIZATION=f"Bearer {token.key}")
        return client

    return client_for


@pytest.fixture
def agent_api(api: Callable[[User | None], APIClient], agent: User) -> APIClient:
    """The API as the agent ``agent``."""
    return api(agent)


# Fixtures for tests that need a PostgreSQL connection of their own, beside Django's: a
# second session that holds a lock, or one that LISTENs for notifications.


@pytest.fixture
def open_raw_connection() -> Iterator[Callable[..., Any]]:
    """Return a function that opens a psycopg connection to the test database.

    The parameters are read from Django's connection when the function is called, so they
    name the test database (and, on the embedded engine, its unix socket). Every connection
    opened is closed at teardown.
    """
    import psycopg  # only these tests need the driver itself

    from board.live.relay import django_conninfo

    opened: list[psycopg.Connection[Any]] = []

    def open_connection(*, autocommit: bool = False) -> psycopg.Connection[Any]:
        raw = psycopg.connect(django_conninfo("taskboard-tests"), autocommit=autocommit)
        opened.append(raw)
        return raw

    yield open_connection
    for raw in opened:
        raw.close()


@pytest.fixture(autouse=True)
def fast_password_hashing(settings: Any) -> None:
    """Hash the factories' passwords with a cheap hasher (PBKDF2 costs ~0.5 s a user)."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture(autouse=True)
def _forget_cached_tokens() -> None:
    """Each test starts with an empty token cache (board.api.authentication)."""
    from board.api import authentication

    authentication._token_cache.clear()


@pytest.fixture
def server() -> Iterator[Any]:
    """A real uvicorn serving the ASGI application on the test database (tests/live.py)."""
    from tests.live import live_server

    with live_server() as running:
        yield running


@pytest.fixture(scope="module")
def module_server(django_db_setup: None, django_db_blocker: Any) -> Iterator[Any]:
    """One :func:`server` for the tests of a module that talk to it only through the API,
    each with users and tasks of its own, and that neither stop it nor need it started
    anew (a module's own ``server`` fixture returns this one). Its tests run as a block
    (:func:`pytest_collection_modifyitems`); they must be ``transaction=True``, so that the
    server sees what they commit, and they leave nothing open on it, since their flush
    runs while it serves. Database access stays allowed while it runs: its threads (the
    lifespan's sender, the relay) reach the database between tests too."""
    from tests.live import live_server

    with django_db_blocker.unblock(), live_server() as running:
        yield running


# The browser's fixtures (tests/browser.py): browser, new_page, page, person.
from tests.browser import browser, new_page, page, person  # noqa: E402, F401
