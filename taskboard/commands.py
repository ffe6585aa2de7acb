"""The server's commands of ``taskboard``: Django's management commands, run from any
directory. ``taskboard serve`` is ``python manage.py serve``, ``taskboard create_agent NAME``
is ``python manage.py create_agent NAME``, and so on.

The ``taskboard`` command itself is the agent's (taskboard_agent.cli): it runs ``work``,
``submit``, ``tasks`` and ``mcp``, and hands any other command to :func:`main`, which this
distribution registers in the ``taskboard.commands`` entry-point group (pyproject.toml), so
that the server's commands exist only where the server is installed.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

HELP = ("-h", "--help", "help")
VERSION = ("--version", "version")


def main(args: list[str] | None = None) -> None:
    """Run the server's command ``args`` (the command first; Django's listing without one)."""
    server_command(["taskboard", *(sys.argv[1:] if args is None else args)])


def server_command(argv: list[str], prog: str = "taskboard") -> None:
    """Run Django's management command ``argv[1:]`` (``argv[0]`` is the program), saying in
    one line, not a traceback, what keeps it from running: a setting, a database that is
    not there or not migrated."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "taskboard.settings")
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import execute_from_command_line
    from django.db import DatabaseError

    from taskboard.embedded import serving

    command = argv[1] if len(argv) > 1 else "help"
    asks_help = any(arg in HELP[:2] for arg in argv[2:])
    serving.only_existing = not asks_help and command not in (*MAKE_A_DATABASE, *HELP, *VERSION)
    try:
        from django.conf import settings

        settings.INSTALLED_APPS  # noqa: B018 (read the settings now: their errors are said below)
        if serving.found is not None:
            print(
                f"{prog} {command}: no database here; using the one `taskboard serve` runs "
                f"on, in {serving.found}",
                file=sys.stderr,
            )
        if (
            not asks_help
            and checks_migrations(command)
            and (unapplied := unapplied_migrations(fresh=True))
        ):
            not_migrated(prog, command, unapplied)
        execute_from_command_line(argv)
    except ImproperlyConfigured as exc:  # a setting from the environment: one line, not a trace
        print(f"{prog}: {exc}", file=sys.stderr)
        sys.exit(2)
    except serving.NoDatabase as exc:
        print(f"{prog} {command}: {exc}", file=sys.stderr)
        sys.exit(2)
    except DatabaseError as exc:
        if not missing_schema(exc) or not (unapplied := unapplied_migrations()):
            raise
        not_migrated(prog, command, unapplied)


# The server commands that may make the embedded database where there is none; any other
# refuses, rather than fail on the empty database it made (taskboard.embedded.serving).
MAKE_A_DATABASE = ("serve", "migrate", "benchmark", "soak", "test")


def checks_migrations(command: str) -> bool:
    """Return whether Django checks the migrations before ``command`` (createsuperuser,
    changepassword): it prints a notice of several lines and runs on."""
    import django
    from django.core.management import get_commands, load_command_class

    django.setup()
    app = get_commands().get(command)
    if app is None:
        return False
    return bool(load_command_class(app, command).requires_migrations_checks)


def missing_schema(error: Exception) -> bool:
    """Return whether ``error`` is about a table or column that the migrations make."""
    import psycopg

    missing = psycopg.errors.UndefinedTable | psycopg.errors.UndefinedColumn
    return isinstance(error.__cause__, missing)


def unapplied_migrations(*, fresh: bool = False) -> int:
    """Return how many migrations the database lacks; with ``fresh``, only when it has
    none applied (a database never migrated: 0 otherwise)."""
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    connection.close()  # a failed statement may have left its transaction aborted
    executor = MigrationExecutor(connection)
    if fresh and executor.recorder.has_table():
        return 0
    return len(executor.migration_plan(executor.loader.graph.leaf_nodes()))


def not_migrated(prog: str, command: str, unapplied: int) -> NoReturn:
    from taskboard.management.commands.serve import database_description

    print(
        f"{prog} {command}: the database ({database_description()}) is not migrated "
        f"({unapplied} migrations not applied): run `{prog} migrate` first (`{prog} serve` "
        "migrates too)",
        file=sys.stderr,
    )
    sys.exit(2)


if __name__ == "__main__":
    main()
