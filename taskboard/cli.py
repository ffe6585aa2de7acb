"""The ``taskboard`` command.

``taskboard work``, ``taskboard submit``, ``taskboard tasks`` and ``taskboard mcp`` are the
agent side: they talk to a running server over HTTP (taskboard.console,
taskboard.mcp_server) and never import Django. Anything
else is one of Django's management commands, run from any directory: ``taskboard serve``
is ``python manage.py serve``, ``taskboard create_agent NAME`` is ``python manage.py
create_agent NAME``, and so on.
"""

from __future__ import annotations

import os
import sys

CLIENT_COMMANDS = ("work", "submit", "tasks")
HELP = ("-h", "--help", "help")


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["help"] and args[1:2] and args[1] in CLIENT_COMMANDS:
        args = [args[1], "--help"]
    if args[:1] == ["mcp"]:
        from taskboard import mcp_server

        sys.exit(mcp_server.main(args[1:]))
    if args[:1] and args[0] in CLIENT_COMMANDS:
        from taskboard import console

        sys.exit(console.main(args))
    if not args or (len(args) == 1 and args[0] in HELP):
        from taskboard import console

        print("usage: taskboard COMMAND [ARGS]\n")
        print(console.SUMMARY)
        print("Server commands (Django's manage.py, on the server's machine and database):")

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "taskboard.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(["taskboard", *args])


if __name__ == "__main__":
    main()
