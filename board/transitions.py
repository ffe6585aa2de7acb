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
    in_progress ──ask──▶ awaiting_input ──answer──▶ pending (held for the asker a while)
                              └── no answer by its deadline, found by the next claim ─▶ escalated

Humans in the loop: the holder may ``ask`` a person instead of failing; the lease ends
without a strike, and the task waits for an ``answer`` (board.questions says what answers
it). The answer makes it pending again, held for the agent that asked for
TASKBOARD_ANSWER_HOLD_SECONDS: other claims pass it by, the asker's claim takes it first.
A question unanswered by its deadline is escalated by the next claim on its queue, as an
expired lease is recorded. A task with an ``assignee`` is claimed only by that user, one
that ``requires`` labels only by a user whose capabilities include them.

Work graphs: a task created with ``depends_on`` is pending but blocked (not claimable)
until every dependency is done; the transition that makes the last one done (complete,
resolve) records ``unblocked`` for it in the same transaction. Comments are events
without a change of status. Pausing a queue takes its tasks out of claims.

The statements themselves live in ``board/sql/transitions.sql``. What else a transition
does is done by triggers on the same tables, in the same statement: queue and agent
counters (``board/sql/schema/counters.sql``), a webhook's delivery for an event
(``board/sql/schema/deliveries.sql``; board.notifications.deliveries sends them), so every
statement here keeps them in step without a statement of its own. Before a statement that
writes events, board.partitions makes sure that their month has its partition.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.contrib.auth.base_user import AbstractBaseUser
from django.contrib.auth.models import AnonymousUser
from django.db import transaction
from psycopg.types.json import Jsonb

from board import conf, partitions, questions, sql
from board.exceptions import IdempotencyConflict, InvalidTransition, LeaseLost, TaskNotFound
from board.models import QueueState, Task, TaskEvent, TaskStatus
from board.sql import QUERIES

Actor = AbstractBaseUser | AnonymousUser | str


@dataclass(frozen=True)
class Claim:
    """A task handed out by :func:`claim`, with the secret its holder must present."""

    task: Task
    lease_token: str


def actor_name(actor: Actor) -> str:
    """The name an actor is recorded by: its username, or the name given as a string."""
    if isinstance(actor, str):
        return actor
    if not actor.is_authenticated:
        raise ValueError("Transitions need an authenticated actor.")
    return str(actor.get_username())


def _json(value: Any) -> Jsonb | None:
    return None if value is None else Jsonb(value)


def _rows(name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    """Run the named statement, one that writes events, and return its rows as dicts."""
    partitions.make_sure_of_this_month()
    return _run(name, params)


def _run(name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    """Run the named statement, one that writes no event, and return its rows as dicts."""
    return sql.run(QUERIES[name], params)


def claim_statement(queues: Sequence[str] | None, limit: int) -> str:
    """The name of the claim statement for these queues (None or empty: any queue) and
    this many tasks (board/sql/transitions.sql names its variants)."""
    return ("claim_in_queues" if queues else "claim_any_queue") + ("_one" if limit == 1 else "")


def _task(row: dict[str, Any]) -> Task:
    """Build a Task from a ``RETURNING *`` row, ignoring any extra columns."""
    return sql.instance(Task, row)


def _task_status(task_id: int, actor: str = "") -> dict[str, Any]:
    """Read a task's status after a guard refused (TaskNotFound if there is none), and
    whether ``actor``'s attempt deadline passed."""
    rows = _run("task_status", {"task_id": task_id, "actor": actor})
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
        name, {"task_id": task_id, "actor": actor_name(actor), "lease_token": token, **params}
    )


def _holder_transition(
    name: str, *, task_id: int, actor: Actor, lease_token: str, **params: Any
) -> Task:
    """Run a transition that only the live lease holder may make, or raise LeaseLost."""
    rows = _lease_rows(name, task_id, actor, lease_token, **params)
    if not rows:
        raise _lease_lost(task_id, actor_name(actor))
    return _task(rows[0])


def _human_transition(
    name: str, *, task_id: int, actor: Actor, allowed: tuple[str, ...], **params: Any
) -> Task:
    """Run a staff transition guarded by the task's status, or raise InvalidTransition."""
    rows = _rows(name, {"task_id": task_id, "actor": actor_name(actor), **params})
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
    assignee: str | None = None,
    requires: Sequence[str] = (),
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
        assignee=assignee,
        requires=requires,
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
    # Left out of the fingerprint when not given, so that it reads as it did without them.
    if fields.get("assignee") is None:
        fields.pop("assignee", None)
    if fields.get("requires"):
        fields["requires"] = sorted(set(fields["requires"]))
    else:
        fields.pop("requires", None)
    fields["payload"] = fields["payload"] if fields["payload"] is not None else {}
    if fields["max_failures"] is None:
        fields["max_failures"] = conf.max_failures()
    fields["depends_on"] = sorted(set(fields.get("depends_on") or ()))
    username = actor_name(actor)
    digest = fingerprint(fields) if idempotency_key is not None else None
    params = {
        **fields,
        "actor": username,
        "payload": Jsonb(fields["payload"]),
        "idempotency_key": idempotency_key,
        "idempotency_fingerprint": digest,
        "assignee": fields.get("assignee"),
        "requires": fields.get("requires", []),
    }
    rows = _rows("create", params)
    if rows:
        return _task(rows[0]), True
    # The key's first create has committed (the insert waited for it): read what it made.
    rows = _run("created_with_key", {"actor": username, "idempotency_key": idempotency_key})
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
        "actor": actor_name(actor),
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


def ask(
    *,
    task_id: int,
    actor: Actor,
    lease_token: str,
    question: str,
    options: Sequence[str] | None = None,
    answer_schema: dict[str, Any] | None = None,
    assignee: str | None = None,
    answer_within: int | None = None,
    action_digest: str | None = None,
) -> Task:
    """The holder asks a person: the lease ends without a strike and the task awaits input.

    ``answer_within`` (seconds, default TASKBOARD_ANSWER_WITHIN) sets the deadline past
    which the next claim on the task's queue escalates it.
    """
    return _holder_transition(
        "ask",
        task_id=task_id,
        actor=actor,
        lease_token=lease_token,
        question=question,
        options=_json(list(options) if options else None),
        answer_schema=_json(answer_schema),
        assignee=assignee,
        answer_within=answer_within or conf.answer_within(),
        action_digest=action_digest,
    )


ANSWER_FROM = (TaskStatus.AWAITING_INPUT,)


def answer(*, task_id: int, actor: Actor, answer: Any, note: str | None = None) -> Task:
    """Answer the task's open question: pending again, held for the agent that asked.

    The answer is checked against the question it answers (board.questions.check_answer:
    InvalidAnswer when it does not); the statement answers only that question, so a
    second answer to it finds the task no longer awaiting input (InvalidTransition).
    """
    rows = _run("open_question", {"task_id": task_id})
    if not rows:
        raise TaskNotFound(task_id)
    question = rows[0]["question"]
    if isinstance(question, str):  # Django's connections hand jsonb over as text
        question = json.loads(question)
    if question is None:
        raise InvalidTransition(task_id, str(rows[0]["status"]), "answer", ANSWER_FROM)
    questions.check_answer(question, answer)
    return _human_transition(
        "answer",
        task_id=task_id,
        actor=actor,
        allowed=ANSWER_FROM,
        answer=Jsonb(answer),
        note=note,
        question_event=int(question["event_id"]),
        hold_seconds=conf.answer_hold_seconds(),
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
    params = {"task_id": task_id, "actor": actor_name(actor), "note": note, "from": list(allowed)}
    with transaction.atomic():
        rows = _rows("requeue", params)
        if not rows:
            raise InvalidTransition(task_id, _current_status(task_id), "requeue", allowed)
        if rows[0]["previous_status"] == TaskStatus.DONE and rows[0]["has_dependents"]:
            # Open again: the tasks that depend on it wait for it again.
            _run("reblock_dependents", {"task_id": task_id})
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
    rows = _rows("comment", {"task_id": task_id, "actor": actor_name(actor), "body": body})
    if not rows:
        raise TaskNotFound(task_id)
    return sql.instance(TaskEvent, rows[0])


def _set_paused(queue: str, actor: Actor, note: str | None, paused: bool) -> QueueState:
    rows = _run(
        "set_queue_paused",
        {"queue": queue, "actor": actor_name(actor), "note": note, "paused": paused},
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
