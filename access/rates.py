"""Per-user write rates: how many tasks a user may create, and comments write, a minute.

``TASKBOARD_CREATE_RATE`` tasks created and ``TASKBOARD_COMMENT_RATE`` comments a minute
per user (0: no limit). A write beyond answers ``429 {"error": "rate_limited"}`` with
``Retry-After`` and does nothing: the count is taken before the transition, and a refused
write counts nothing, so the wait it is told is the wait it needs. This bounds what one
agent can make every reader of the board load (tasks, the events of comments).

The counts live in PostgreSQL (the UNLOGGED ``write_counts`` table, one conditional upsert
per write, access/rates.sql), not in process memory, so that N server processes on one
database enforce one limit, as access.throttle does for failed authentication. Every way an
agent writes goes through the API views that call :func:`spend`: the REST API, ``taskboard
mcp`` (a client of it) and ``/mcp/`` (whose tools call the API in-process).

The estimate is the sliding-window one of access.throttle: the current minute's count plus
the previous minute's, weighted by the share of that minute still within the last 60
seconds. It takes the previous minute's writes as spread evenly over it: bunched at its
start they weigh more than they should (a user is refused early, at worst until the next
minute begins), bunched at its end less, and then up to twice the rate can get through in
the 60 seconds around a window's boundary, never more.

A write counts when it is made, before its transition runs: a create that then turns out to
repeat an ``Idempotency-Key`` (and creates nothing) has still counted.
"""

from __future__ import annotations

import math
from enum import StrEnum
from pathlib import Path

from django.contrib.auth.base_user import AbstractBaseUser
from django.contrib.auth.models import AnonymousUser
from django.db import connection

from board import conf
from board.exceptions import RateLimited
from board.sql import load

QUERIES = load(Path(__file__).with_name("rates.sql"))

WINDOW_SECONDS = 60  # the rates are per minute


class Write(StrEnum):
    """What is counted, each against its own limit."""

    CREATE = "create"
    COMMENT = "comment"


def limit(kind: Write) -> int:
    """Return the writes of ``kind`` a user may make a minute (0: no limit)."""
    if kind is Write.CREATE:
        return int(conf.create_rate())
    return int(conf.comment_rate())


def spend(user: AbstractBaseUser | AnonymousUser, kind: Write, count: int = 1) -> None:
    """Count ``count`` writes of ``kind`` by ``user``, or raise :class:`RateLimited` (and
    count nothing) if they would take the user over its rate."""
    allowed = limit(kind)
    if allowed <= 0 or count <= 0:
        return
    params = {
        "user_id": user.pk,
        "kind": str(kind),
        "count": count,
        "limit": allowed,
        "window": WINDOW_SECONDS,
    }
    with connection.cursor() as cursor:
        cursor.execute(QUERIES["spend"], params)
        row = cursor.fetchone()
        if row is None:
            raise RateLimited(str(kind), allowed, retry_after(user, kind, count))
        if row[0] == count:  # the user's first write of this window
            cursor.execute(QUERIES["forget_ended_windows"], {"window": WINDOW_SECONDS})


def retry_after(user: AbstractBaseUser | AnonymousUser, kind: Write, count: int = 1) -> int:
    """Return the whole seconds until ``count`` writes of ``kind`` by ``user`` would fit
    (at least 1), by the same estimate :func:`spend` applies."""
    allowed = limit(kind)
    params = {"user_id": user.pk, "kind": str(kind), "window": WINDOW_SECONDS}
    with connection.cursor() as cursor:
        cursor.execute(QUERIES["counts"], params)
        current, previous, left = cursor.fetchone()
    length = WINDOW_SECONDS
    room = allowed - count
    if current > room:
        # Not before this window ends; then the current count is the previous one, fading.
        wait = left + length * (1 - room / current)
    elif previous:
        wait = left - length * (room - current) / previous
    else:
        wait = 0.0  # it fits now: the refusal raced writes that have since been counted
    return max(1, math.ceil(float(wait)))
