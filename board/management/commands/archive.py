"""``taskboard archive --before YYYY-MM-01 --to FILE [--force]``: move every event of the
months before that date to FILE (JSON lines, gzip for ``.gz``), verified, then drop those
months from the database (board.ops.archive)."""

from __future__ import annotations

from datetime import date
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from board.ops import archive


def first_of_month(value: str) -> date:
    """Parse ``--before``: a date written YYYY-MM-DD."""
    try:
        return date.fromisoformat(value)
    except ValueError:
        raise CommandError(f"--before {value!r} is not a date (YYYY-MM-01).") from None


class Command(BaseCommand):
    help = (
        "Write every event of the months before --before to --to (JSON lines; gzip when the "
        "name ends in .gz), verify the file, then drop those months' events from the database."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--before", required=True, help="YYYY-MM-01, before this month")
        parser.add_argument("--to", required=True, type=Path, help="the archive file")
        parser.add_argument("--force", action="store_true", help="replace an existing file")

    def handle(self, *args: Any, **options: Any) -> None:
        before = first_of_month(options["before"])
        try:
            done = archive.archive(before=before, to=options["to"], force=options["force"])
        except (
            archive.ArchiveRefused,
            archive.ArchiveFailed,
            archive.DeliveriesPending,
            archive.DropStopped,
        ) as exc:
            raise CommandError(str(exc)) from exc
        except OSError as exc:
            raise CommandError(f"Cannot write the archive: {exc}") from exc
        for month in done.months:
            self.stdout.write(
                f"{month.month:%Y-%m}: {month.events:,} event{'' if month.events == 1 else 's'} "
                f"(sha256 {month.sha256})"
            )
        if not done.months:
            self.stdout.write(
                f"Nothing to archive: no month before {before:%Y-%m} is in the database "
                f"({done.path} holds no event)."
            )
            return
        self.stdout.write(
            f"Archived {done.events:,} event{'' if done.events == 1 else 's'} of "
            f"{len(done.months)} month{'' if len(done.months) == 1 else 's'} to {done.path}; "
            "those months are no longer in the database."
        )
