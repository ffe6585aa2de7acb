"""Template filters for the board pages."""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any

from django import template
from django.utils.text import Truncator

register = template.Library()


@register.filter
def pretty_json(value: Any) -> str:
    """Return ``value`` as indented JSON (autoescaping still applies to the result)."""
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True)


@register.filter
def status_label(value: str) -> str:
    """Return a status or event type as words: "in_progress" -> "in progress"."""
    return str(value).replace("_", " ")


# A time as the database's JSON writes it: 2026-03-01T12:00:00.123456+00:00.
_TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d(:\d\d(\.\d+)?)?(Z|[+-]\d\d:\d\d)")


@register.filter
def event_data(payload: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Return an event's payload as (key, text, kind) rows, sorted by key.

    ``kind`` is "time" for a timestamp, "text" for another string, "json" for the rest
    (shown as compact JSON).
    """
    rows = []
    for key, value in sorted(payload.items()):
        if isinstance(value, str):
            rows.append((key, value, "time" if _TIMESTAMP.fullmatch(value) else "text"))
        else:
            rows.append((key, json.dumps(value, ensure_ascii=False, sort_keys=True), "json"))
    return rows


@register.filter
def get_item(mapping: dict[str, Any], key: str) -> Any:
    """Return ``mapping[key]``, or None when it has no such key."""
    return mapping.get(key)


@register.filter
def iso_time(value: datetime | str) -> str:
    """Return a time as ISO 8601 (a string, as the API writes it, stays as it is)."""
    return value.isoformat() if isinstance(value, datetime) else str(value)


@register.filter
def blockers_for(task: Any, dependencies: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Return what keeps ``task`` blocked: its dependencies that are not done, in the order
    they were given, from ``dependencies`` (board.pages.views.dependencies_of)."""
    found = [dependencies.get(pk, {"id": pk, "hidden": True}) for pk in task.depends_on]
    return [dep for dep in found if dep.get("status") != "done"]


@register.filter
def compact_json(value: Any) -> str:
    """Return ``value`` as JSON on one line, keys sorted."""
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


# A timeline shows this much of an event's text (a comment, each value of its data), and
# links the event's own page, which shows all of it.
EVENT_TEXT_LIMIT = 1000


@register.filter
def clip(text: str) -> str:
    """Return the start of an event's text, as a timeline shows it (EVENT_TEXT_LIMIT)."""
    return Truncator(text).chars(EVENT_TEXT_LIMIT)


@register.filter
def clipped(payload: dict[str, Any]) -> bool:
    """Return whether a timeline cuts some text of an event's ``payload`` short."""
    return any(len(text) > EVENT_TEXT_LIMIT for _, text, _ in event_data(payload))


# An in-progress card shows the start of the latest progress, as text.
PROGRESS_TEXT_LIMIT = 120


@register.filter
def progress_text(progress: Any) -> str | None:
    """Return the start of a task's progress as a card shows it: a string as it is, other
    JSON on one line with its keys sorted, as board.js's ``progressText`` writes it."""
    if progress is None:
        return None
    if isinstance(progress, str):
        text = progress
    else:
        text = json.dumps(progress, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return Truncator(text).chars(PROGRESS_TEXT_LIMIT)


@register.filter(name="timeline")
def timeline_filter(events: Any) -> list[Any]:
    """Return a task's events (oldest first) as board.pages.timeline entries: heartbeat runs
    folded into one."""
    from board.pages.timeline import timeline

    return timeline(events)


@register.filter
def parse_time(value: str) -> datetime | str:
    """Return a timestamp string of a payload as a datetime (for ``date``), else as is."""
    from django.utils.dateparse import parse_datetime

    try:
        return parse_datetime(value) or value
    except ValueError:
        return value
