"""``taskboard configuration``: every setting of the board as a Markdown table (board.conf),
the table of the documentation's settings page."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from board import conf


class Command(BaseCommand):
    help = (
        "Print every setting of the board (its environment variable, type, default, range "
        "and meaning) as a Markdown table."
    )
    requires_system_checks: list[str] = []

    def handle(self, *args: Any, **options: Any) -> None:
        self.stdout.write(conf.markdown_table(), ending="")
