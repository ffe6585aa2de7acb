#!/usr/bin/env python
"""Django's command-line utility for administrative tasks."""

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "taskboard.settings")
    from taskboard.commands import server_command

    server_command(sys.argv, prog="python manage.py")


if __name__ == "__main__":
    main()
