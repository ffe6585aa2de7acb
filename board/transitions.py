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

Work graphs: a task created with ``depends_on`` is pending but blocked (not claimable)
until every dependency is done; the transition that makes the last one done (complete,
resolve) records ``unblocked`` for it in the same transaction. Comments are events
without a change of status. Pausing a queue takes its tasks out of claims.

Telling humans: webhooks (and the email channel) and their deliveries are written here
too. A delivery is made with its event, in the same statement, by the trigger of
``board/sql/schema/deliveries.sql``; the server processes claim, send and record them
through the functions at the end (board.notifications.deliveries).

The statements themselves live in ``board/sql/transitions.sql``. Queue and agent counters
are kept by statement triggers on the same tables (``board/sql/schema/counters.sql``), so
every statement here keeps them in step without a statement of its own.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

import psycopg
from django.contrib.auth.base_user import AbstractBaseUser
from django.contrib.auth.models import AnonymousUser
from django.db import DatabaseError, OperationalError, connection, transaction
from django.db.models import JSONField, Model
from psycopg.types.json import Jsonb

from board import conf
from board.exceptions import (
    IdempotencyConflict,
    InvalidTransition,
    LeaseLost,
    PendingDeliveries,
    TaskNotFound,
    translated_database_errors,
)
from board.models import Delivery, QueueState, Task, TaskEvent, TaskStatus, Webhook
from board.sql import QUERIES

logger = logging.getLogger(__name__)

Actor = AbstractBaseUser | AnonymousUser | str
M = TypeVar("M", bound=Model)
T = TypeVar("T")

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
    _ensure_this_months_event_partitions()
    return _query(name, params)


def _query(name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    sql = _STATEMENTS.get(name) or QUERIES[name]
    with translated_database_errors(), connection.cursor() as cursor:
        if conf.database_prepared_statements():
            # Prepared on the session (a server-binding cursor on Django's connection):
            # PostgreSQL then plans each statement once for the session instead of at
            # every call, where planning the claim took longer than running it.
            session = cursor.cursor.connection
            with connection.wrap_database_errors, psycopg.Cursor(session) as prepared:
                try:
                    prepared.execute(sql, params, prepare=True)
                except psycopg.errors.FeatureNotSupported as exc:
                    # "cached plan must not change result type": a migration changed a
                    # table under a statement this session prepared. Drop the session's
                    # statements (psycopg notices DEALLOCATE ALL and forgets its own) and
                    # try once more, preparing afresh; not within a transaction, which the
                    # error has already lost.
                    if "cached plan" not in str(exc) or connection.in_atomic_block:
                        raise
                    prepared.execute("DEALLOCATE ALL")
                    prepared.execute(sql, params, prepare=True)
                columns = _column_names(prepared)
                return [dict(zip(columns, row, strict=True)) for row in prepared.fetchall()]
        cursor.execute(sql, params)
        columns = _column_names(cursor.cursor)
        return [dict(zip(columns, row, strict=True)) for row in cursor.fetchall()]


def _column_names(cursor: psycopg.Cursor[Any]) -> list[str]:
    """The names of the result's columns, read from the result itself: psycopg's
    ``description`` builds a Column object for each (20 us for a task's row, against 1 us
    for the names), and a transition needs only the names."""
    result = cursor.pgresult
    if result is None:
        return []
    return [(result.fname(i) or b"").decode() for i in range(result.nfields)]


# The claim's queue condition, spelled out in two statements instead of bound as a flag:
# PostgreSQL keeps one plan per prepared statement, and a plan made for "every queue" is
# not the one for "these queues" (and with client-side binding, the literal flag let the
# planner drop the condition, which a bound one would not).
# A claim of one task (the usual) has its LIMIT spelled out too: a generic plan costs a
# bound LIMIT as a tenth of the rows, which over a backlog of 100,000 pending tasks made
# PostgreSQL plan every claim afresh; with LIMIT 1 its generic plan is the index scan.
_QUEUE_CONDITION = "(%(all_queues)s OR queue = ANY(%(queues)s))"
_LIMIT = "LIMIT %(limit)s"
_STATEMENTS = {
    f"claim_{queues}{one}": QUERIES["claim"]
    .replace(_QUEUE_CONDITION, condition)
    .replace(_LIMIT, "LIMIT 1" if one else _LIMIT)
    for queues, condition in (("any_queue", "true"), ("in_queues", "queue = ANY(%(queues)s)"))
    for one in ("", "_one")
}
assert QUERIES["claim"].count(_QUEUE_CONDITION) == 2, "the claim's queue condition changed"
assert QUERIES["claim"].count(_LIMIT) == 3, "the claim's limits changed"


def claim_statement(queues: Sequence[str] | None, limit: int) -> str:
    """The name of the claim statement for these queues (None or empty: any queue) and
    this many tasks, in ``_STATEMENTS``."""
    return ("claim_in_queues" if queues else "claim_any_queue") + ("_one" if limit == 1 else "")


def _task(row: dict[str, Any]) -> Task:
    """Build a Task from a ``RETURNING *`` row, ignoring any extra columns."""
    return _instance(Task, _FIELDS, row)


_EVENT_FIELDS = {str(f.column): f for f in TaskEvent._meta.concrete_fields}


def _instance(model: type[M], fields: dict[str, Any], row: dict[str, Any]) -> M:
    names, values = [], []
    for column, field in fields.items():
        value = row[column]
        # Django leaves jsonb as text for the field to decode, as its query compiler would.
        if isinstance(field, JSONField):
            value = field.from_db_value(value, None, connection)  # type: ignore[arg-type]
        names.append(field.attname)
        values.append(value)
    return model.from_db(connection.alias, names, values)


def _task_status(task_id: int, actor: str = "") -> dict[str, Any]:
    """Read a task's status after a guard refused (TaskNotFound if there is none), and
    whether ``actor``'s attempt deadline passed."""
    rows = _rows("task_status", {"task_id": task_id, "actor": actor})
    if not rows:
        raise TaskNotFound(task_id)
    return rows[0]


def _current_status(task_id: int) -> str:
    return str(_task_status(task_id)["status"])


def _lease_lost(task_id: int, actor: str) -> LeaseLost:
    row = _task_status(task_id, actor)
    return LeaseLost(task_id, str(row["status"]), deadline_passed=bool(row["deadline_passed"]))


def _lease_rows(
    name: str, task_id: int, actor: Actor, lease_token: str, **params: Any
) -> list[dict[str, Any]]:
    """Run a holder's statement; no rows when the guard refused it."""
    try:
        token = uuid.UUID(str(lease_token))
    except ValueError:
        return []  # a malformed token matches no lease
    return _rows(
        name, {"task_id": task_id, "actor": _username(actor), "lease_token": token, **params}
    )


def _holder_transition(
    name: str, *, task_id: int, actor: Actor, lease_token: str, **params: Any
) -> Task:
    """Run a transition that only the live lease holder may make, or raise LeaseLost."""
    rows = _lease_rows(name, task_id, actor, lease_token, **params)
    if not rows:
        raise _lease_lost(task_id, _username(actor))
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
    depends_on: Sequence[int] = (),
    parent_id: int | None = None,
    max_attempt_seconds: int | None = None,
) -> Task:
    """Create a pending task and record its ``created`` event.

    With ``depends_on`` (ids of existing, older tasks) the task stays blocked until they
    are all done. ``max_attempt_seconds`` defaults to TASKBOARD_MAX_ATTEMPT_SECONDS.
    """
    attempt = {} if max_attempt_seconds is None else {"max_attempt_seconds": max_attempt_seconds}
    task, _ = create_once(
        actor=actor,
        idempotency_key=None,
        title=title,
        description=description,
        payload=payload,
        queue=queue,
        priority=priority,
        max_failures=max_failures,
        run_after=run_after,
        depends_on=depends_on,
        parent_id=parent_id,
        **attempt,
    )
    return task


def fingerprint(fields: dict[str, Any]) -> str:
    """Return the SHA-256 of a create's fields, to tell a retry from another request."""
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def create_once(*, actor: Actor, idempotency_key: str | None, **fields: Any) -> tuple[Task, bool]:
    """Create a task unless ``actor`` already created one with ``idempotency_key``.

    Fields left out get their defaults; ``max_attempt_seconds`` left out gets
    TASKBOARD_MAX_ATTEMPT_SECONDS, and given as None means no limit.

    Return the task and whether this call created it. A key repeated with the same fields
    returns the task its first use created, as it is now; with other fields it raises
    IdempotencyConflict. Keys are unique per creator in the database, so two racing
    requests with one key create one task: the second waits for the first to commit.
    """
    fields = {
        "description": "",
        "payload": {},
        "queue": "default",
        "priority": 0,
        "max_failures": None,
        "run_after": None,
        "parent_id": None,
        "max_attempt_seconds": conf.max_attempt_seconds(),
        **fields,
    }
    fields["payload"] = fields["payload"] if fields["payload"] is not None else {}
    if fields["max_failures"] is None:
        fields["max_failures"] = conf.max_failures()
    fields["depends_on"] = sorted(set(fields.get("depends_on") or ()))
    username = _username(actor)
    digest = fingerprint(fields) if idempotency_key is not None else None
    params = {
        **fields,
        "actor": username,
        "payload": Jsonb(fields["payload"]),
        "idempotency_key": idempotency_key,
        "idempotency_fingerprint": digest,
    }
    rows = _rows("create", params)
    if rows:
        return _task(rows[0]), True
    # The key's first create has committed (the insert waited for it): read what it made.
    rows = _rows("created_with_key", {"actor": username, "idempotency_key": idempotency_key})
    task = _task(rows[0])
    if task.idempotency_fingerprint != digest:
        raise IdempotencyConflict(str(idempotency_key), task.pk)
    return task, False


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
        "queues": list(queues or []),
        "lease_seconds": lease_seconds or conf.lease_seconds(),
    }
    claims: list[Claim] = []
    # Each round is one statement, hence one transaction of its own: the usual claim is
    # a single round trip. Only a round that escalated a candidate is followed by another.
    while len(claims) < limit:
        wanted = limit - len(claims)
        rows = _rows(claim_statement(queues, wanted), {**params, "limit": wanted})
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
    """Mark the holder's task done with ``result``, and unblock what waited for it.

    The usual task, which nothing depends on, is completed by one statement in a
    transaction of its own (no BEGIN and COMMIT round trips). That statement refuses a task
    with ``has_dependents``, read in the row's latest version (a create that adds an edge
    locks the row and sets it first); such a task is completed in a transaction together
    with unblock_dependents, whose own snapshot sees the new edges.
    """
    params = {"result": _json(result)}
    rows = _lease_rows("complete", task_id, actor, lease_token, alone=True, **params)
    if rows:
        return _task(rows[0])
    with transaction.atomic():
        task = _holder_transition(
            "complete", task_id=task_id, actor=actor, lease_token=lease_token, alone=False, **params
        )
        if task.has_dependents:
            _rows("unblock_dependents", {"task_id": task.pk})
    return task


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


def requeue(
    *,
    task_id: int,
    actor: Actor,
    note: str | None = None,
    from_statuses: Sequence[str] = REQUEUE_FROM,
) -> Task:
    """Put an escalated, done or cancelled task back to pending with its strikes reset.

    ``from_statuses`` narrows the statuses it applies to, checked under the task's row lock:
    the escalation queue passes only escalated, so that a requeue racing another human's
    resolve or cancel does not undo it.
    """
    allowed = _narrowed(from_statuses, REQUEUE_FROM)
    params = {"task_id": task_id, "actor": _username(actor), "note": note, "from": list(allowed)}
    with transaction.atomic():
        rows = _rows("requeue", params)
        if not rows:
            raise InvalidTransition(task_id, _current_status(task_id), "requeue", allowed)
        if rows[0]["previous_status"] == TaskStatus.DONE and rows[0]["has_dependents"]:
            # Open again: the tasks that depend on it wait for it again.
            _rows("reblock_dependents", {"task_id": task_id})
    return _task(rows[0])


def resolve(*, task_id: int, actor: Actor, note: str | None = None, result: Any = None) -> Task:
    """Settle an escalated task as done by hand, with a note and an optional result."""
    with transaction.atomic():
        task = _human_transition(
            "resolve",
            task_id=task_id,
            actor=actor,
            allowed=RESOLVE_FROM,
            note=note,
            result=_json(result),
        )
        if task.has_dependents:
            _rows("unblock_dependents", {"task_id": task.pk})
    return task


def cancel(
    *,
    task_id: int,
    actor: Actor,
    note: str | None = None,
    from_statuses: Sequence[str] = CANCEL_FROM,
) -> Task:
    """Withdraw a pending or escalated task (``from_statuses``: only those, as for
    :func:`requeue`)."""
    allowed = _narrowed(from_statuses, CANCEL_FROM)
    return _human_transition(
        "cancel",
        task_id=task_id,
        actor=actor,
        allowed=allowed,
        note=note,
        **{"from": list(allowed)},
    )


def _narrowed(statuses: Sequence[str], allowed: Sequence[str]) -> tuple[str, ...]:
    """``statuses`` as a tuple, if every one is among ``allowed``."""
    if not statuses or not set(statuses) <= set(allowed):
        raise ValueError(f"{list(statuses)} is not a part of {list(allowed)}")
    return tuple(str(status) for status in statuses)


def comment(*, task_id: int, actor: Actor, body: str) -> TaskEvent:
    """Add a ``commented`` event to a task's history, in any status."""
    rows = _rows("comment", {"task_id": task_id, "actor": _username(actor), "body": body})
    if not rows:
        raise TaskNotFound(task_id)
    return _instance(TaskEvent, _EVENT_FIELDS, rows[0])


def _set_paused(queue: str, actor: Actor, note: str | None, paused: bool) -> QueueState:
    rows = _rows(
        "set_queue_paused",
        {"queue": queue, "actor": _username(actor), "note": note, "paused": paused},
    )
    row = rows[0]
    return QueueState(
        name=row["name"],
        paused=row["paused"],
        changed_at=row["changed_at"],
        changed_by=row["changed_by"],
        note=row["note"],
    )


def pause_queue(*, queue: str, actor: Actor, note: str | None = None) -> QueueState:
    """Stop claims from handing out ``queue``'s tasks (leases already held run on)."""
    return _set_paused(queue, actor, note, True)


def resume_queue(*, queue: str, actor: Actor, note: str | None = None) -> QueueState:
    """Let claims take ``queue``'s tasks again, and wake the claims waiting for them."""
    return _set_paused(queue, actor, note, False)


# --- the event log's partitions (board/sql/schema/event_log.sql) ----------------------------

# The UTC month (year, month) for which this process made sure of its event partitions, and
# when it may try again after a failure.
_event_partitions_month: tuple[int, int] | None = None
_event_partitions_retry_at = 0.0
PARTITION_RETRY_SECONDS = 10.0


def _month_start(at: datetime, months_later: int = 0) -> datetime:
    index = at.astimezone(UTC).year * 12 + at.astimezone(UTC).month - 1 + months_later
    return datetime(index // 12, index % 12 + 1, 1, tzinfo=UTC)


def _ensure_this_months_event_partitions() -> None:
    """Make sure, at most once per process and month, that the month's partition of
    task_events and the next month's exist, before a transition writes events.

    The next month's too, so that at the turn of the month the partition is there already,
    whichever clock (this process's or the database's) turns first. Should this fail (its
    locks wait at most 200 ms: see board/sql/schema/event_log.sql), the transition goes on,
    its events land in the DEFAULT partition if the month has none, and a transition tries
    again 10 s later.
    """
    global _event_partitions_month, _event_partitions_retry_at
    now = datetime.now(UTC)
    if _event_partitions_month == (now.year, now.month):
        return
    if time.monotonic() < _event_partitions_retry_at:
        return
    try:
        ensure_event_partitions(at=now, months_ahead=1, attempts=1)
    except DatabaseError as exc:
        logger.warning("could not create the event log's partitions for %s: %s", now, exc)
        _event_partitions_retry_at = time.monotonic() + PARTITION_RETRY_SECONDS
        return
    _event_partitions_month = (now.year, now.month)


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


def event_partitions_supported() -> bool:
    """Return whether task_events is partitioned (the database has migration 0011)."""
    return bool(_query("event_partitions_supported", {})[0]["supported"])


def ensure_event_partitions(
    *, at: datetime | None = None, months_ahead: int = 1, attempts: int = 20
) -> list[str]:
    """Create the partitions of task_events for the UTC month of ``at`` (default: now) and
    the ``months_ahead`` months after it, those that do not exist yet; return their names.

    Runs in a savepoint of the caller's transaction, or in transactions of its own (retried
    up to ``attempts`` times when a lock was busy); a database before migration 0011 has
    nothing to create.
    """
    start = at or datetime.now(UTC)

    def ensure() -> list[str]:
        with transaction.atomic():
            if not event_partitions_supported():
                return []
            return [
                str(
                    _query("ensure_event_partition", {"at": _month_start(start, n)})[0]["partition"]
                )
                for n in range(months_ahead + 1)
            ]

    return _retrying_lock_timeouts(ensure, attempts)


def split_default_event_partition(*, before: datetime) -> list[datetime]:
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


def month_after(month: datetime) -> datetime:
    """The first instant of the month after ``month`` (the first instant of a month)."""
    return month.replace(year=month.year + month.month // 12, month=month.month % 12 + 1)


def drop_event_partition(*, month: datetime, count: int, id_sum: int) -> int:
    """Detach and drop the partition of task_events for ``month`` (its first instant, UTC),
    in one transaction, after checking under its lock that it holds exactly ``count``
    events whose ids sum to ``id_sum`` (what the archive file holds) and that no delivery
    of its events is pending; return the number of events dropped.

    Raises :class:`~board.exceptions.ArchiveMismatch` or
    :class:`~board.exceptions.PendingDeliveries` (and drops nothing) when either fails.
    The locks that the drop takes are taken first (lock_event_log), so that the check of
    the deliveries still holds when the partition goes: no event of the month (nor its
    deliveries) is written meanwhile, and a staff retry of a failed delivery waits for the
    drop and then finds its event gone (retry_deliveries). A transaction of its own, or
    the caller's; busy locks are retried only in its own.
    """

    def drop() -> int:
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

    return _retrying_lock_timeouts(drop, attempts=20)


_WEBHOOK_FIELDS = {str(f.column): f for f in Webhook._meta.concrete_fields}
_DELIVERY_FIELDS = {str(f.column): f for f in Delivery._meta.concrete_fields}


def create_webhook(
    *,
    actor: Actor,
    url: str,
    events: Sequence[str],
    queues: Sequence[str] | None,
    secret: str,
    format: str = "json",
) -> Webhook:
    """Add a webhook: every later event of ``events`` in ``queues`` (None: all) is sent."""
    rows = _rows(
        "create_webhook",
        {
            "actor": _username(actor),
            "url": url,
            "events": list(events),
            "queues": None if queues is None else list(queues),
            "secret": secret,
            "format": format,
        },
    )
    return _instance(Webhook, _WEBHOOK_FIELDS, rows[0])


def delete_webhook(*, webhook_id: int, actor: Actor) -> bool:
    """Remove a webhook and its deliveries; return whether there was one."""
    _username(actor)
    return bool(_rows("delete_webhook", {"webhook_id": webhook_id}))


def set_email_channel(*, active: bool) -> Webhook:
    """Turn the escalation emails (EMAIL_URL) on or off."""
    return _instance(Webhook, _WEBHOOK_FIELDS, _rows("set_email_channel", {"active": active})[0])


def queue_password_reset(*, address: str) -> None:
    """Queue a password reset email to ``address`` (board.notifications.deliveries sends it, to each
    account of that address, if any), and turn the email channel on first if no server
    process has yet (the form is served only when EMAIL_URL is set)."""
    if not _rows("queue_password_reset", {"address": address}):
        set_email_channel(active=True)
        _rows("queue_password_reset", {"address": address})


def claim_deliveries(*, limit: int, lease_seconds: float) -> list[Delivery]:
    """Lease up to ``limit`` due deliveries to the caller (SKIP LOCKED), counting an attempt."""
    rows = _rows("claim_deliveries", {"limit": limit, "lease_seconds": lease_seconds})
    return [_instance(Delivery, _DELIVERY_FIELDS, row) for row in rows]


def record_delivery(
    *,
    delivery_id: int,
    lease_token: uuid.UUID,
    delivered: bool,
    status_code: int | None = None,
    error: str | None = None,
    retry_in: float = 0,
    horizon_seconds: float = 0,
) -> str | None:
    """Record the outcome of an attempt made under ``lease_token``.

    Return the delivery's status afterwards (delivered; pending for a retry in ``retry_in``
    seconds, or at the horizon when that would pass it; or failed when this attempt was at
    or after the horizon), or None when the lease was no
    longer the caller's (it ran out and another process took the delivery, or the webhook
    was deleted): then nothing is recorded.
    """
    params = {"delivery_id": delivery_id, "lease_token": lease_token, "status_code": status_code}
    if delivered:
        return "delivered" if _rows("delivery_succeeded", params) else None
    rows = _rows(
        "delivery_attempt_failed",
        {**params, "error": error, "retry_in": retry_in, "horizon_seconds": horizon_seconds},
    )
    return str(rows[0]["status"]) if rows else None


def retry_deliveries(*, delivery_ids: Sequence[int], actor: Actor) -> int:
    """Re-arm failed deliveries (staff): due now, for a new horizon. Return how many."""
    _username(actor)
    return len(_rows("retry_deliveries", {"delivery_ids": list(delivery_ids)}))
