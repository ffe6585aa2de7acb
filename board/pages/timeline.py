"""A task's timeline as people read it: consecutive heartbeats of one holder as one entry.

A lease kept alive for an hour is a heartbeat every 40 s: ninety rows that say the same
thing. The board's task page and the admin show such a run as one entry ("12 heartbeats,
10:02 to 10:06") with the last one's data (its lease and progress); the API and the stream
still return every event, and the page's script folds live heartbeats the same way
(board/static/board/board.js, ``addToTimeline``).

Both show a task's timeline a page at a time (:func:`timeline_page`): a task with a
thousand comments opens as fast, and as small, as one with ten.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from board.models import EventType, TaskEvent


@dataclass
class TimelineEntry:
    """One event, or a run of consecutive heartbeats (``event`` is then the last)."""

    event: TaskEvent
    first: TaskEvent
    ids: list[int] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.ids)

    @property
    def is_run(self) -> bool:
        return self.count > 1

    @property
    def within_a_minute(self) -> bool:
        """Whether the run fits in one minute of the clock: then its times show seconds,
        where "10:02 to 10:02" would say nothing."""
        return self.first.created_at.replace(second=0, microsecond=0) == (
            self.event.created_at.replace(second=0, microsecond=0)
        )

    def extends(self, event: TaskEvent) -> bool:
        """Whether ``event`` continues this entry: another heartbeat by the same holder."""
        return (
            event.type == EventType.HEARTBEAT
            and self.event.type == EventType.HEARTBEAT
            and event.actor == self.event.actor
        )


def timeline(events: Iterable[TaskEvent]) -> list[TimelineEntry]:
    """Return ``events`` (oldest first) as timeline entries, heartbeat runs folded."""
    entries: list[TimelineEntry] = []
    for event in events:
        if entries and entries[-1].extends(event):
            entries[-1].event = event
            entries[-1].ids.append(event.pk)
        else:
            entries.append(TimelineEntry(event=event, first=event, ids=[event.pk]))
    return entries


# A page of a task's timeline: the board's task page and the admin show this many events.
PAGE_SIZE = 50


@dataclass
class TimelinePage:
    """Up to PAGE_SIZE consecutive events of a task, oldest first, and where the pages
    before and after it start (None where this page holds the task's oldest or newest)."""

    events: list[TaskEvent]
    total: int  # the task's events, on every page
    before: int | None  # ``?before=`` of the page of older events
    after: int | None  # ``?after=`` of the page of newer events

    @property
    def latest(self) -> bool:
        """Whether this page ends with the task's newest event (the one live events join)."""
        return self.after is None


def timeline_page(
    task_id: int, *, before: int | None = None, after: int | None = None
) -> TimelinePage:
    """Return the page of ``task_id``'s events just before the event id ``before``, or just
    after ``after``, or (neither) its newest events.

    Each page reads PAGE_SIZE + 1 rows down the (task_id, id) index, the one more telling
    whether there is another page that way; a task's timeline costs the same to page
    whatever its length.
    """
    events = TaskEvent.objects.filter(task_id=task_id)
    total = events.count()
    if after is not None:
        rows = list(events.filter(id__gt=after).order_by("id")[: PAGE_SIZE + 1])
        more_newer, rows = len(rows) > PAGE_SIZE, rows[:PAGE_SIZE]
        more_older = events.filter(id__lte=after).exists()
    else:
        newest_first = events.filter(id__lt=before) if before is not None else events
        rows = list(newest_first.order_by("-id")[: PAGE_SIZE + 1])
        more_older, rows = len(rows) > PAGE_SIZE, rows[:PAGE_SIZE][::-1]
        more_newer = before is not None and events.filter(id__gte=before).exists()
    return TimelinePage(
        events=rows,
        total=total,
        before=rows[0].pk if rows and more_older else None,
        after=rows[-1].pk if rows and more_newer else None,
    )


def requested_page(task_id: int, query: Mapping[str, str]) -> TimelinePage:
    """Return the page of ``task_id``'s timeline that a page's ``query`` names (``before``
    or ``after``, an event id), or its newest events when it names none."""

    def event_id(name: str) -> int | None:
        value = query.get(name, "")
        return int(value) if value.isascii() and value.isdigit() and len(value) <= 18 else None

    return timeline_page(task_id, before=event_id("before"), after=event_id("after"))
