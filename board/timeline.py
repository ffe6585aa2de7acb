"""A task's timeline as people read it: consecutive heartbeats of one holder as one entry.

A lease kept alive for an hour is a heartbeat every 40 s: ninety rows that say the same
thing. The board's task page and the admin show such a run as one entry ("12 heartbeats,
10:02 to 10:06") with the last one's data (its lease and progress); the API and the stream
still return every event, and the page's script folds live heartbeats the same way
(board/static/board/board.js, ``addToTimeline``).
"""

from __future__ import annotations

from collections.abc import Iterable
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
