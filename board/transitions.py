"""The task state machine: the only code that writes ``tasks`` and ``task_events``.

Every function here is one transition. Each runs in one transaction, applies its guard in
SQL, writes its event rows (with the actor and the task's status after the change) in the
same statement, and returns the task as it is afterwards. The API, the admin, the board
pages and the command line call these functions and nothing else to change a task.

::

    pending ──claim──▶ in_progress ──complete──▶ done
       ▲                  │  │  │
       │  release, fail   │  │  └─escalate, 3rd strike─▶ escalated ──resolve──▶ done
       └──(strike < max)──┘  └── lease expires: a strike, found by the next claim
    escalated, done, cancelled ──requeue──▶ pending (strikes reset)
    pending, escalated ──cancel──▶ cancelled

The statements themselves live in ``board/sql/transitions.sql``.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.contrib.auth.base_user import AbstractBaseUser
from django.contrib.auth.models import AnonymousUser
from django.db import connection
from django.db.models import JSONField
from psycopg.types.json import Jsonb

from board import conf
from board.exceptions import (
    InvalidTransition,
    LeaseLost,
    TaskNotFound,
    translated_database_errors,
)
from board.models import Task, TaskStatus
from board.sql import QUERIES

Actor = AbstractBaseUser | AnonymousUser | str

_FIELDS = {str(f.column): f for f in Task._meta.concrete_fields}


@dataclass(frozen=True)
class Claim:
    """A task handed out by :func:`claim`, with the secret its holder must present."""

    task: Task
    lease_token: str


def _username(actor: Actor) -> str:
    if isinstance(actor, str):
        return actor
    if not actor.is_authenticated:
        raise ValueError("Transitions need an authenticated actor.")
    return str(actor.get_username())


def _json(value: Any) -> Jsonb | None:
    return None if value is None else Jsonb(value)


def _rows(name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    """Run the named statement and return its rows as dicts."""
    with translated_database_errors(), connection.cursor() as cursor:
        cursor.execute(QUERIES[name], params)
        columns = [col.name for col in cursor.description]
        return [dict(zip(columns, row, strict=True)) for row in cursor.fetchall()]


def _task(row: dict[str, Any]) -> Task:
    """Build a Task from a ``RETURNING *`` row, ignoring any extra columns."""
    names, values = [], []
    for column, field in _FIELDS.items():
        value = row[column]
        # Django leaves jsonb as text for the field to decode, as its query compiler would.
        if isinstance(field, JSONField):
            value = field.from_db_value(value, None, connection)  # type: ignore[arg-type]
        names.append(field.attname)
        values.append(value)
    return Task.from_db(connection.alias, names, values)


def _current_status(task_id: int) -> str:
    rows = _rows("task_status", {"task_id": task_id})
    if not rows:
        raise TaskNotFound(task_id)
    return str(rows[0]["status"])


def _holder_transition(
    name: str, *, task_id: int, actor: Actor, lease_token: str, **params: Any
) -> Task:
    """Run a transition that only the live lease holder may make, or raise LeaseLost."""
    try:
        token = uuid.UUID(str(lease_token))
    except ValueError:
        token = None  # a malformed token matches no lease; the guard below refuses it
    rows = (
        _rows(name, {"task_id": task_id, "actor": _username(actor), "lease_token": token, **params})
        if token is not None
        else []
    )
    if not rows:
        raise LeaseLost(task_id, _current_status(task_id))
    return _task(rows[0])


def _human_transition(
    name: str, *, task_id: int, actor: Actor, allowed: tuple[str, ...], **params: Any
) -> Task:
    """Run a staff transition guarded by the task's status, or raise InvalidTransition."""
    rows = _rows(name, {"task_id": task_id, "actor": _username(actor), **params})
    if not rows:
        raise InvalidTransition(task_id, _current_status(task_id), name, allowed)
    return _task(rows[0])


def create(
    *,
    actor: Actor,
    title: str,
    description: str = "",
    payload: dict[str, Any] | None = None,
    queue: str = "default",
    priority: int = 0,
    max_failures: int | None = None,
    run_after: datetime | None = None,
) -> Task:
    """Create a pending task and record its ``created`` event."""
    rows = _rows(
        "create",
        {
            "actor": _username(actor),
            "title": title,
            "description": description,
            "payload": Jsonb(payload if payload is not None else {}),
            "queue": queue,
            "priority": priority,
            "max_failures": max_failures if max_failures is not None else conf.max_failures(),
            "run_after": run_after,
        },
    )
    return _task(rows[0])


def claim(
    *,
    actor: Actor,
    queues: Sequence[str] | None = None,
    limit: int = 1,
    lease_seconds: int | None = None,
) -> list[Claim]:
    """Lease up to ``limit`` claimable tasks to ``actor``, in claim order.

    Claimable means pending and due, or in progress with an expired lease. Concurrent
    claims never wait for each other and never get the same task (SKIP LOCKED). An expired
    lease found on the way is recorded (``expired`` by ``system``) and counts a strike; a
    task that reaches its ``max_failures`` that way is escalated instead of handed out, and
    the claim goes on to the next candidate. Each round of that is one statement, hence
    one transaction of its own; a claim that escalated nothing is a single round.
    """
    if limit < 1:
        return []
    params = {
        "actor": _username(actor),
        "all_queues": not queues,
        "queues": list(queues or []),
        "lease_seconds": lease_seconds or conf.lease_seconds(),
    }
    claims: list[Claim] = []
    # Each round is one statement, hence one transaction of its own: the usual claim is a
    # single round trip. Only a round that escalated a candidate is followed by another.
    while len(claims) < limit:
        rows = _rows("claim", {**params, "limit": limit - len(claims)})
        claims += [Claim(_task(row), str(row["lease_token"])) for row in rows if row["claimed"]]
        # An escalation may have cost this round a candidate: look again, since every
        # round that escalates removes a task from the claimable set for good.
        if not any(row["escalates"] for row in rows):
            break
    return claims


def heartbeat(
    *,
    task_id: int,
    actor: Actor,
    lease_token: str,
    lease_seconds: int | None = None,
    progress: Any = None,
) -> Task:
    """Extend the holder's live lease to now + ``lease_seconds`` (default: as claimed)."""
    return _holder_transition(
        "heartbeat",
        task_id=task_id,
        actor=actor,
        lease_token=lease_token,
        lease_seconds=lease_seconds,
        progress=_json(progress),
    )


def complete(*, task_id: int, actor: Actor, lease_token: str, result: Any = None) -> Task:
    """Mark the holder's task done with ``result``."""
    return _holder_transition(
        "complete", task_id=task_id, actor=actor, lease_token=lease_token, result=_json(result)
    )


def fail(
    *, task_id: int, actor: Actor, lease_token: str, error: str, retry_after: int | None = None
) -> Task:
    """Count a strike: back to pending (due after ``retry_after`` s), or escalate at the max."""
    return _holder_transition(
        "fail",
        task_id=task_id,
        actor=actor,
        lease_token=lease_token,
        error=error,
        retry_after=retry_after,
    )


def release(*, task_id: int, actor: Actor, lease_token: str) -> Task:
    """Give the holder's task back to pending without counting a strike."""
    return _holder_transition("release", task_id=task_id, actor=actor, lease_token=lease_token)


def escalate(*, task_id: int, actor: Actor, lease_token: str, reason: str) -> Task:
    """Hand the holder's task to the human queue with ``reason``."""
    return _holder_transition(
        "escalate", task_id=task_id, actor=actor, lease_token=lease_token, reason=reason
    )


REQUEUE_FROM = (TaskStatus.ESCALATED, TaskStatus.DONE, TaskStatus.CANCELLED)
RESOLVE_FROM = (TaskStatus.ESCALATED,)
CANCEL_FROM = (TaskStatus.PENDING, TaskStatus.ESCALATED)


def requeue(*, task_id: int, actor: Actor, note: str | None = None) -> Task:
    """Put an escalated, done or cancelled task back to pending with its strikes reset."""
    return _human_transition(
        "requeue", task_id=task_id, actor=actor, allowed=REQUEUE_FROM, note=note
    )


def resolve(*, task_id: int, actor: Actor, note: str | None = None, result: Any = None) -> Task:
    """Settle an escalated task as done by hand, with a note and an optional result."""
    return _human_transition(
        "resolve",
        task_id=task_id,
        actor=actor,
        allowed=RESOLVE_FROM,
        note=note,
        result=_json(result),
    )


def cancel(*, task_id: int, actor: Actor, note: str | None = None) -> Task:
    """Withdraw a pending or escalated task."""
    return _human_transition("cancel", task_id=task_id, actor=actor, allowed=CANCEL_FROM, note=note)
