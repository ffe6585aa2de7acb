"""The repository's own tools that the server's commands run from a checkout.

The benchmark and the soak (benchmarks/, beside this package in a checkout) do not ship in
the server's wheel: ``taskboard benchmark`` and ``taskboard soak`` find them next to the
package when the server is installed from a checkout (``pip install -e .``), or already
imported when run as ``python -m benchmarks``, and from any other install say in one line
where to run them.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any, NoReturn

from django.core.management.base import BaseCommand

# The checkout this package sits in, when it is one (an editable install).
CHECKOUT = Path(__file__).resolve().parent.parent
NOT_A_CHECKOUT = (
    "the benchmark is a tool of the repository and does not ship with the installed server: "
    "run it from a checkout (pip install -e ./agent -e '.[bench]' there, then taskboard "
    "{command} or python -m benchmarks{soak})"
)


def benchmarks_command(name: str) -> type[BaseCommand]:
    """Return the command class ``name`` of benchmarks.commands, from the checkout; else a
    command that says where to run it."""
    if "benchmarks" not in sys.modules:
        if not (CHECKOUT / "benchmarks" / "commands.py").is_file():
            return NotACheckout
        if str(CHECKOUT) not in sys.path:
            sys.path.insert(0, str(CHECKOUT))
    command: type[BaseCommand] = getattr(importlib.import_module("benchmarks.commands"), name)
    return command


class NotACheckout(BaseCommand):
    help = "Run from a checkout of the repository (benchmarks/ is not installed)."

    def run_from_argv(self, argv: list[str]) -> NoReturn:
        command = argv[1] if len(argv) > 1 else "benchmark"
        soak = " soak" if command == "soak" else ""
        message = NOT_A_CHECKOUT.format(command=command, soak=soak)
        self.stderr.write(f"taskboard {command}: {message}")
        sys.exit(2)

    def handle(self, *args: Any, **options: Any) -> None:  # pragma: no cover (see above)
        raise NotImplementedError
