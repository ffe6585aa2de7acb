"""A migrated database holds exactly the functions and triggers that the files of
``board/sql/schema/`` define, and nothing the files do not declare.

The test database is migrated from scratch. Applying the files again, in a savepoint
rolled back afterwards, must change no definition: so a file that says something else than
the database (a body, a signature, a trigger's event or table) is found, and so is a
function or trigger that the database has and no file declares.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection, transaction

from board.sql.schema import (
    ApplySchema,
    declared_functions,
    declared_triggers,
    digest,
    schema_sql,
)

pytestmark = pytest.mark.django_db

# The project's functions: those of the public schema that no extension installed.
FUNCTIONS = """
    SELECT p.oid::regprocedure::text AS signature, pg_get_functiondef(p.oid) AS definition
    FROM pg_proc p
    WHERE p.pronamespace = 'public'::regnamespace
      AND NOT EXISTS (SELECT 1 FROM pg_depend d
                      WHERE d.classid = 'pg_proc'::regclass AND d.objid = p.oid
                        AND d.deptype = 'e')
"""

# Every trigger that is not PostgreSQL's own (foreign keys'), with the table it is on, or
# task_events for one of its partitions.
TRIGGERS = """
    SELECT c.relname AS relation,
           coalesce(parent.relname, c.relname) AS declared_on,
           t.tgname AS name,
           pg_get_triggerdef(t.oid) AS definition
    FROM pg_trigger t
    JOIN pg_class c ON c.oid = t.tgrelid
    LEFT JOIN pg_inherits i ON i.inhrelid = c.oid
    LEFT JOIN pg_class parent ON parent.oid = i.inhparent
    WHERE NOT t.tgisinternal AND c.relnamespace = 'public'::regnamespace
"""

EVENT_LOG_TRIGGERS = {"task_events_append_only_row", "task_events_append_only_truncate"}


def _rows(sql: str) -> list[dict[str, Any]]:
    with connection.cursor() as cursor:
        cursor.execute(sql)
        names = [column.name for column in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def _definitions() -> dict[str, str]:
    """Every function's and trigger's definition, by what names it."""
    functions = {f"function {r['signature']}": r["definition"] for r in _rows(FUNCTIONS)}
    triggers = {f"trigger {r['name']} on {r['relation']}": r["definition"] for r in _rows(TRIGGERS)}
    return functions | triggers


def _changed_by_applying_the_files() -> dict[str, tuple[str | None, str | None]]:
    """Apply the files in a savepoint, rolled back; return each definition they changed
    (as it was, as the files make it)."""
    before = _definitions()
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(schema_sql())
        after = _definitions()
        transaction.set_rollback(True)
    return {
        key: (before.get(key), after.get(key))
        for key in before.keys() | after.keys()
        if before.get(key) != after.get(key)
    }


def _undeclared() -> set[str]:
    """The functions and triggers of the database that no file declares."""
    functions = {
        f"function {r['signature'].split('(')[0]}"
        for r in _rows(FUNCTIONS)
        if r["signature"].split("(")[0] not in declared_functions()
    }
    triggers = {
        f"trigger {r['name']} on {r['declared_on']}"
        for r in _rows(TRIGGERS)
        if (r["declared_on"], r["name"]) not in declared_triggers()
    }
    return functions | triggers


def test_the_newest_migration_that_applies_the_files_applies_them_as_they_are() -> None:
    """A file changed without a migration that applies it would reach a new database but
    never an existing one."""
    from django.db.migrations.loader import MigrationLoader

    graph = MigrationLoader(None, ignore_no_migrations=True).graph
    applying = {
        key: operation.files_digest
        for key, migration in graph.nodes.items()
        for operation in migration.operations
        if isinstance(operation, ApplySchema)
    }
    newest = [
        key
        for key in applying
        if not any(key in graph.forwards_plan(other) for other in applying if other != key)
    ]
    assert len(newest) == 1, f"several migrations apply board/sql/schema/ last: {newest}"
    assert applying[newest[0]] == digest(), (
        f"board/sql/schema/ changed after {newest[0]} applied it: add a migration whose "
        f'operations end with ApplySchema("{digest()}")'
    )


def test_the_migrated_database_holds_what_the_files_define() -> None:
    assert _changed_by_applying_the_files() == {}


def test_the_database_has_no_function_or_trigger_that_no_file_declares() -> None:
    assert _undeclared() == set()


def test_every_declared_function_and_trigger_is_in_the_database() -> None:
    functions = {r["signature"].split("(")[0] for r in _rows(FUNCTIONS)}
    triggers = {(r["declared_on"], r["name"]) for r in _rows(TRIGGERS)}
    assert declared_functions() - functions == set()
    assert declared_triggers() - triggers == set()


def _event_log_partitions() -> list[str]:
    return [
        r["relname"]
        for r in _rows(
            "SELECT inhrelid::regclass::text AS relname FROM pg_inherits"
            " WHERE inhparent = 'task_events'::regclass"
        )
    ]


def test_every_partition_of_the_event_log_refuses_changes() -> None:
    """Each partition has the parent's row trigger (cloned) and its own TRUNCATE trigger,
    those the migrations made and one made later (as board.transitions and board.ops.archive
    make them)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT task_events_ensure_partition('2099-01-15T00:00:00Z')")
    partitions = _event_log_partitions()
    assert "task_events_2099_01" in partitions
    assert "task_events_default" in partitions
    by_partition: dict[str, set[str]] = {name: set() for name in partitions}
    for row in _rows(TRIGGERS):
        if row["relation"] in by_partition:
            by_partition[row["relation"]].add(row["name"])
    assert by_partition == {name: EVENT_LOG_TRIGGERS for name in partitions}


# The checks above can fail: a database that differs from the files is found.


@pytest.fixture
def savepoint() -> Iterator[None]:
    with transaction.atomic():
        yield
        transaction.set_rollback(True)


@pytest.mark.usefixtures("savepoint")
def test_a_function_body_that_differs_from_its_file_is_found() -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE OR REPLACE FUNCTION task_events_notify() RETURNS trigger"
            " LANGUAGE plpgsql AS $$ BEGIN RETURN NULL; END; $$"
        )
    assert list(_changed_by_applying_the_files()) == ["function task_events_notify()"]


@pytest.mark.usefixtures("savepoint")
def test_a_trigger_that_differs_from_its_file_is_found() -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "DROP TRIGGER credentials_changed ON api_tokens;"
            " CREATE TRIGGER credentials_changed AFTER DELETE ON api_tokens"
            " FOR EACH ROW EXECUTE FUNCTION credentials_changed()"
        )
    assert list(_changed_by_applying_the_files()) == ["trigger credentials_changed on api_tokens"]


@pytest.mark.usefixtures("savepoint")
def test_a_function_or_trigger_that_no_file_declares_is_found() -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE FUNCTION stray() RETURNS trigger LANGUAGE plpgsql"
            " AS $$ BEGIN RETURN NULL; END; $$;"
            " CREATE TRIGGER stray AFTER INSERT ON tasks"
            " FOR EACH STATEMENT EXECUTE FUNCTION stray()"
        )
    assert _undeclared() == {"function stray", "trigger stray on tasks"}
