"""The event log's monthly partitions: making them ahead of the events, and dropping a month
that ``taskboard archive`` has verified.

The rows of ``task_events`` are written by board.transitions alone; this module keeps the
table they land in. Making a partition moves the events that the DEFAULT partition holds
for its month into it unchanged (ids and txids included), and dropping one removes a whole
month whose archive file was checked against it (board.ops.archive); neither makes,
changes or removes a single event otherwise. The statements are in
``board/sql/partitions.sql`` and the functions they call, with their lock order, in
``board/sql/schema/event_log.sql``.

An event always has a partition to land in: the DEFAULT one takes what no month's
partition does. That the month's own is there is made sure of at three points: every
``migrate`` makes this month's and the next three (board.apps), each process makes this
month's and the next before its first transition that writes an event in a month
(:func:`make_sure_of_this_month`, which board.transitions calls), and the archive splits
what the DEFAULT partition holds before it reads a month.

:func:`make_sure_of_this_month` is called before every statement that writes an event,
rather than from a timer of its own: after the first call of a month it is a comparison of
the month with the one it remembers, 0.4 us a call (timeit, 200,000 calls), against 1.1 ms
for a heartbeat, the quickest transition, on the development machine's PostgreSQL 15:
the check costs nothing measurable, and a timer would be one more thing to start, stop
and get wrong at the turn of a month. Statements that write no event (reads after a
refused guard, a queue's pause) skip it.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

import psycopg
from django.db import DatabaseError, OperationalError, connection, transaction

from board import sql
from board.exceptions import PendingDeliveries, translated_database_errors
from board.sql import QUERIES

logger = logging.getLogger(__name__)
T = TypeVar("T")

# The UTC month (year, month) for which this process made sure of its event partitions, and
# when it may try again after a failure.
_month_made: tuple[int, int] | None = None
_retry_at = 0.0
RETRY_SECONDS = 10.0


def _query(name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    return sql.run(QUERIES[name], params)


def month_start(at: datetime, months_later: int = 0) -> datetime:
    """The first instant (UTC) of the month that holds ``at``, or of one ``months_later``."""
    index = at.astimezone(UTC).year * 12 + at.astimezone(UTC).month - 1 + months_later
    return datetime(index // 12, index % 12 + 1, 1, tzinfo=UTC)


def month_after(month: datetime) -> datetime:
    """The first instant of the month after ``month`` (the first instant of a month)."""
    return month.replace(year=month.year + month.month // 12, month=month.month % 12 + 1)


def make_sure_of_this_month() -> None:
    """Make sure, at most once per process and month, that the month's partition of
    task_events and the next month's exist, before a transition writes events.

    The next month's too, so that at the turn of the month the partition is there already,
    whichever clock (this process's or the database's) turns first. Should this fail (its
    locks wait at most 200 ms: see board/sql/schema/event_log.sql), the transition goes on,
    its events land in the DEFAULT partition if the month has none, and a transition tries
    again 10 s later.
    """
    global _month_made, _retry_at
    now = datetime.now(UTC)
    if _month_made == (now.year, now.month):
        return
    if time.monotonic() < _retry_at:
        return
    try:
        ensure(at=now, months_ahead=1, attempts=1)
    except DatabaseError as exc:
        logger.warning("could not create the event log's partitions for %s: %s", now, exc)
        _retry_at = time.monotonic() + RETRY_SECONDS
        return
    _month_made = (now.year, now.month)


def _retrying_lock_timeouts(work: Callable[[], T], attempts: int) -> T:
    """Run ``work`` (one transaction), again after a short, growing pause each time the
    partition functions gave up waiting for a lock (lock_not_available), up to ``attempts``
    times in all; never inside a caller's transaction, which a retry could not repeat."""
    for attempt in range(1, attempts + 1):
        try:
            return work()
        except OperationalError as exc:
            gave_up = isinstance(exc.__cause__, psycopg.errors.LockNotAvailable)
            if not gave_up or attempt == attempts or connection.in_atomic_block:
                raise
            time.sleep(min(2.0, 0.05 * 2**attempt) * random.uniform(0.5, 1.0))
    raise AssertionError("unreachable")


def supported() -> bool:
    """Return whether task_events is partitioned (the database has migration 0011)."""
    return bool(_query("event_partitions_supported", {})[0]["supported"])


def ensure(*, at: datetime | None = None, months_ahead: int = 1, attempts: int = 20) -> list[str]:
    """Create the partitions of task_events for the UTC month of ``at`` (default: now) and
    the ``months_ahead`` months after it, those that do not exist yet; return their names.

    Runs in a savepoint of the caller's transaction, or in transactions of its own (retried
    up to ``attempts`` times when a lock was busy); a database before migration 0011 has
    nothing to create.
    """
    start = at or datetime.now(UTC)

    def make() -> list[str]:
        with transaction.atomic():
            if not supported():
                return []
            return [
                str(_query("ensure_event_partition", {"at": month_start(start, n)})[0]["partition"])
                for n in range(months_ahead + 1)
            ]

    return _retrying_lock_timeouts(make, attempts)


def split_default(*, before: datetime) -> list[datetime]:
    """Move the events dated before ``before`` out of the DEFAULT partition, into their
    months' partitions (created as needed); return those months."""

    def split() -> list[datetime]:
        with transaction.atomic():
            rows = _query("default_event_partition_months", {"before": before})
            months = [row["month"] for row in rows]
            for month in months:
                _query("ensure_event_partition", {"at": month})
        return months

    return _retrying_lock_timeouts(split, attempts=20)


def drop(*, month: datetime, count: int, id_sum: int) -> int:
    """Detach and drop the partition of task_events for ``month`` (its first instant, UTC),
    in one transaction, after checking under its lock that it holds exactly ``count``
    events whose ids sum to ``id_sum`` (what the archive file holds) and that no delivery
    of its events is pending; return the number of events dropped.

    Raises :class:`~board.exceptions.ArchiveMismatch` or
    :class:`~board.exceptions.PendingDeliveries` (and drops nothing) when either fails.
    The locks that the drop takes are taken first (lock_event_log), so that the check of
    the deliveries still holds when the partition goes: no event of the month (nor its
    deliveries) is written meanwhile, and a staff retry of a failed delivery waits for the
    drop and then finds its event gone (board.notifications.deliveries.retry_deliveries).
    A transaction of its own, or the caller's; busy locks are retried only in its own.
    """

    def drop_month() -> int:
        with transaction.atomic():
            with translated_database_errors(), connection.cursor() as cursor:
                cursor.execute(QUERIES["lock_event_log"])
            bounds = {"month": month, "next_month": month_after(month)}
            if pending := _query("pending_deliveries_of_month", bounds):
                raise PendingDeliveries(
                    {int(row["webhook_id"]): int(row["pending"]) for row in pending}
                )
            verified = {"month": month, "count": count, "id_sum": id_sum}
            return int(_query("drop_event_partition", verified)[0]["dropped"])

    return _retrying_lock_timeouts(drop_month, attempts=20)
