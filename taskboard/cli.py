"""The ``taskboard`` command.

``taskboard work``, ``taskboard submit``, ``taskboard tasks`` and ``taskboard mcp`` are the
agent side: they talk to a running server over HTTP (taskboard.console,
taskboard.mcp_server) and never import Django. Anything
else is one of Django's management commands, run from any directory: ``taskboard serve``
is ``python manage.py serve``, ``taskboard create_agent NAME`` is ``python manage.py
create_agent NAME``, and so on.

The agent's install (the ``taskboard-agent`` distribution, ``agent/``) ships only this
module, the client and the agent commands: there, anything else is refused in one line.
"""

from __future__ import annotations

import importlib.util
import os
import sys

CLIENT_COMMANDS = ("work", "submit", "tasks")
HELP = ("-h", "--help", "help")
AGENT_INSTALL = (
    "this install has only the agent's side (taskboard-agent: work, submit, tasks, mcp); "
    "server commands need the server's install: pip install -e . in a checkout (see the "
    "README's Two commands)"
)


def server_installed() -> bool:
    """Return whether the server's side is here (its settings and Django), not only the
    agent's."""
    return all(importlib.util.find_spec(name) for name in ("taskboard.settings", "django"))


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["help"] and args[1:2] and args[1] in (*CLIENT_COMMANDS, "mcp"):
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
        if not server_installed():
            print(f"No server commands: {AGENT_INSTALL}.")
            sys.exit(0)
        print("Server commands (Django's manage.py, on the server's machine and database):")
    if not server_installed():
        print(f"taskboard {args[0]}: not an agent command, and {AGENT_INSTALL}.", file=sys.stderr)
        sys.exit(2)

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "taskboard.settings")
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import execute_from_command_line

    try:
        execute_from_command_line(["taskboard", *args])
    except ImproperlyConfigured as exc:  # a setting from the environment: one line, not a trace
        print(f"taskboard: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
