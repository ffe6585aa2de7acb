"""The ``taskboard`` command.

``taskboard work``, ``taskboard submit``, ``taskboard tasks`` and ``taskboard mcp`` are the
agent side: they talk to a running server over HTTP (taskboard_agent.console,
taskboard_agent.mcp_server) and never import Django.

Any other command belongs to whatever registered in the ``taskboard.commands`` entry-point
group: the server's distribution (``taskboard``) registers its commands there (Django's
management commands: ``taskboard serve``, ``taskboard createsuperuser`` and so on), so they
exist exactly where the server is installed. Each entry point names a callable that takes
the arguments (the command first) and runs them, printing its own listing for ``help``. An
install of this distribution alone has none: a server command is refused there in one line.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from importlib.metadata import entry_points

CLIENT_COMMANDS = ("work", "submit", "tasks")
HELP = ("-h", "--help", "help")
GROUP = "taskboard.commands"
AGENT_INSTALL = (
    "this install has only the agent's side (taskboard-agent: work, submit, tasks, mcp); "
    "server commands need the server's install: pip install -e . in a checkout (see the "
    "README's Two commands)"
)


def server_commands() -> Callable[[list[str]], None] | None:
    """Return the runner of the server's commands, when a distribution registered one in
    ``taskboard.commands`` (the first by name, should there be several), else None."""
    found = sorted(entry_points(group=GROUP), key=lambda entry: entry.name)
    if not found:
        return None
    runner: Callable[[list[str]], None] = found[0].load()
    return runner


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["help"] and args[1:2] and args[1] in (*CLIENT_COMMANDS, "mcp"):
        args = [args[1], "--help"]
    if args[:1] == ["mcp"]:
        from taskboard_agent import mcp_server

        sys.exit(mcp_server.main(args[1:]))
    if args[:1] and args[0] in CLIENT_COMMANDS:
        from taskboard_agent import console

        sys.exit(console.main(args))
    server = server_commands()
    if not args or (len(args) == 1 and args[0] in HELP):
        from taskboard_agent import console

        print("usage: taskboard COMMAND [ARGS]\n")
        print(console.SUMMARY)
        if server is None:
            print(f"No server commands: {AGENT_INSTALL}.")
            sys.exit(0)
        print("Server commands (Django's manage.py, on the server's machine and database):")
    if server is None:
        print(f"taskboard {args[0]}: not an agent command, and {AGENT_INSTALL}.", file=sys.stderr)
        sys.exit(2)
    server(args)


if __name__ == "__main__":
    main()
