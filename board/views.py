"""The board's HTML pages: the live board and a task's page.

Both pages are drawn from one snapshot of the database and carry, for the browser's
EventSource, the id to resume the stream from (``?lastEventId=``) and the ids of the events
the stream will deliver although the page already shows them. The script applies every
other event, so the page neither misses what happened between drawing and connecting nor
applies anything twice. Changes go through the REST API (``board/static/board/board.js``),
which calls ``board.transitions``; these views only read.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from django.contrib.auth.decorators import login_required
from django.db import connection, transaction
from django.db.models import Count, QuerySet
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.utils import timezone
from django.views.decorators.http import require_safe

from board import conf
from board.access import queue_access
from board.api.serializers import TaskSerializer
from board.models import QUEUE_PATTERN, Task, TaskEvent, TaskStatus
from board.sql import QUERIES

# The board shows every open task up to this many per column (a note counts the rest)...
OPEN_COLUMN_LIMIT = 200
# ...and the most recently finished (done or cancelled) tasks.
FINISHED_LIMIT = 50

# A card shows neither: the task page does. Payloads may be up to 1 MiB each.
CARD_OMITS = {"payload", "description", "result"}

COUNTS = [
    (TaskStatus.PENDING.value, "Pending"),
    (TaskStatus.IN_PROGRESS.value, "In progress"),
    (TaskStatus.ESCALATED.value, "Escalated"),
    (TaskStatus.DONE.value, "Done"),
    (TaskStatus.CANCELLED.value, "Cancelled"),
]


@dataclass(frozen=True)
class Column:
    """A column of the board: the tasks in ``statuses``, in ``ordering``, up to a limit."""

    key: str
    label: str
    statuses: tuple[str, ...]
    ordering: tuple[str, ...]
    finished: bool = False

    def tasks(self, tasks: QuerySet[Task]) -> list[Task]:
        limit = FINISHED_LIMIT if self.finished else OPEN_COLUMN_LIMIT
        return list(tasks.filter(status__in=self.statuses).order_by(*self.ordering)[:limit])


COLUMNS = [
    # Pending and in progress in claim order.
    Column("pending", "Pending", (TaskStatus.PENDING,), ("-priority", "created_at", "id")),
    Column(
        "in_progress", "In progress", (TaskStatus.IN_PROGRESS,), ("-priority", "created_at", "id")
    ),
    # Oldest escalation first: an escalated task was last updated when it escalated.
    Column("escalated", "Escalated", (TaskStatus.ESCALATED,), ("updated_at", "id")),
    Column(
        "finished",
        "Done & cancelled",
        (TaskStatus.DONE, TaskStatus.CANCELLED),
        ("-updated_at", "-id"),
        finished=True,
    ),
]


def stream_horizon() -> str:
    """Return the stream's horizon now (see stream_horizon in board/sql/stream.sql).

    Call it before the page's snapshot is taken, in a statement of its own: everything
    below it is then either visible to that snapshot or will never exist.
    """
    with connection.cursor() as cursor:
        cursor.execute(QUERIES["stream_horizon"])
        return str(cursor.fetchone()[0])


def stream_head_id(horizon: str) -> int:
    """Return the id of the last event below ``horizon``, or 0 if there is none.

    A stream resumed from this id delivers every event past it. Some of those may
    already be visible to the caller's snapshot: see :func:`unstable_event_ids`.
    """
    with connection.cursor() as cursor:
        cursor.execute(QUERIES["stream_head"], {"horizon": horizon})
        row = cursor.fetchone()
    return int(row[1]) if row else 0


def unstable_event_ids(horizon: str, task_id: int | None = None) -> list[int]:
    """Return the ids of the events this snapshot sees past the horizon (of one task)."""
    with connection.cursor() as cursor:
        cursor.execute(
            QUERIES["snapshot_unstable_events"], {"horizon": horizon, "task_id": task_id}
        )
        return [int(row[0]) for row in cursor.fetchall()]


@contextmanager
def page_snapshot() -> Iterator[None]:
    """Run the block's reads in one read-only REPEATABLE READ snapshot.

    Every statement then sees the same database: the counts, the cards, the stream head
    and the list of events to skip agree with each other. Inside an outer transaction (a
    test's), the isolation level is the outer one's.
    """
    outermost = not connection.in_atomic_block
    with transaction.atomic():
        if outermost:
            with connection.cursor() as cursor:
                cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        yield


def queue_filter(request: HttpRequest) -> str | None:
    """Return the ``?queue=`` of the request, or None when it is absent or no queue name."""
    queue = request.GET.get("queue", "").strip()
    return queue if re.match(QUEUE_PATTERN, queue) else None


def _card(task: dict[str, Any]) -> dict[str, Any]:
    """Return what a card shows of a serialized task: not its (possibly large) data."""
    return {key: value for key, value in task.items() if key not in CARD_OMITS}


def _stream_context(resume_id: int, skip: list[int]) -> dict[str, Any]:
    return {"resume_id": resume_id, "skip": skip, "now": timezone.now().isoformat()}


@require_safe
@login_required
def home(request: HttpRequest) -> HttpResponse:
    """Show the board: open tasks by status, the latest finished ones, counts per status."""
    queue = queue_filter(request)
    horizon = stream_horizon()
    with page_snapshot():
        resume_id = stream_head_id(horizon)
        skip = unstable_event_ids(horizon)
        # A user limited to queues (board.access) sees only those, here as in the API.
        visible = queue_access(request.user).visible(Task.objects.all())
        tasks = visible.filter(queue=queue) if queue else visible
        counts = dict(tasks.values_list("status").annotate(n=Count("id")).order_by())
        columns = {column.key: column.tasks(tasks) for column in COLUMNS}
        queues = sorted(visible.values_list("queue", flat=True).distinct().order_by())
    if queue and queue not in queues:
        queues.append(queue)
    counts = {status.value: counts.get(status.value, 0) for status in TaskStatus}
    state = {
        **_stream_context(resume_id, skip),
        "page": "board",
        "user": request.user.get_username(),
        "queue": queue,
        "lease_seconds": conf.lease_seconds(),
        "open_limit": OPEN_COLUMN_LIMIT,
        "finished_limit": FINISHED_LIMIT,
        "counts": counts,
        "tasks": [
            _card(data)
            for data in TaskSerializer(
                [task for cards in columns.values() for task in cards], many=True
            ).data
        ],
    }
    return render(
        request,
        "board/home.html",
        {
            "state": state,
            "queue": queue,
            "queues": queues,
            "counts": [(status, label, counts[status]) for status, label in COUNTS],
            "columns": [
                {
                    "key": column.key,
                    "label": column.label,
                    "tasks": columns[column.key],
                    "count": sum(counts[status] for status in column.statuses),
                }
                for column in COLUMNS
            ],
            "finished_limit": FINISHED_LIMIT,
            "now": timezone.now(),
        },
    )


@require_safe
@login_required
def task_detail(request: HttpRequest, pk: int) -> HttpResponse:
    """Show one task, its payload and result, and its whole event timeline, oldest first."""
    horizon = stream_horizon()
    with page_snapshot():
        resume_id = stream_head_id(horizon)
        task = get_object_or_404(queue_access(request.user).visible(Task.objects.all()), pk=pk)
        events = list(TaskEvent.objects.filter(task=task).order_by("id"))
        skip = unstable_event_ids(horizon, task.pk)
    data = TaskSerializer(task).data
    state = {
        **_stream_context(resume_id, skip),
        "page": "task",
        "user": request.user.get_username(),
        "lease_seconds": conf.lease_seconds(),
        "task": data,
    }
    return render(
        request,
        "board/task.html",
        {"state": state, "task": task, "events": events, "now": timezone.now()},
    )
