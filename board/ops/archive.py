"""Archive whole months of the event log to a file, then drop them (``taskboard archive``).

The one way an event ever leaves the database (contract: "Archiving the log"). For every
month before the boundary, oldest first:

1. export: every event of the month, in id order, one JSON line each: the event as the
   API renders it (``EventSerializer``) plus its ``txid``, which a restore needs to put
   the row back exactly (the stream's cursor is (txid, id)). The file is written as
   ``FILE.partial`` (gzip when FILE ends in ``.gz``);
2. verify: the file is read back and, month by month, its events' count, the sum of their
   ids and a SHA-256 of their lines (in a canonical JSON form) must equal those of the rows
   read from the database;
3. drop: each month's partition is detached, checked again under task_events' lock (count
   and id sum, so an event that arrived in the month after the export stops it), and
   dropped, in one transaction per month (board.partitions.drop). Per
   month, not all at once: the lock that holds back every new event is held for one
   month's check and drop at a time, and a failure leaves every month before it archived
   and dropped, the failing one and those after it in place;
4. keep: only then is the file given its name FILE, holding exactly the months that left
   the database. When a drop fails, FILE holds the months dropped before it (rewritten
   from ``FILE.partial`` without the others), or is not made at all when none was: a
   file under its final name never holds events still in the database, so archiving
   those again later never puts an event in two files (which would double a restore).

Events that the DEFAULT partition holds before the boundary are first moved into their
months' partitions. Tasks are not touched: their history in the API starts at the boundary.

Deliveries still pending (contract: "Every matching event is delivered at least once")
hold the archive back: a delivery whose event has left the log has nothing to send. Before
anything is written, any pending delivery of an event before the boundary refuses the
archive (DeliveriesPending); each month's drop checks again for its own events, in its
transaction, under the locks that the drop takes (board.partitions.drop).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from pathlib import Path
from typing import IO, Any

import psycopg
from django.db import OperationalError, connection
from django.db.models.expressions import RawSQL

from board import exceptions, partitions
from board.api.serializers import EventSerializer
from board.models import TaskEvent, Webhook, WebhookKind
from board.sql import QUERIES

CHUNK = 5_000


class ArchiveRefused(Exception):
    """The archive was not started: a bad boundary or an existing file."""


class ArchiveFailed(Exception):
    """The file did not verify; nothing was dropped."""


class DeliveriesPending(Exception):
    """Deliveries of events to archive are still pending: nothing was written or dropped."""


class DropStopped(Exception):
    """A month could not be dropped; the months before it were, and only they are in the
    file (none: no file)."""


@dataclass
class Tally:
    """What a month's events add up to, from the database or from the file."""

    count: int = 0
    id_sum: int = 0
    digest: Any = field(default_factory=hashlib.sha256, compare=False)

    def add(self, line: dict[str, Any]) -> None:
        self.count += 1
        self.id_sum += int(line["id"])
        self.digest.update(_canonical(line))

    @property
    def sha256(self) -> str:
        return str(self.digest.hexdigest())


@dataclass(frozen=True)
class MonthArchived:
    month: date
    events: int
    sha256: str


@dataclass(frozen=True)
class Archived:
    path: Path
    months: list[MonthArchived]

    @property
    def events(self) -> int:
        return sum(month.events for month in self.months)


def _canonical(line: dict[str, Any]) -> bytes:
    return json.dumps(line, sort_keys=True, separators=(",", ":")).encode() + b"\n"


def check_boundary(before: date) -> datetime:
    """Return the boundary as a UTC time, or refuse one that is not the first of a month.

    Any month may be archived, the current one too (then its events so far go to the file
    and its partition is dropped; later events of the month land in the DEFAULT partition,
    which a later archive splits). A month still being written may gain an event between
    the export and the drop: the re-check under the partition's lock then refuses to drop
    it (ArchiveMismatch), and nothing of that month is lost.
    """
    if before.day != 1:
        raise ArchiveRefused(f"--before {before.isoformat()} is not the first day of a month.")
    return datetime(before.year, before.month, 1, tzinfo=UTC)


def _months_before(boundary: datetime) -> list[datetime]:
    with connection.cursor() as cursor:
        cursor.execute(QUERIES["event_partitions"])
        names = [row[0] for row in cursor.fetchall()]
    months = [
        datetime.strptime(name.removeprefix("task_events_"), "%Y_%m").replace(tzinfo=UTC)
        for name in names
    ]
    return [month for month in months if month < boundary]


def _pending_deliveries(query: str, params: dict[str, Any]) -> dict[int, int]:
    """Return the pending deliveries that ``query`` (archive.sql) finds, by webhook id."""
    with connection.cursor() as cursor:
        cursor.execute(QUERIES[query], params)
        return {int(webhook_id): int(count) for webhook_id, count in cursor.fetchall()}


def _how_many(pending: dict[int, int]) -> str:
    total = sum(pending.values())
    return f"{total:,} webhook or email deliver{'y' if total == 1 else 'ies'}"


def _by_webhook(pending: dict[int, int]) -> str:
    webhooks = Webhook.objects.in_bulk(list(pending))

    def name(webhook_id: int) -> str:
        webhook = webhooks.get(webhook_id)
        if webhook is not None and webhook.kind == WebhookKind.EMAIL:
            return "the escalation emails"
        return f"webhook {webhook_id} at {webhook.url if webhook else '(deleted)'}"

    return ", ".join(f"{name(webhook_id)}: {count:,}" for webhook_id, count in pending.items())


UNTIL_SETTLED = (
    "They must be delivered (or have failed, TASKBOARD_DELIVERY_HORIZON_SECONDS after they "
    "were made), or their webhook deleted (DELETE webhooks/{id}/ removes its deliveries), "
    "first: once their events leave the log they can never be delivered."
)


def _refuse_pending_deliveries(boundary: datetime) -> None:
    if pending := _pending_deliveries("pending_deliveries_before", {"before": boundary}):
        verb = "is" if sum(pending.values()) == 1 else "are"
        raise DeliveriesPending(
            f"{_how_many(pending)} of events before {boundary:%Y-%m-%d} {verb} still pending "
            f"({_by_webhook(pending)}). {UNTIL_SETTLED} Nothing was written or dropped."
        )


# Making, detaching and dropping partitions lock task_events with all its partitions:
# any transaction that reads one of them (a long query, pg_dump) holds them back until it
# ends, and board.partitions gives up after trying for about half a minute.
LOCKED = (
    "another transaction kept task_events or one of its partitions locked (a long-running "
    "query, or pg_dump) for as long as the archive waited (about 30 s)."
)


def _gave_up_waiting(exc: OperationalError) -> bool:
    return isinstance(exc.__cause__, psycopg.errors.LockNotAvailable)


def _drop(month: datetime, tally: Tally) -> None:
    """Drop the month's partition (board.partitions), which checks, under the locks that
    the drop takes, that it holds what the file holds and that no delivery of its events
    became pending meanwhile (a staff retry of a failed one). Raise DropStopped, saying
    why, when it cannot."""
    try:
        partitions.drop(month=month, count=tally.count, id_sum=tally.id_sum)
    except exceptions.PendingDeliveries as exc:
        raise DropStopped(
            f"{_how_many(exc.pending)} of events of {month:%Y-%m} became pending since the "
            f"archive started ({_by_webhook(exc.pending)}). {UNTIL_SETTLED}"
        ) from exc
    except exceptions.ArchiveMismatch as exc:
        raise DropStopped(
            f"{month:%Y-%m} gained events since they were written to the file (a month still "
            f"being written): {str(exc).splitlines()[0]}."
        ) from exc
    except OperationalError as exc:
        if not _gave_up_waiting(exc):
            raise
        raise DropStopped(f"{month:%Y-%m} could not be dropped: {LOCKED}") from exc


def _keep(partial: Path, to: Path, *, dropped: list[date], written: dict[date, Tally]) -> None:
    """Give ``to`` the lines of the ``dropped`` months only, read from ``partial`` (in
    month order), checked against what was written, then remove ``partial``."""
    gzipped = to.name.endswith(".gz")
    kept = to.with_name(to.name + ".kept")
    tallies: dict[date, Tally] = {}
    with (
        _reading(partial, gzipped=gzipped) as lines,
        _writing(kept, final_name=to.name, gzipped=gzipped) as out,
    ):
        for text in lines:
            line = json.loads(text)
            if (month := _month_of(line)) in dropped:
                out.write(text)
                tallies.setdefault(month, Tally()).add(line)
    for month in dropped:
        found, expected = tallies.get(month, Tally()), written[month]
        if (found.count, found.id_sum, found.sha256) != (
            expected.count,
            expected.id_sum,
            expected.sha256,
        ):
            raise ArchiveFailed(
                f"{kept} does not hold {month:%Y-%m} as written; the events of the months "
                f"dropped are in {partial}."
            )
    os.replace(kept, to)
    partial.unlink()


def _events_of(month: datetime) -> Iterator[dict[str, Any]]:
    """Yield the month's events as archive lines, in id order, a chunk at a time (keyset
    pagination: no server-side cursor, which a pooler in transaction mode would break).
    The month's bounds prune every other partition."""
    events = (
        TaskEvent.objects.filter(
            created_at__gte=month, created_at__lt=partitions.month_after(month)
        )
        .annotate(txid=RawSQL("txid::text", ()))
        .order_by("id")
    )
    after = 0
    while chunk := list(events.filter(id__gt=after)[:CHUNK]):
        for event in chunk:
            yield {**EventSerializer(event).data, "txid": event.txid}
        after = chunk[-1].pk


def _reading(path: Path, *, gzipped: bool) -> IO[str]:
    if gzipped:
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")


@contextmanager
def _writing(path: Path, *, final_name: str, gzipped: bool) -> Iterator[IO[str]]:
    """Write ``path``, which is renamed to ``final_name`` once verified: a gzip header names
    the file by that name (what ``gunzip -N`` restores), not by the one it is written as."""
    if not gzipped:
        with path.open("w", encoding="utf-8") as out:
            yield out
        return
    with (
        path.open("wb") as raw,
        gzip.GzipFile(filename=final_name, mode="wb", fileobj=raw) as zipped,
        io.TextIOWrapper(zipped, encoding="utf-8") as out,
    ):
        yield out


def _month_of(line: dict[str, Any]) -> date:
    created = datetime.fromisoformat(line["created_at"]).astimezone(UTC)
    return date(created.year, created.month, 1)


def _read_back(path: Path, *, gzipped: bool) -> dict[date, Tally]:
    tallies: dict[date, Tally] = {}
    with _reading(path, gzipped=gzipped) as lines:
        for text in lines:
            line = json.loads(text)
            tallies.setdefault(_month_of(line), Tally()).add(line)
    return tallies


def archive(*, before: date, to: Path, force: bool = False) -> Archived:
    """Archive every event dated before ``before`` (the first of a month) to the file
    ``to``, verify it, then drop those months' partitions."""
    boundary = check_boundary(before)
    # An empty file (made by mktemp, say) holds nothing to lose; anything else is kept.
    if to.exists() and to.stat().st_size > 0 and not force:
        raise ArchiveRefused(f"{to} exists: give another file, or --force to replace it.")
    if not partitions.supported():
        raise ArchiveRefused("The event log is not partitioned yet: run `taskboard migrate`.")
    _refuse_pending_deliveries(boundary)
    try:
        partitions.split_default(before=boundary)
    except OperationalError as exc:
        if not _gave_up_waiting(exc):
            raise
        raise ArchiveRefused(
            f"The events of the DEFAULT partition could not be moved to their months: {LOCKED} "
            "Nothing was written or dropped."
        ) from exc
    months = _months_before(boundary)

    partial = to.with_name(to.name + ".partial")
    gzipped = to.name.endswith(".gz")
    written: dict[date, Tally] = {}
    with _writing(partial, final_name=to.name, gzipped=gzipped) as out:
        for month in months:
            tally = written.setdefault(month.date(), Tally())
            for line in _events_of(month):
                out.write(json.dumps(line, separators=(",", ":")) + "\n")
                tally.add(line)

    read = _read_back(partial, gzipped=gzipped)
    for first_day, tally in written.items():
        found = read.get(first_day, Tally())
        if (found.count, found.id_sum, found.sha256) != (tally.count, tally.id_sum, tally.sha256):
            raise ArchiveFailed(
                f"{partial} does not match the database for {first_day:%Y-%m}: "
                f"{found.count} events read back, {tally.count} written. Nothing was dropped."
            )
    if set(read) - set(written):
        raise ArchiveFailed(f"{partial} holds events of months it should not. Nothing was dropped.")

    archived: list[MonthArchived] = []
    for month in months:
        tally = written[month.date()]
        try:
            _drop(month, tally)
        except DropStopped as exc:
            left = _what_is_left(archived, month, partial=partial, to=to, written=written)
            raise DropStopped(f"{exc} {left}") from exc
        archived.append(MonthArchived(month.date(), tally.count, tally.sha256))
    os.replace(partial, to)
    return Archived(to, archived)


def _what_is_left(
    archived: list[MonthArchived],
    stopped: datetime,
    *,
    partial: Path,
    to: Path,
    written: dict[date, Tally],
) -> str:
    """Leave ``to`` holding exactly the months ``archived`` (dropped), or no file when none
    was; return a sentence saying so."""
    if not archived:
        partial.unlink()
        return "Nothing was dropped and no file was written."
    _keep(partial, to, dropped=[month.month for month in archived], written=written)
    events = sum(month.events for month in archived)
    first, last = f"{archived[0].month:%Y-%m}", f"{archived[-1].month:%Y-%m}"
    months = first if first == last else f"{first} to {last}"
    return (
        f"{events:,} event{'' if events == 1 else 's'} of {months} "
        f"{'was' if events == 1 else 'were'} archived to {to} and dropped; {stopped:%Y-%m} and "
        "the months after it are still in the database: archive them later, to another file."
    )
