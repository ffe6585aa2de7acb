"""Queues and agents at a glance: what ``GET queues/``, ``GET agents/`` and the board's
panels show, read from the counters that the triggers of ``board/sql/schema/counters.sql``
keep in step with every transition (never a scan of tasks or of the event log)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from django.db import connection

from board import sql
from board.access import QueueAccess
from board.sql import QUERIES

COUNTS = (
    "pending",
    "blocked",
    "in_progress",
    "escalated",
    "done",
    "cancelled",
    "awaiting_input",
)


def _rows(name: str, access: QueueAccess | None, **extra: Any) -> list[dict[str, Any]]:
    queues = sorted(access.queues or ()) if access is not None and access.limited else None
    params: dict[str, Any] = {"all_queues": queues is None, "queues": queues or [], **extra}
    with connection.cursor() as cursor:
        cursor.execute(QUERIES[name], params)
        columns = [col.name for col in cursor.description]
        return [dict(zip(columns, row, strict=True)) for row in cursor.fetchall()]


def queue_list(
    access: QueueAccess | None = None,
    name: str | None = None,
    *,
    after: str | None = None,
    limit: int | None = None,
) -> list[dict[str, Any]]:
    """Every queue that has tasks or was paused (those ``access`` may see), by name:
    ``{"name", "paused", "counts": {...}, "oldest_pending_at"}`` plus who last paused or
    resumed it (``changed_at``, ``changed_by``, ``note``; None if nobody ever did).

    ``after``, ``limit``: only the first ``limit`` queues whose names sort after ``after``
    (a page of them; None: no bound)."""
    return [
        _queue(row)
        for row in _rows("queue_list", access, after=after, limit=limit)
        if name is None or row["name"] == name
    ]


def _queue(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": row["name"],
        "paused": row["paused"],
        "counts": {count: int(row[count]) for count in COUNTS},
        "oldest_pending_at": row["oldest_pending_at"],
        "changed_at": row["changed_at"],
        "changed_by": row["changed_by"],
        "note": row["note"],
    }


def queue_panel(access: QueueAccess | None, limit: int) -> tuple[list[dict[str, Any]], int]:
    """Return the board's queues panel: at most ``limit`` queues as queue_list has them,
    paused ones first, then the busiest (most open tasks), then by name; and how many
    queues there are in all (those ``access`` may see)."""
    rows = _rows("queue_panel", access, limit=limit)
    return [_queue(row) for row in rows], int(rows[0]["queues_in_all"]) if rows else 0


def queue_totals(access: QueueAccess | None, queue: str | None = None) -> dict[str, int]:
    """Return the tasks per status (COUNTS) over the queues ``access`` may see, or over
    ``queue`` alone, from the counters."""
    [row] = _rows("queue_totals", access, queue=queue)
    return {count: int(row[count]) for count in COUNTS}


def queue_detail(name: str, access: QueueAccess | None = None) -> dict[str, Any]:
    """One queue as queue_list shows it, with zero counts if it has no tasks yet."""
    for queue in queue_list(access, name):
        return queue
    return {
        "name": name,
        "paused": False,
        "counts": dict.fromkeys(COUNTS, 0),
        "oldest_pending_at": None,
        "changed_at": None,
        "changed_by": None,
        "note": None,
    }


def agent_list(
    access: QueueAccess | None = None, viewer: str | None = None
) -> list[dict[str, Any]]:
    """Every user that has claimed a task, by name: ``{"name", "holding", "last_seen_at",
    "completed_24h", "failed_24h", "expired_24h"}``.

    A reader limited to queues (``access``) sees only itself (``viewer``): the other
    agents' sightings and counts are not kept per queue, so they would tell it about work
    in queues it may not see.
    """
    agents = [
        {
            "name": row["name"],
            "holding": list(row["holding"]),
            "last_seen_at": row["last_seen_at"],
            "completed_24h": int(row["completed_24h"]),
            "failed_24h": int(row["failed_24h"]),
            "expired_24h": int(row["expired_24h"]),
        }
        for row in _rows("agent_list", access)
    ]
    if access is not None and access.limited:
        agents = [agent for agent in agents if agent["name"] == viewer]
    return agents


def next_claimable_at(queues: Sequence[str] | None = None) -> datetime | None:
    """Return when the next task in ``queues`` (None or empty: every queue) becomes
    claimable, or a claim has work to do, without any event to announce it: a pending
    task's future run_after, the end of its hold for the agent that asked, an in-progress
    task's lease deadline, or the deadline of a question (escalated by the claim then).
    Paused queues and blocked tasks are left out. One round trip (board/sql/queues.sql)."""
    rows = sql.run(
        QUERIES["next_claimable_at"], {"all_queues": not queues, "queues": list(queues or [])}
    )
    at = rows[0]["at"]
    assert at is None or isinstance(at, datetime)
    return at
