"""The ``taskboard`` command: Django's management commands, run from any directory.

``taskboard serve`` is ``python manage.py serve``, ``taskboard create_agent NAME`` is
``python manage.py create_agent NAME``, and so on.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "taskboard.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(["taskboard", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
