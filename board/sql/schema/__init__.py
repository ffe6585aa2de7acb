"""The database's functions and triggers as they are now, one ``.sql`` file per concern.

Every PL/pgSQL function the board relies on, and every trigger that calls one, is defined
here, and only here: what a statement of ``board/sql/transitions.sql`` also does (the
event log's append-only guard and partitions, the counters, the NOTIFY of new events, the
delivery rows, the announcement of changed credentials) can be read next to it.

- ``event_log.sql``: the append-only guard and the partitions of task_events;
- ``counters.sql``: queue, agent and event counters;
- ``notify.sql``: the NOTIFY of new events for the relays;
- ``deliveries.sql``: the webhook and email delivery rows;
- ``credentials.sql``: the announcement of changed credentials.

Each file can be applied again at any time and leaves exactly its definitions: functions
with ``CREATE OR REPLACE FUNCTION``, triggers with ``DROP TRIGGER IF EXISTS`` then
``CREATE TRIGGER``. Migrations apply the files with :class:`ApplySchema`, and
``tests/test_schema_sql.py`` checks that a migrated database holds exactly what they define.

The rule for a change: edit the file, then add a migration whose operations end with
``ApplySchema("<digest>")`` (after whatever it changes in tables), the digest being
:func:`digest` of the files as edited (the test names it). Never edit an old migration's
SQL. The test fails while the newest ``ApplySchema`` names another digest: the files then
say something that no migration puts into existing databases. A migration from scratch
reads today's files, so only the last pending ``ApplySchema`` applies them (earlier ones do
nothing then): the files may rely on every table that the migrations create. A function
that is no longer wanted is dropped by the migration that removes it from its file
(``DROP FUNCTION``, before ``ApplySchema``).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

from django.db import migrations

FILES: tuple[str, ...] = (
    "event_log.sql",
    "counters.sql",
    "notify.sql",
    "deliveries.sql",
    "credentials.sql",
)

_FUNCTION = re.compile(r"^CREATE OR REPLACE FUNCTION (\w+)\(", re.MULTILINE)
_TRIGGER = re.compile(r"^CREATE TRIGGER (\w+)\s.*?\sON (\w+)\s", re.MULTILINE | re.DOTALL)


def schema_sql() -> str:
    """Return the text of every file, in the order that applies them."""
    directory = Path(__file__).parent
    return "\n".join((directory / name).read_text() for name in FILES)


def digest() -> str:
    """Return a digest of the files' statements, which the migration that applies them names.

    Lines that are comments from their first column are left out: they stand outside every
    function's body (whose lines are indented), so editing them changes nothing that a
    database holds and needs no migration.
    """
    statements = "\n".join(line for line in schema_sql().splitlines() if not line.startswith("--"))
    return hashlib.sha256(statements.encode()).hexdigest()[:16]


def declared_functions() -> set[str]:
    """Return the names of the functions the files define."""
    return set(_FUNCTION.findall(schema_sql()))


def declared_triggers() -> set[tuple[str, str]]:
    """Return the (table, trigger) pairs the files create on named tables.

    The TRUNCATE trigger that each partition of task_events gets (by a loop in
    ``event_log.sql`` and by ``task_events_create_partition``) is declared as the parent's.
    """
    return {(table, name) for name, table in _TRIGGER.findall(schema_sql())}


# Taken first, tasks then task_events (the order of a transition's statement), so that a
# transition running meanwhile waits for the migration instead of deadlocking with it:
# DROP TRIGGER takes each table's ACCESS EXCLUSIVE lock.
_LOCK = "LOCK TABLE tasks, task_events IN ACCESS EXCLUSIVE MODE;"


def _later_application_pending(connection: Any) -> bool:
    """Return whether more than one unapplied migration applies the files: this one and a
    later one, which will apply them when every table they rely on exists."""
    from django.db.migrations.loader import MigrationLoader

    loader = MigrationLoader(connection, ignore_no_migrations=True)
    pending = [
        key
        for key, migration in loader.disk_migrations.items()
        if key not in loader.applied_migrations
        and any(isinstance(operation, ApplySchema) for operation in migration.operations)
    ]
    return len(pending) > 1


class ApplySchema(migrations.operations.base.Operation):
    """Apply the files of ``board/sql/schema/`` as they are now.

    ``files_digest`` is :func:`digest` of the files this migration was written for: it is
    what tells a test that the files changed after the newest migration that applies them.

    Going back does nothing: the definitions the files replaced did the same, or the
    migration that changed them says how to undo it.
    """

    reversible = True
    reduces_to_sql = False

    def __init__(self, files_digest: str) -> None:
        self.files_digest = files_digest

    def deconstruct(self) -> tuple[str, list[Any], dict[str, Any]]:
        return (self.__class__.__name__, [self.files_digest], {})

    def state_forwards(self, app_label: str, state: Any) -> None:
        pass

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        if _later_application_pending(schema_editor.connection):
            return
        schema_editor.execute(_LOCK)
        schema_editor.execute(schema_sql(), params=None)

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        pass

    def describe(self) -> str:
        return "Apply the functions and triggers of board/sql/schema/"
