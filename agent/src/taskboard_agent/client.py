"""A Python client for the Taskboard API v1 (docs/tutorials/python-client.md).

It needs nothing but httpx, and never imports Django: an agent installs the package and
imports ``taskboard_agent.client`` on a machine that runs no server.

::

    from taskboard_agent.client import Client

    with Client("http://127.0.0.1:8000", token) as board:
        while True:
            for task in board.claim(queues=["images"], wait=30, lease_seconds=60):
                with board.lease(task) as lease:  # heartbeats in the background
                    result = resize(task.payload, stop_if=lambda: lease.lost)
                    if not lease.lost:
                        lease.complete(result)

Every method maps to one endpoint of the contract and returns typed results (:class:`Task`,
:class:`ClaimedTask`, :class:`Event`, :class:`Page`). Refusals raise a subclass of
:class:`TaskboardError`. Requests that fail to reach the server, and ``503`` answers, are
retried with bounded exponential backoff and jitter; ``4xx`` answers never are.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import Any, Generic, Self, TypedDict, TypeVar, Unpack

import httpx

__all__ = [
    "NO_LIMIT",
    "Agent",
    "Answer",
    "AuthenticationError",
    "AwaitingInput",
    "ClaimedTask",
    "Client",
    "Conflict",
    "Event",
    "ForbiddenQueue",
    "IdempotencyConflict",
    "InvalidTransition",
    "Lease",
    "LeaseLost",
    "NoLimit",
    "NotFound",
    "Page",
    "PayloadTooLarge",
    "PermissionDenied",
    "Question",
    "Queue",
    "RateLimited",
    "RequestTimeout",
    "Task",
    "TaskboardError",
    "Throttled",
    "Unavailable",
    "ValidationError",
]

logger = logging.getLogger(__name__)

API = "/api/v1"
STREAM_PATH = f"{API}/stream/"
USER_AGENT = "taskboard-client/0.1"
# The most queues GET queues/ answers at once.
QUEUE_PAGE = 1000
# Seconds the server may hold a waiting claim (the contract's maximum ``wait``).
MAX_WAIT = 60.0
# Seconds between two looks at a task awaiting input, at first and at most: the pause
# doubles from the first to the last, so that a quick answer is seen quickly and a long
# wait for a person costs a request every few seconds.
ANSWER_POLL_FIRST = 0.25
ANSWER_POLL_MAX = 5.0
# Claims a wait for an answer makes at most in a row when each hands out another task than
# the one asked about (held for this agent too, say): each is handed on or released.
CLAIM_BACK_TRIES = 3


class NoLimit(enum.Enum):
    """The type of :data:`NO_LIMIT`."""

    NO_LIMIT = "NO_LIMIT"

    def __repr__(self) -> str:
        return "NO_LIMIT"


# ``create(max_attempt_seconds=NO_LIMIT)``: no attempt deadline, whatever the server's
# default (the API's explicit null; None, as for every argument, leaves it out).
NO_LIMIT = NoLimit.NO_LIMIT


# -- Errors ------------------------------------------------------------------------------


class TaskboardError(Exception):
    """The server refused a request, or could not be reached.

    ``status`` is the HTTP status (None when no answer came), ``code`` the contract's
    machine-readable ``error``, ``detail`` its sentence, ``fields`` the messages for each
    refused field (400 only), and ``task_status`` the task's status on a 409.
    """

    def __init__(
        self,
        detail: str,
        *,
        status: int | None = None,
        code: str = "error",
        fields: Mapping[str, list[str]] | None = None,
        task_status: str | None = None,
        body: Any = None,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.code = code
        self.detail = detail
        self.fields: dict[str, list[str]] = dict(fields or {})
        self.task_status = task_status
        self.body = body

    def __str__(self) -> str:
        prefix = f"{self.status} {self.code}" if self.status else self.code
        return f"{prefix}: {self.detail}"


class ValidationError(TaskboardError):
    """400: the request was invalid; ``fields`` says what is wrong with which field."""


class AuthenticationError(TaskboardError):
    """401: no token, or one the server does not know."""


class PermissionDenied(TaskboardError):
    """403: authenticated, but not allowed (a staff action by a user who may not triage)."""


class ForbiddenQueue(PermissionDenied):
    """403 forbidden_queue: this agent is limited to other queues (``create_agent
    --queues``) than the one it asked to create in, claim from or act on."""


class NotFound(TaskboardError):
    """404: no such task."""


class Conflict(TaskboardError):
    """409: the task's state does not allow the request."""


class LeaseLost(Conflict):
    """409 lease_lost: you do not hold a live lease on the task. Stop working on it."""


class InvalidTransition(Conflict):
    """409 invalid_transition: the task's status does not allow this staff action."""


class IdempotencyConflict(Conflict):
    """409 idempotency_conflict: you created a task with this ``Idempotency-Key`` before,
    with another body. Nothing was created; use a new key for a new task."""


class RequestTimeout(TaskboardError):
    """408: the request body did not arrive within the server's time limit; nothing was
    done (a very slow network, or a stalled sender)."""


class PayloadTooLarge(TaskboardError):
    """413: the request body is over the server's limit (1 MiB)."""


class Throttled(TaskboardError):
    """429 throttled: too many failed authentications came from your address lately.

    Every request from it is refused, a valid token included, for ``retry_after`` seconds
    (the server's ``Retry-After``). The client does not retry it by itself: a refused
    request had no effect, so repeating it later is safe, but waiting up to a minute
    inside a call would stall a heartbeat past its lease, and the cause (a wrong token
    here or on another machine behind the same address) needs fixing first.
    """

    def __init__(self, detail: str, *, retry_after: float | None = None, **kwargs: Any) -> None:
        super().__init__(detail, **kwargs)
        self.retry_after = retry_after


class RateLimited(TaskboardError):
    """429 rate_limited: you created more tasks, or wrote more comments, in the last minute
    than the server's per-user rate allows (``TASKBOARD_CREATE_RATE``,
    ``TASKBOARD_COMMENT_RATE``). Nothing was done; the same request is accepted after
    ``retry_after`` seconds (the server's ``Retry-After``). Not retried by the client: the
    wait can be a minute or more, longer than a caller may want to be held.
    """

    def __init__(self, detail: str, *, retry_after: float | None = None, **kwargs: Any) -> None:
        super().__init__(detail, **kwargs)
        self.retry_after = retry_after


class AwaitingInput(TaskboardError):
    """The question is asked, and its answer did not come within the wait (or was not
    waited for): the task is ``awaiting_input``, and no lease is held on it.

    ``task`` is the task as last seen (its ``question`` is the open one). Not a refusal:
    the answer comes with the task to the next claim that takes it, this agent's first
    (the task is held for the asker for a while after the answer).
    """

    def __init__(self, detail: str, *, task: Task | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("code", "awaiting_input")
        kwargs.setdefault("task_status", task.status if task is not None else None)
        super().__init__(detail, **kwargs)
        self.task = task


class Unavailable(TaskboardError):
    """503, or no answer at all (connection refused, timed out), after the retries;
    ``retry_after``: the 503's Retry-After, in seconds."""

    retry_after: float | None = None


_BY_STATUS: dict[int, type[TaskboardError]] = {
    400: ValidationError,
    401: AuthenticationError,
    403: PermissionDenied,
    404: NotFound,
    408: RequestTimeout,
    409: Conflict,
    413: PayloadTooLarge,
    429: Throttled,
    503: Unavailable,
}
_BY_CODE: dict[str, type[TaskboardError]] = {
    "lease_lost": LeaseLost,
    "invalid_transition": InvalidTransition,
    "idempotency_conflict": IdempotencyConflict,
    "forbidden_queue": ForbiddenQueue,
    "rate_limited": RateLimited,
}


# Answers after which a request is tried again: the board's 503 (its database is
# unavailable: nothing was done), and a proxy's 502 and 504 (the board was not reached, or
# did not answer in time: only repeatable requests, and the stream).
GATEWAY_ERRORS = frozenset({502, 504})
RETRIED_STATUSES = frozenset({503}) | GATEWAY_ERRORS


def error_from_response(response: httpx.Response) -> TaskboardError:
    """Return the exception for an error ``response`` (any status >= 400)."""
    error = _error_from_response(response)
    if isinstance(error, Throttled | RateLimited | Unavailable):
        with contextlib.suppress(ValueError):
            error.retry_after = float(response.headers.get("Retry-After", ""))
    return error


def _error_from_response(response: httpx.Response) -> TaskboardError:
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        text = response.text.strip()[:500] or response.reason_phrase
        return _BY_STATUS.get(response.status_code, TaskboardError)(
            text, status=response.status_code, code=f"http_{response.status_code}", body=body
        )
    code = str(body.get("error") or f"http_{response.status_code}")
    cls = _BY_CODE.get(code) or _BY_STATUS.get(response.status_code, TaskboardError)
    fields = body.get("fields")
    return cls(
        str(body.get("detail") or code),
        status=response.status_code,
        code=code,
        fields=fields if isinstance(fields, dict) else None,
        task_status=body.get("status") if response.status_code == 409 else None,
        body=body,
    )


# -- Results -----------------------------------------------------------------------------


def parse_time(value: str | None) -> datetime | None:
    """Parse one of the API's ISO 8601 times (always with a UTC offset), or None."""
    return None if value is None else datetime.fromisoformat(value)


@dataclass(frozen=True, kw_only=True)
class Question:
    """A question an agent asked a person about a task (``Task.question`` while it is
    open). ``event_id`` is its ``asked`` event; ``options`` the answers to choose from, or
    ``answer_schema`` the JSON Schema the answer must validate against (or neither: a
    text); ``answer_by`` when it escalates unanswered; ``action_digest`` what the agent
    said it will do once approved (the answer repeats it)."""

    event_id: int
    question: str
    options: list[str] | None = None
    answer_schema: dict[str, Any] | None = None
    assignee: str | None = None
    answer_by: datetime | None = None
    action_digest: str | None = None
    asked_by: str | None = None
    asked_at: datetime | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Question:
        return cls(**_question_fields(data))


@dataclass(frozen=True, kw_only=True)
class Answer(Question):
    """A question and the answer a person gave it (``Task.answers``, oldest first)."""

    answer: Any = None
    note: str | None = None
    answered_by: str | None = None
    answered_at: datetime | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Answer:
        return cls(
            **_question_fields(data),
            answer=data.get("answer"),
            note=data.get("note"),
            answered_by=data.get("answered_by"),
            answered_at=parse_time(data.get("answered_at")),
        )


def _question_fields(data: Mapping[str, Any]) -> dict[str, Any]:
    options = data.get("options")
    return {
        "event_id": int(data["event_id"]),
        "question": data.get("question", ""),
        "options": list(options) if options is not None else None,
        "answer_schema": data.get("answer_schema"),
        "assignee": data.get("assignee"),
        "answer_by": parse_time(data.get("answer_by")),
        "action_digest": data.get("action_digest"),
        "asked_by": data.get("asked_by"),
        "asked_at": parse_time(data.get("asked_at")),
        "raw": dict(data),
    }


@dataclass(frozen=True, kw_only=True)
class Task:
    """A task as the API renders it. ``raw`` is the JSON object it was read from."""

    id: int
    title: str
    description: str
    payload: dict[str, Any]
    queue: str
    priority: int
    max_failures: int
    run_after: datetime | None
    status: str
    failure_count: int
    leased_by: str | None
    leased_until: datetime | None
    lease_expired: bool
    result: Any
    last_error: str | None
    created_by: str
    created_at: datetime
    updated_at: datetime
    #: Ids of the tasks this one waits for (it is ``blocked`` while one is not done).
    depends_on: list[int] = field(default_factory=list)
    blocked: bool = False
    parent_id: int | None = None
    #: The latest progress a heartbeat reported: the next holder resumes from it.
    progress: Any = None
    max_attempt_seconds: int | None = None
    attempt_started_at: datetime | None = None
    idempotency_key: str | None = None
    #: The only user who may claim the task, or None: anyone may.
    assignee: str | None = None
    #: The capabilities a claimant must have, every one, to take the task.
    requires: list[str] = field(default_factory=list)
    #: The question asked and not answered yet (the task is ``awaiting_input``), or None.
    question: Question | None = None
    #: Every question asked about the task and answered, oldest first: what people said,
    #: for the attempt that holds the task now.
    answers: list[Answer] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Task:
        return cls(**_task_fields(data))

    def answer_to(self, question: Question | int) -> Answer | None:
        """The answer to ``question`` (or to the question of that ``asked`` event id), or
        None while it has none."""
        event_id = question if isinstance(question, int) else question.event_id
        return next((answer for answer in self.answers if answer.event_id == event_id), None)

    @property
    def attempt_deadline(self) -> datetime | None:
        """When the current attempt must end, however often it heartbeats (or None)."""
        if self.attempt_started_at is None or self.max_attempt_seconds is None:
            return None
        return self.attempt_started_at + timedelta(seconds=self.max_attempt_seconds)


@dataclass(frozen=True, kw_only=True)
class ClaimedTask(Task):
    """A task you hold a lease on, as a claim returned it.

    ``lease_seconds`` is the lease length asked for (or, when the claim asked for none,
    estimated from ``leased_until``); ``claimed_at`` is the ``time.monotonic()`` at which
    the server claimed the task, as this machine places it: the lease runs out about
    ``claimed_at + lease_seconds`` on this machine's clock. The claim happened between
    sending the request and reading its answer, which may be ``wait`` seconds apart; the
    two clocks place it within that span (the claim's ``attempt_started_at`` against this
    machine's time), and where they cannot, it counts from the sending, erring early.
    """

    lease_token: str = field(repr=False)
    lease_seconds: float = 0.0
    claimed_at: float = field(default=0.0, repr=False, compare=False)


def _task_fields(data: Mapping[str, Any]) -> dict[str, Any]:
    # Fields the contract may add later are kept in ``raw`` only.
    return {
        "id": int(data["id"]),
        "title": data["title"],
        "description": data.get("description", ""),
        "payload": data.get("payload") or {},
        "queue": data["queue"],
        "priority": int(data.get("priority", 0)),
        "max_failures": int(data.get("max_failures", 0)),
        "run_after": parse_time(data.get("run_after")),
        "status": data["status"],
        "failure_count": int(data.get("failure_count", 0)),
        "leased_by": data.get("leased_by"),
        "leased_until": parse_time(data.get("leased_until")),
        "lease_expired": bool(data.get("lease_expired", False)),
        "result": data.get("result"),
        "last_error": data.get("last_error"),
        "created_by": data.get("created_by", ""),
        "created_at": parse_time(data["created_at"]),
        "updated_at": parse_time(data["updated_at"]),
        # Absent from the answers of servers older than these fields.
        "depends_on": [int(task_id) for task_id in data.get("depends_on") or []],
        "blocked": bool(data.get("blocked", False)),
        "parent_id": _optional_int(data.get("parent_id")),
        "progress": data.get("progress"),
        "max_attempt_seconds": _optional_int(data.get("max_attempt_seconds")),
        "attempt_started_at": parse_time(data.get("attempt_started_at")),
        "idempotency_key": data.get("idempotency_key"),
        "assignee": data.get("assignee"),
        "requires": [str(label) for label in data.get("requires") or []],
        "question": Question.from_json(data["question"]) if data.get("question") else None,
        "answers": [Answer.from_json(answer) for answer in data.get("answers") or []],
        "raw": dict(data),
    }


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


@dataclass(frozen=True, kw_only=True)
class Event:
    """One entry of the append-only audit log.

    ``stream_id`` is the SSE ``id:`` it came with (events read from the stream only): pass
    it to :meth:`Client.stream` as ``last_event_id`` to resume after it. ``task`` is the
    task as it was right after the event (events read from the stream only; None when a
    later event of the task had already committed, which then carries it).
    """

    id: int
    task_id: int
    type: str
    status: str
    actor: str
    payload: dict[str, Any]
    created_at: datetime
    stream_id: str | None = None
    task: Task | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any], stream_id: str | None = None) -> Event:
        return cls(
            id=int(data["id"]),
            task_id=int(data["task_id"]),
            type=data["type"],
            status=data["status"],
            actor=data["actor"],
            payload=data.get("payload") or {},
            created_at=datetime.fromisoformat(data["created_at"]),
            stream_id=stream_id,
            task=Task.from_json(data["task"]) if data.get("task") else None,
        )


@dataclass(frozen=True, kw_only=True)
class Queue:
    """A queue at a glance (``GET queues/``): whether it is paused, and its tasks counted
    by status (``pending``, ``blocked``, ``in_progress``, ``awaiting_input``, ``escalated``,
    ``done``, ``cancelled``; ``pending`` counts those not blocked, due or not), and when its oldest
    pending, unblocked task was created."""

    name: str
    paused: bool
    counts: dict[str, int]
    oldest_pending_at: datetime | None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Queue:
        return cls(
            name=data["name"],
            paused=bool(data["paused"]),
            counts={str(key): int(value) for key, value in (data.get("counts") or {}).items()},
            oldest_pending_at=parse_time(data.get("oldest_pending_at")),
            raw=dict(data),
        )


@dataclass(frozen=True, kw_only=True)
class Agent:
    """An agent at a glance (``GET agents/``): the tasks it holds, when it last acted, and
    how its tasks ended in the last 24 hours."""

    name: str
    holding: list[int]
    last_seen_at: datetime | None
    completed_24h: int
    failed_24h: int
    expired_24h: int
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Agent:
        return cls(
            name=data["name"],
            holding=[int(task_id) for task_id in data.get("holding") or []],
            last_seen_at=parse_time(data.get("last_seen_at")),
            completed_24h=int(data.get("completed_24h", 0)),
            failed_24h=int(data.get("failed_24h", 0)),
            expired_24h=int(data.get("expired_24h", 0)),
            raw=dict(data),
        )


T = TypeVar("T")


@dataclass(frozen=True)
class Page(Generic[T]):
    """One page of a list: its ``results`` and the URL of the next page (None at the end)."""

    results: list[T]
    next: str | None


# -- The client --------------------------------------------------------------------------


class AskFields(TypedDict, total=False):
    """The fields of a question besides its text (:meth:`Client.ask` says what each is)."""

    options: Iterable[str] | None
    answer_schema: Mapping[str, Any] | None
    assignee: str | None
    answer_within: int | None
    action_digest: str | None


TaskRef = Task | int


def _task_id(task: TaskRef) -> int:
    return task if isinstance(task, int) else task.id


def _items(data: Any) -> list[Any]:
    # queues/ and agents/ answer a bare list; their OpenAPI entry (one object) may yet
    # become a page, {"results": [...]}, as tasks/ and events/ answer: read either.
    return list(data["results"] if isinstance(data, dict) else data)


def _lease_of(task: ClaimedTask | int, lease_token: str | None) -> tuple[int, str]:
    if lease_token is None:
        if not isinstance(task, ClaimedTask):
            raise TypeError("pass a ClaimedTask, or a task id and its lease_token")
        lease_token = task.lease_token
    return _task_id(task), lease_token


def _drop_none(**values: Any) -> dict[str, Any]:
    return {key: value for key, value in values.items() if value is not None}


def _time_param(value: datetime | str | None) -> str | None:
    return value.isoformat() if isinstance(value, datetime) else value


def _task_filters(
    *,
    parent: TaskRef | None,
    blocked: bool | None,
    depends_on: TaskRef | None,
    **others: Any,
) -> dict[str, Any]:
    return _drop_none(
        parent=_task_id(parent) if parent is not None else None,
        blocked=None if blocked is None else ("true" if blocked else "false"),
        depends_on=_task_id(depends_on) if depends_on is not None else None,
        **others,
    )


def _gone(task: Task, question: Question) -> str:
    """Why an agent waiting for the answer to ``question`` cannot take ``task`` back."""
    if task.status == "in_progress":
        return (
            f"Task {task.id} was answered, and another claim took it (held by "
            f"{task.leased_by}): it is no longer yours."
        )
    if task.answer_to(question) is None and task.status == "escalated":
        return f"Task {task.id} is escalated: its question was not answered in time."
    return f"Task {task.id} is {task.status.replace('_', ' ')} now: it is no longer yours."


# Errors after which the request surely never reached the server: safe to send again.
_UNSENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


class Client:
    """A connection to one Taskboard server, as one user (its API token).

    ``timeout`` bounds each request (a claim with ``wait`` gets ``wait`` more). Requests
    that never reached the server (connection refused or timed out) and ``503`` answers are
    retried up to ``retries`` times, after ``backoff * 2**n`` seconds (at most
    ``max_backoff``, with jitter, and no less than a ``Retry-After`` within that bound).
    A request that was sent but got no answer is retried only if repeating it is harmless
    (reads, heartbeats, and creates, which carry an ``Idempotency-Key``): repeating a
    claim or a complete could do it twice.
    ``4xx`` answers are never retried.

    One client may be shared by threads.
    """

    def __init__(
        self,
        url: str,
        token: str | None,
        *,
        timeout: float = 30.0,
        retries: int = 4,
        backoff: float = 0.5,
        max_backoff: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        headers = {"User-Agent": USER_AGENT, "Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._http = httpx.Client(
            base_url=self.url,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            transport=transport,
            # Enough for a claim, a stream and a heartbeat per task of a busy worker.
            limits=httpx.Limits(max_connections=200, max_keepalive_connections=20),
        )
        # The tasks this client's threads wait to take back after an answer (await_answer),
        # each with the claim another waiter got for it, once one did.
        self._awaiting: dict[int, ClaimedTask | None] = {}
        self._handed = threading.Condition()

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- tasks ---------------------------------------------------------------------------

    def create(
        self,
        title: str,
        *,
        description: str | None = None,
        payload: Mapping[str, Any] | None = None,
        queue: str | None = None,
        priority: int | None = None,
        max_failures: int | None = None,
        run_after: datetime | str | None = None,
        depends_on: Iterable[TaskRef] | None = None,
        parent_id: TaskRef | None = None,
        max_attempt_seconds: int | NoLimit | None = None,
        idempotency_key: str | None = None,
        assignee: str | None = None,
        requires: Iterable[str] | None = None,
    ) -> Task:
        """Create a pending task; what is not given gets the server's default.

        ``depends_on``: the (older) tasks that must be done before this one is claimable;
        ``parent_id``: the task this one is a subtask of; ``max_attempt_seconds``: how long
        one attempt may hold it, however often it heartbeats (:data:`NO_LIMIT`: no limit,
        whatever the server's ``TASKBOARD_MAX_ATTEMPT_SECONDS``); ``assignee``: the one
        user who may claim it (a person or an agent); ``requires``: the capabilities a
        claimant must all have.

        Every create sends an ``Idempotency-Key``: ``idempotency_key``, or a fresh random
        one for this call. Its retries send the same key, so a create whose answer was
        lost is sent again (unlike other writes) and still makes one task. Pass your own
        key to make creates safe across calls or processes: a repeat returns the task the
        first one made, as it is now, and one with another body raises
        :class:`IdempotencyConflict`.
        """
        body = _drop_none(
            title=title,
            description=description,
            payload=dict(payload) if payload is not None else None,
            queue=queue,
            priority=priority,
            max_failures=max_failures,
            run_after=_time_param(run_after),
            depends_on=[_task_id(task) for task in depends_on] if depends_on is not None else None,
            parent_id=_task_id(parent_id) if parent_id is not None else None,
            max_attempt_seconds=max_attempt_seconds,
            assignee=assignee,
            requires=list(requires) if requires is not None else None,
        )
        if max_attempt_seconds is NO_LIMIT:
            body["max_attempt_seconds"] = None
        key = idempotency_key if idempotency_key is not None else str(uuid.uuid4())
        data = self._request(
            "POST", "/tasks/", body=body, headers={"Idempotency-Key": key}, idempotent=True
        )
        return Task.from_json(data)

    def list_tasks(
        self,
        *,
        status: str | None = None,
        queue: str | None = None,
        leased_by: str | None = None,
        parent: TaskRef | None = None,
        blocked: bool | None = None,
        depends_on: TaskRef | None = None,
        limit: int | None = None,
        before: int | None = None,
        assignee: str | None = None,
        requires: str | None = None,
    ) -> Page[Task]:
        """Return one page of tasks, newest first (``before``: only smaller ids).

        ``parent``: the subtasks of that task; ``blocked``: only tasks that are (or are
        not) waiting for a dependency; ``depends_on``: the tasks that wait for that one;
        ``assignee``: the tasks for that user (``"me"``: for this client's); ``requires``:
        the tasks that require that capability.
        """
        params = _task_filters(
            status=status,
            queue=queue,
            leased_by=leased_by,
            parent=parent,
            blocked=blocked,
            depends_on=depends_on,
            limit=limit,
            before=before,
            assignee=assignee,
            requires=requires,
        )
        data = self._request("GET", "/tasks/", params=params)
        return Page([Task.from_json(t) for t in data["results"]], data.get("next"))

    def iter_tasks(
        self,
        *,
        status: str | None = None,
        queue: str | None = None,
        leased_by: str | None = None,
        parent: TaskRef | None = None,
        blocked: bool | None = None,
        depends_on: TaskRef | None = None,
        page_size: int | None = None,
        assignee: str | None = None,
        requires: str | None = None,
    ) -> Iterator[Task]:
        """Yield every matching task (filters as in :meth:`list_tasks`), newest first,
        fetching page after page."""
        params = _task_filters(
            status=status,
            queue=queue,
            leased_by=leased_by,
            parent=parent,
            blocked=blocked,
            depends_on=depends_on,
            limit=page_size,
            assignee=assignee,
            requires=requires,
        )
        for data in self._pages("/tasks/", params):
            yield Task.from_json(data)

    def get(self, task: TaskRef) -> Task:
        """Return the task as it is now."""
        return Task.from_json(self._request("GET", f"/tasks/{_task_id(task)}/"))

    def claim(
        self,
        *,
        queues: list[str] | None = None,
        limit: int = 1,
        lease_seconds: int | None = None,
        wait: float = 0,
    ) -> list[ClaimedTask]:
        """Lease up to ``limit`` claimable tasks (from ``queues``, or any queue).

        With ``wait`` > 0 (at most 60) the server holds the request until work comes or
        the time is up; the list is empty when nothing came. Each task carries its
        ``lease_token``: keep it alive with :meth:`lease` or :meth:`heartbeat`.
        """
        body = _drop_none(
            queues=queues, limit=limit, lease_seconds=lease_seconds, wait=wait or None
        )
        sent = time.monotonic()
        # The server answers after up to ``wait`` seconds: the read may take that long.
        timeout = self.timeout + min(float(wait), MAX_WAIT) if wait else None
        data = self._request("POST", "/tasks/claim/", body=body, timeout=timeout)
        received = time.monotonic()
        now = datetime.now(UTC)
        claimed = []
        for raw in data["tasks"]:
            fields = _task_fields(raw)
            until = fields["leased_until"] or now
            began = fields["attempt_started_at"]  # the claim's time on the server's clock
            claimed_at = sent
            if began is not None:
                # A claim that waited was sent up to ``wait`` seconds before the server
                # claimed the task: counting the lease from the sending could make it run
                # out here before it was even renewed. Its age by the two clocks, within
                # the time the request took, places the claim (a skewed clock errs
                # within that span).
                age = min(max((now - began).total_seconds(), 0.0), received - sent)
                claimed_at = received - age
            if lease_seconds is not None:
                length = float(lease_seconds)
            elif began is not None:
                length = max(1.0, (until - began).total_seconds())
            else:
                # The server's default length, estimated by what is left of it now: a bit
                # short (by the answer's travel time), so the lease's deadline as counted
                # from ``sent`` errs early. A skewed clock skews the estimate.
                length = max(1.0, (until - now).total_seconds())
            claimed.append(
                ClaimedTask(
                    **fields,
                    lease_token=raw["lease_token"],
                    lease_seconds=length,
                    claimed_at=claimed_at,
                )
            )
        return claimed

    def heartbeat(
        self,
        task: ClaimedTask | int,
        *,
        lease_token: str | None = None,
        lease_seconds: int | None = None,
        progress: Any = None,
        timeout: float | None = None,
        retries: int | None = None,
    ) -> Task:
        """Push your lease forward by ``lease_seconds`` (default: the length claimed)."""
        task_id, token = _lease_of(task, lease_token)
        body = _drop_none(lease_token=token, lease_seconds=lease_seconds, progress=progress)
        data = self._request(
            "POST",
            f"/tasks/{task_id}/heartbeat/",
            body=body,
            idempotent=True,
            timeout=timeout,
            retries=retries,
        )
        return Task.from_json(data)

    def complete(
        self,
        task: ClaimedTask | int,
        *,
        lease_token: str | None = None,
        result: Any = None,
        retries: int | None = None,
    ) -> Task:
        """Mark your task done with ``result`` (any JSON value)."""
        task_id, token = _lease_of(task, lease_token)
        body = {"lease_token": token, "result": result}
        data = self._request("POST", f"/tasks/{task_id}/complete/", body=body, retries=retries)
        return Task.from_json(data)

    def fail(
        self,
        task: ClaimedTask | int,
        error: str,
        *,
        lease_token: str | None = None,
        retry_after: int | None = None,
        retries: int | None = None,
    ) -> Task:
        """Count a strike on your task: pending again (after ``retry_after`` s) or escalated."""
        task_id, token = _lease_of(task, lease_token)
        body = _drop_none(lease_token=token, error=error, retry_after=retry_after)
        data = self._request("POST", f"/tasks/{task_id}/fail/", body=body, retries=retries)
        return Task.from_json(data)

    def release(
        self,
        task: ClaimedTask | int,
        *,
        lease_token: str | None = None,
        retries: int | None = None,
    ) -> Task:
        """Give your task back, pending, without a strike."""
        task_id, token = _lease_of(task, lease_token)
        body = {"lease_token": token}
        data = self._request("POST", f"/tasks/{task_id}/release/", body=body, retries=retries)
        return Task.from_json(data)

    def escalate(
        self,
        task: ClaimedTask | int,
        reason: str,
        *,
        lease_token: str | None = None,
        retries: int | None = None,
    ) -> Task:
        """Hand your task to the humans (escalated), with ``reason``."""
        task_id, token = _lease_of(task, lease_token)
        body = {"lease_token": token, "reason": reason}
        data = self._request("POST", f"/tasks/{task_id}/escalate/", body=body, retries=retries)
        return Task.from_json(data)

    def ask(
        self,
        task: ClaimedTask | int,
        question: str,
        *,
        lease_token: str | None = None,
        options: Iterable[str] | None = None,
        answer_schema: Mapping[str, Any] | None = None,
        assignee: str | None = None,
        answer_within: int | None = None,
        action_digest: str | None = None,
        retries: int | None = None,
    ) -> Task:
        """Ask a person ``question`` about your task, instead of failing it: the lease ends
        (no strike), and the task awaits input. Return the task, whose ``question`` is the
        one asked.

        ``options``: the answers to choose from (2 to 10); or ``answer_schema``: a JSON
        Schema the answer must validate against; neither: the answer is a text.
        ``assignee``: the user who should answer (others with the permission may too);
        ``answer_within``: seconds before the unanswered task is escalated (the server's
        default: a day); ``action_digest``: what you will do once approved (the SHA-256 of
        the exact command, say), repeated in the answer. To wait for the answer and take
        the task back, use :meth:`Lease.ask` (or :meth:`await_answer`).
        """
        task_id, token = _lease_of(task, lease_token)
        body = _drop_none(
            lease_token=token,
            question=question,
            options=list(options) if options is not None else None,
            answer_schema=dict(answer_schema) if answer_schema is not None else None,
            assignee=assignee,
            answer_within=answer_within,
            action_digest=action_digest,
        )
        data = self._request("POST", f"/tasks/{task_id}/ask/", body=body, retries=retries)
        return Task.from_json(data)

    def answer(self, task: TaskRef, answer: Any, *, note: str | None = None) -> Task:
        """Answer the task's open question (as its assignee, or a user with the
        ``board.answer_task`` permission): one of its options, a value its schema accepts,
        or a text. The task is pending again, held for the agent that asked for a while."""
        body = {"answer": answer, **_drop_none(note=note)}
        path = f"/tasks/{_task_id(task)}/answer/"
        return Task.from_json(self._request("POST", path, body=body))

    def await_answer(
        self,
        task: Task,
        *,
        wait: float,
        lease_seconds: int | None = None,
        stop: threading.Event | None = None,
    ) -> ClaimedTask:
        """Wait up to ``wait`` seconds for the answer to ``task``'s open question (the task
        as :meth:`ask` returned it), then claim the task back (it is held for the asker)
        and return it: its ``answers`` end with this one.

        It looks at the task every few seconds (more often at first) and rides out a
        server that does not answer meanwhile (a restart): it goes on looking until the
        wait is over. Raises :class:`AwaitingInput` when the wait ends first (or ``stop``
        is set), and :class:`LeaseLost` when the task went another way: answered and
        claimed by another agent, escalated for want of an answer, cancelled.
        """
        question = task.question
        if question is None:
            raise ValueError(f"task {task.id} has no open question to wait for")
        deadline = time.monotonic() + max(0.0, wait)
        latest, pause = task, ANSWER_POLL_FIRST
        with self._handed:
            self._awaiting[task.id] = None
        try:
            while True:
                handed = self._take_handed(task.id)
                if handed is not None:
                    return handed
                try:
                    latest = Task.from_json(self._request("GET", f"/tasks/{task.id}/", retries=0))
                    claimed = self._claim_answered(latest, question, lease_seconds)
                    if claimed is not None:
                        return claimed
                except Unavailable as exc:
                    logger.info("task %s: waiting for its answer: %s", task.id, exc)
                left = deadline - time.monotonic()
                if left <= 0 or (stop is not None and stop.is_set()):
                    raise AwaitingInput(
                        f"Task {task.id} is still awaiting the answer to its question "
                        f"(event {question.event_id}); the next claim that takes it gets it.",
                        task=latest,
                    )
                with self._handed:
                    self._handed.wait_for(
                        lambda: self._awaiting.get(task.id) is not None, min(pause, left)
                    )
                pause = min(pause * 2, ANSWER_POLL_MAX)
        finally:
            with self._handed:
                unused = self._awaiting.pop(task.id, None)
            if unused is not None:  # handed over as this wait ended some other way
                self._hand_on(unused)

    def _take_handed(self, task_id: int) -> ClaimedTask | None:
        with self._handed:
            handed = self._awaiting.get(task_id)
            self._awaiting[task_id] = None
        return handed

    def _claim_answered(
        self, latest: Task, question: Question, lease_seconds: int | None
    ) -> ClaimedTask | None:
        """Claim ``latest`` back once ``question`` has its answer; None while it has none,
        or while it is not handed out."""
        open_question = latest.question
        if latest.status == "awaiting_input" and (
            open_question is None or open_question.event_id == question.event_id
        ):
            return None
        if latest.status != "pending" or latest.answer_to(question) is None:
            raise LeaseLost(_gone(latest, question), code="lease_lost", task_status=latest.status)
        for _ in range(CLAIM_BACK_TRIES):
            claimed = self.claim(queues=[latest.queue], limit=1, lease_seconds=lease_seconds)
            if not claimed:
                return None
            if claimed[0].id == latest.id:
                return claimed[0]
            # Another task came first (one held for this agent too): hand it to the thread
            # of this client that waits for it, or give it back without a strike.
            self._hand_on(claimed[0])
        return None

    def _hand_on(self, task: ClaimedTask) -> None:
        with self._handed:
            if task.id in self._awaiting and self._awaiting[task.id] is None:
                self._awaiting[task.id] = task
                self._handed.notify_all()
                return
        try:
            self.release(task)
        except TaskboardError as exc:
            logger.warning("task %s: claimed by the way, could not release it: %s", task.id, exc)

    def requeue(self, task: TaskRef, *, note: str | None = None) -> Task:
        """Staff: put an escalated, done or cancelled task back to pending, strikes reset."""
        body = _drop_none(note=note)
        path = f"/tasks/{_task_id(task)}/requeue/"
        return Task.from_json(self._request("POST", path, body=body))

    def resolve(self, task: TaskRef, *, note: str | None = None, result: Any = None) -> Task:
        """Staff: mark an escalated task done, with ``result``."""
        body = _drop_none(note=note, result=result)
        path = f"/tasks/{_task_id(task)}/resolve/"
        return Task.from_json(self._request("POST", path, body=body))

    def cancel(self, task: TaskRef, *, note: str | None = None) -> Task:
        """Staff: cancel a pending or escalated task."""
        body = _drop_none(note=note)
        path = f"/tasks/{_task_id(task)}/cancel/"
        return Task.from_json(self._request("POST", path, body=body))

    def comment(self, task: TaskRef, body: str) -> Event:
        """Add a comment (a ``commented`` event) to the task's history, in any status.

        A comment whose answer was lost is not sent again: it could appear twice.
        """
        path = f"/tasks/{_task_id(task)}/comments/"
        return Event.from_json(self._request("POST", path, body={"body": body}))

    # -- queues and agents ---------------------------------------------------------------

    def queues(self) -> list[Queue]:
        """Return every queue that has tasks, with its counts and whether it is paused.

        The server answers at most ``QUEUE_PAGE`` queues at a time, by name; a full page
        is followed by the next (``after`` its last name) until one is not full.
        """
        queues: list[Queue] = []
        params: dict[str, Any] = {"limit": QUEUE_PAGE}
        while True:
            page = [
                Queue.from_json(q) for q in _items(self._request("GET", "/queues/", params=params))
            ]
            queues += page
            if len(page) < QUEUE_PAGE:
                return queues
            params = {"limit": QUEUE_PAGE, "after": page[-1].name}

    def pause_queue(self, name: str, *, note: str | None = None) -> Queue:
        """Staff: stop handing out the queue's tasks (leases already held run on)."""
        body = _drop_none(note=note)
        return Queue.from_json(self._request("POST", f"/queues/{name}/pause/", body=body))

    def resume_queue(self, name: str, *, note: str | None = None) -> Queue:
        """Staff: hand out the queue's tasks again (waiting claims wake)."""
        body = _drop_none(note=note)
        return Queue.from_json(self._request("POST", f"/queues/{name}/resume/", body=body))

    def agents(self) -> list[Agent]:
        """Return every user that has claimed a task: what it holds, when it was last seen."""
        return [Agent.from_json(a) for a in _items(self._request("GET", "/agents/"))]

    # -- events --------------------------------------------------------------------------

    def task_events(
        self, task: TaskRef, *, after: int | None = None, limit: int | None = None
    ) -> Page[Event]:
        """Return one page of the task's events, oldest first."""
        params = _drop_none(after=after, limit=limit)
        data = self._request("GET", f"/tasks/{_task_id(task)}/events/", params=params)
        return Page([Event.from_json(e) for e in data["results"]], data.get("next"))

    def iter_task_events(self, task: TaskRef, *, page_size: int | None = None) -> Iterator[Event]:
        """Yield all of the task's events, oldest first."""
        for data in self._pages(f"/tasks/{_task_id(task)}/events/", _drop_none(limit=page_size)):
            yield Event.from_json(data)

    def events(
        self,
        *,
        after: int | None = None,
        task: TaskRef | None = None,
        type: str | None = None,
        limit: int | None = None,
    ) -> Page[Event]:
        """Return one page of the event log, by ascending id, after event ``after``."""
        params = _drop_none(
            after=after,
            task=_task_id(task) if task is not None else None,
            type=type,
            limit=limit,
        )
        data = self._request("GET", "/events/", params=params)
        return Page([Event.from_json(e) for e in data["results"]], data.get("next"))

    def iter_events(
        self,
        *,
        after: int | None = None,
        task: TaskRef | None = None,
        type: str | None = None,
        page_size: int | None = None,
    ) -> Iterator[Event]:
        """Yield every event of the log after ``after`` that exists now, by ascending id."""
        params = _drop_none(
            after=after,
            task=_task_id(task) if task is not None else None,
            type=type,
            limit=page_size,
        )
        for data in self._pages("/events/", params):
            yield Event.from_json(data)

    def stream(
        self, last_event_id: str | int | None = None, *, read_timeout: float = 75.0
    ) -> Iterator[Event]:
        """Yield every new event, live, from ``GET /api/v1/stream/``; never returns.

        With ``last_event_id`` (an event's ``stream_id``) the stream starts right after
        that event. When the connection drops, or the server ends the stream (a restart),
        it reconnects, as a browser's EventSource does: after the server's ``retry:`` delay,
        then with backoff while the server cannot be reached, resuming with
        ``Last-Event-ID`` so that no event is missed or repeated. ``read_timeout`` is how
        long silence (the server sends a keep-alive at least every 30 s) means a dead
        connection. Authentication and other 4xx refusals are raised.
        """
        last = None if last_event_id is None else str(last_event_id)
        retry_delay = 1.0
        failures = 0
        while True:
            headers = {"Accept": "text/event-stream", "Cache-Control": "no-cache"}
            if last is not None:
                headers["Last-Event-ID"] = last
            timeout = httpx.Timeout(self.timeout, read=read_timeout)
            try:
                with self._http.stream(
                    "GET", STREAM_PATH, headers=headers, timeout=timeout
                ) as response:
                    if response.status_code != 200:
                        response.read()
                        if response.status_code not in RETRIED_STATUSES:
                            raise error_from_response(response)
                        failures += 1
                    else:
                        failures = 0
                        parser = SSEParser()
                        for line in response.iter_lines():
                            event = parser.feed(line)
                            if parser.retry is not None:
                                retry_delay = parser.retry
                            if parser.last_id is not None:
                                last = parser.last_id
                            if event is not None:
                                yield event
            except httpx.TransportError as exc:
                failures += 1
                logger.info("stream: connection lost (%s); reconnecting", exc)
            delay = retry_delay if failures <= 1 else self._delay(failures - 2, None)
            time.sleep(delay)

    events_stream = stream

    # -- leases --------------------------------------------------------------------------

    def lease(
        self,
        task: ClaimedTask,
        *,
        on_lost: Callable[[Lease], None] | None = None,
        interval: float | None = None,
    ) -> Lease:
        """Start keeping ``task``'s lease alive in the background; see :class:`Lease`."""
        return Lease(self, task, on_lost=on_lost, interval=interval).start()

    # -- health --------------------------------------------------------------------------

    def health(self) -> bool:
        """Return whether the server and its database answer (``GET /healthz``)."""
        try:
            response = self._http.get("/healthz", timeout=min(self.timeout, 10.0))
        except httpx.TransportError:
            return False
        return response.status_code == 200

    # -- plumbing ------------------------------------------------------------------------

    def _pages(self, path: str, params: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Yield the results of every page, following each page's ``next``."""
        while True:
            data = self._request("GET", path, params=params)
            yield from data["results"]
            if not data.get("next"):
                return
            # The next page is the same path with the cursor in its query. Only the query
            # is taken, so a server behind a proxy that names another host still works.
            params = dict(httpx.URL(data["next"]).params)

    def _request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        idempotent: bool | None = None,
        retries: int | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Any:
        """Send a request to ``API + path``; return its JSON, or raise a TaskboardError.

        ``idempotent``: whether sending it again after a lost answer is harmless (default:
        for GET only). Every retry sends the same ``body`` and ``headers``.
        """
        retries = self.retries if retries is None else retries
        repeatable = method == "GET" if idempotent is None else idempotent
        request_timeout: Any = httpx.USE_CLIENT_DEFAULT
        if timeout is not None:
            request_timeout = httpx.Timeout(timeout, connect=min(timeout, 10.0))
        attempt = 0
        while True:
            retry_after: float | None = None
            cause: BaseException | None = None
            try:
                response = self._http.request(
                    method,
                    API + path,
                    json=body,
                    params=params,
                    headers=headers,
                    timeout=request_timeout,
                )
            except _UNSENT as exc:
                failure: TaskboardError = Unavailable(
                    f"Cannot reach {self.url}: {exc or type(exc).__name__}", code="unreachable"
                )
                cause = exc
            except httpx.TransportError as exc:
                # Only a change can have been made without an answer: a read is just retried.
                maybe = "" if method == "GET" else "; the request may or may not have taken effect"
                failure = Unavailable(
                    f"No answer from {self.url} ({exc or type(exc).__name__}){maybe}.",
                    code="no_answer",
                )
                cause = exc
                if not repeatable:
                    raise failure from exc
            else:
                if response.status_code < 400:
                    return response.json() if response.content else None
                failure = error_from_response(response)
                if response.status_code in GATEWAY_ERRORS:
                    # A proxy in front (Pushpin, a load balancer) did not get an answer
                    # from the board: like a lost answer, the request may have run.
                    if not repeatable:
                        raise failure
                elif response.status_code != 503:
                    raise failure
                with contextlib.suppress(ValueError):
                    retry_after = float(response.headers.get("Retry-After", ""))
            if attempt >= retries:
                raise failure from cause
            delay = self._delay(attempt, retry_after)
            logger.info("%s %s: %s; retrying in %.1f s", method, path, failure, delay)
            time.sleep(delay)
            attempt += 1

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        """Return the pause before retry ``attempt`` (0-based): exponential, jittered."""
        ceiling = min(self.max_backoff, self.backoff * 2**attempt)
        delay = random.uniform(ceiling / 2, ceiling)
        if retry_after is not None:
            delay = max(delay, min(retry_after, self.max_backoff))
        return delay


class SSEParser:
    """The server-sent events line protocol (the WHATWG EventSource rules), line by line."""

    def __init__(self) -> None:
        # The id to resume from: set when a block ends (its blank line), with or without
        # data, never by a block cut off before its end, whose event was never received.
        self.last_id: str | None = None
        self.retry: float | None = None
        self._id: str | None = None
        self._data: list[str] = []
        self._type = ""

    def feed(self, line: str) -> Event | None:
        """Take one line (without its end); return the Event it completes, if any."""
        if line == "":
            self.last_id = self._id
            data, event_type = self._data, self._type or "message"
            self._data, self._type = [], ""
            if not data or event_type != "task_event":
                return None
            return Event.from_json(json.loads("\n".join(data)), stream_id=self.last_id)
        if line.startswith(":"):
            return None  # a comment: the keep-alive
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._type = value
        elif name == "id" and "\x00" not in value:
            self._id = value
        elif name == "retry" and value.isdigit():
            self.retry = int(value) / 1000
        return None


# -- Leases ------------------------------------------------------------------------------


class Lease:
    """Keep a claimed task's lease alive from a background thread, and say when it is lost.

    The thread heartbeats every ``interval`` seconds (a third of the lease by default). The
    lease is lost when a heartbeat is refused (``409 lease_lost``: it expired and someone
    else claimed the task, or a human acted on it), when no heartbeat got through before
    the lease ran out (the server unreachable), or when the task's attempt deadline
    (``max_attempt_seconds`` after the claim) passes. The moment either happens,
    :attr:`lost` turns true, :meth:`wait_lost` returns and ``on_lost(lease)`` is called
    (from the heartbeat thread): stop working on the task, its result would be refused.

    :meth:`report_progress` hands the thread a progress value to send: with the next
    heartbeat, brought forward so that it goes within ``progress_interval`` seconds
    (one a second by default) of the previous one. Only the latest value is sent.

    Finish with :meth:`complete`, :meth:`fail`, :meth:`release` or :meth:`escalate`, which
    stop the heartbeats first and send a progress not sent yet with a heartbeat of its own
    (the task keeps it: the next attempt resumes from it, and a done task shows how far it
    got); one that is refused other than with ``lease_lost``, or not answered, starts them
    again, so that the task stays held while the caller retries. Used as a context
    manager, a block that raises fails the task with the exception (a
    ``KeyboardInterrupt`` releases it), and a block that ends without finishing the task
    releases it.

    :meth:`ask` puts a question to a person instead: the lease ends while the person
    thinks, and when the answer comes within the wait, the task is claimed back and this
    lease heartbeats the new claim (:attr:`task`).
    """

    def __init__(
        self,
        client: Client,
        task: ClaimedTask,
        *,
        on_lost: Callable[[Lease], None] | None = None,
        interval: float | None = None,
        progress_interval: float = 1.0,
    ) -> None:
        self.client = client
        self.task = task
        #: The task as the last heartbeat (or finishing call) returned it.
        self.latest: Task = task
        #: Why the lease was lost (a LeaseLost, or another refusal of a heartbeat).
        self.error: TaskboardError | None = None
        self.on_lost = on_lost
        #: The answer that :meth:`ask` brought back last (None before one did).
        self.answer: Answer | None = None
        self._interval = interval
        self.progress_interval = progress_interval
        self._clock(task)
        # The latest progress reported, its number, and the number of the last one sent.
        self._progress: Any = None
        self._reported = 0
        self._sent = 0
        self._progress_lock = threading.Lock()
        self._lost = threading.Event()
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._finished = False
        self._started = False
        # stop() was called: no finishing call's refusal starts the heartbeats again.
        self._stopped = False
        self._control = threading.Lock()  # _stopped and a new thread, against stop()
        self._thread = threading.Thread(
            target=self._run, name=f"taskboard-lease-{task.id}", daemon=True
        )

    def _clock(self, task: ClaimedTask) -> None:
        """Count the lease and the attempt of ``task`` (just claimed) from its claim."""
        self.lease_seconds = max(task.lease_seconds, 0.001)
        self.interval = self._interval if self._interval is not None else self.lease_seconds / 3
        started = task.claimed_at or time.monotonic()
        # Local monotonic time by which the attempt ends (as the lease's deadline, counted
        # from the claim as the client placed it).
        self._attempt_ends = (
            started + task.max_attempt_seconds
            if task.max_attempt_seconds is not None
            else float("inf")
        )
        # Local monotonic time by which the lease has surely run out, unless renewed.
        self._deadline = min(started + self.lease_seconds, self._attempt_ends)
        self._next_beat = started + self.interval
        # No heartbeat for progress before this (one was sent less than a second ago).
        self._not_before = started + self.progress_interval

    def start(self) -> Self:
        """Start the heartbeat thread (once; later calls do nothing)."""
        if not self._started:
            self._started = True
            self._thread.start()
        return self

    @property
    def lost(self) -> bool:
        """True once the lease is known to be lost."""
        return self._lost.is_set()

    @property
    def finished(self) -> bool:
        """True once complete, fail, release, escalate or ask was called (or tried); false
        again once :meth:`ask` took the task back with its answer."""
        return self._finished

    def wait_lost(self, timeout: float | None = None) -> bool:
        """Block until the lease is lost or ``timeout`` passes; return :attr:`lost`."""
        return self._lost.wait(timeout)

    def stop(self) -> None:
        """Stop heartbeating (without touching the task) and wait for the thread to end.
        For good: a finishing call that is refused afterwards does not start it again."""
        with self._control:
            self._stopped = True
        self._halt()

    def _halt(self) -> None:
        with self._control:
            self._stopping.set()
            self._wake.set()
            thread = self._thread
        if thread.is_alive() and threading.current_thread() is not thread:
            thread.join()

    def pause(self) -> None:
        """Stop heartbeating until :meth:`resume`, leaving the task alone: the lease runs
        out unless resumed (or renewed by :meth:`heartbeat`) in time."""
        self._halt()

    def resume(self) -> None:
        """Heartbeat again after :meth:`pause`: at once if one is due, unless the lease was
        lost, finished or stopped for good. One that ran out meanwhile turns lost."""
        if not self._finished:
            self._resume()

    def heartbeat(self, progress: Any = None) -> Task:
        """Heartbeat now, reporting ``progress`` (any JSON value)."""
        sent = time.monotonic()
        try:
            task = self.client.heartbeat(self.task, progress=progress)
        except LeaseLost as exc:
            self._lose(exc, notify=False)
            raise
        self._renewed(task, sent)
        return task

    def report_progress(self, progress: Any) -> None:
        """Have the heartbeat thread send ``progress`` (any JSON value but null) soon.

        It returns at once. A value reported before the previous one went out replaces
        it. The server keeps the latest on the task, and the next claim of the task
        (after a fail, a release or a lost lease) returns it, so that the next attempt
        resumes from there. A value the server refuses (too large, say) is logged and
        dropped; the heartbeats go on without it.
        """
        if progress is None:
            return
        with self._progress_lock:
            self._progress = progress
            self._reported += 1
        self._wake.set()

    def complete(self, result: Any = None) -> Task:
        """Stop heartbeating and complete the task with ``result``."""
        return self._finish(
            lambda: self.client.complete(self.task, result=result, retries=0), progress=True
        )

    def fail(self, error: str, *, retry_after: int | None = None) -> Task:
        """Stop heartbeating and fail the task (a strike) with ``error``."""
        return self._finish(
            lambda: self.client.fail(self.task, error, retry_after=retry_after, retries=0),
            progress=True,
        )

    def release(self) -> Task:
        """Stop heartbeating and give the task back without a strike."""
        return self._finish(lambda: self.client.release(self.task, retries=0), progress=True)

    def escalate(self, reason: str) -> Task:
        """Stop heartbeating and hand the task to the humans."""
        return self._finish(
            lambda: self.client.escalate(self.task, reason, retries=0), progress=True
        )

    def send_ask(self, question: str, **fields: Unpack[AskFields]) -> Task:
        """Stop heartbeating and ask a person ``question`` (arguments as in
        :meth:`Client.ask`), without waiting for the answer: the lease ends, without a
        strike. Return the task, ``awaiting_input``. The answer comes with the task to
        the next claim that takes it: this agent's first, for a while after the answer."""
        return self._finish(
            lambda: self.client.ask(self.task, question, retries=0, **fields), progress=True
        )

    def ask(self, question: str, *, wait: float = 0, **fields: Unpack[AskFields]) -> Any:
        """Ask a person ``question`` (arguments as in :meth:`Client.ask`) and wait up to
        ``wait`` seconds for the answer; return it, with the task held again.

        The ask ends the lease (no strike, no heartbeats while a person thinks). When the
        answer comes, the task is claimed back (it is held for the asker) with a lease as
        long as this one: this lease heartbeats again, on the new claim (``task`` is it,
        its ``answers`` ending with this one; :attr:`answer` is the whole answer, with its
        ``note``, who gave it and the ``action_digest`` asked with). The wait rides out a
        server restart. When the wait ends first, :class:`AwaitingInput` is raised and no
        lease is held; a later claim gets the task with its answers. :class:`LeaseLost` is
        raised when the task went another way meanwhile (answered and claimed by another
        agent once the hold was over, escalated unanswered, cancelled).
        """
        asked = self.send_ask(question, **fields)
        if asked.question is None:
            raise AwaitingInput(f"Task {asked.id} shows no open question.", task=asked)
        lease_seconds = min(max(1, round(self.lease_seconds)), 86400)
        try:
            claimed = self.client.await_answer(asked, wait=wait, lease_seconds=lease_seconds)
        except LeaseLost as exc:
            self._lose(exc, notify=False)
            raise
        answer = claimed.answer_to(asked.question)
        self._take_back(claimed)
        self.answer = answer
        return answer.answer if answer is not None else None

    def _take_back(self, task: ClaimedTask) -> None:
        """Hold ``task`` (claimed back after an answer) from now on: heartbeat its lease."""
        self._halt()
        with self._control:
            self.task = task
            self.latest = task
            self._clock(task)
        self._resume()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if self._finished or self.lost or isinstance(exc, LeaseLost):
                return
            try:
                if exc is None or not isinstance(exc, Exception):
                    self.release()
                else:
                    self.fail(f"{type(exc).__name__}: {exc}"[:10000])
            except TaskboardError as error:
                # Do not hide the block's own exception behind this one.
                if exc is None:
                    raise
                logger.warning("task %s: could not give it back: %s", self.task.id, error)
        finally:
            self.stop()

    # -- internals -----------------------------------------------------------------------

    def _finish(self, call: Callable[[], Task], *, progress: bool = False) -> Task:
        """Make the finishing ``call`` (sent once: retried here), with the heartbeats
        stopped while it is under way and running between its attempts."""
        # Heartbeats stop first; one already in flight is harmless, and a refusal it gets
        # after this point is not a loss (see _run).
        self._finished = True
        self._stopping.set()
        self._wake.set()
        try:
            if progress and self._unsent_progress()[1]:
                # Let a heartbeat in flight land first, so the progress goes out once.
                self._halt()
                self._send_progress()
            attempt = 0
            while True:
                try:
                    task = call()
                    break
                except Unavailable as exc:
                    # Not taken (a 503: the board's database is away; or the board not
                    # reached): tried again as the client retries, but with the lease
                    # heartbeating meanwhile. Waiting out a Retry-After with the heartbeats
                    # stopped let a short lease run out under a complete that then went
                    # through: lease_lost, a strike, and the work done twice.
                    not_taken = exc.status == 503 or exc.code == "unreachable"
                    if not not_taken or attempt >= self.client.retries:
                        raise
                    self._resume()
                    delay = self.client._delay(attempt, exc.retry_after)
                    logger.info("task %s: %s; trying again in %.1f s", self.task.id, exc, delay)
                    time.sleep(delay)
                    with self._control:
                        if self.lost and self.error is not None:
                            raise self.error from exc  # lost meanwhile: say so, not "retry"
                        if self.lost or self._stopped:
                            raise
                        self._finished = True
                        self._stopping.set()
                        self._wake.set()
                    attempt += 1
        except LeaseLost as exc:
            self._lose(exc, notify=False)
            raise
        except TaskboardError:
            # Refused (an invalid or too large body) or unanswered: the task is still held
            # as far as anyone here knows, so keep it alive for the caller to try again. (If
            # an unanswered call did take effect, the next heartbeat is refused: lost.)
            self._resume()
            raise
        self.latest = task
        return task

    def _resume(self) -> None:
        """Heartbeat again after a finishing call that did not finish the task (unless
        the lease was lost, or stopped for good meanwhile)."""
        self._halt()
        with self._control:
            if self.lost or self._stopped:
                return
            self._finished = False
            self._stopping.clear()
            self._wake.clear()
            self._thread = threading.Thread(
                target=self._run, name=f"taskboard-lease-{self.task.id}", daemon=True
            )
            if self._started:
                self._thread.start()

    def _send_progress(self) -> None:
        """Send the progress not sent yet, if any, with a heartbeat of its own."""
        progress, number = self._unsent_progress()
        if progress is None:
            return
        try:
            self.latest = self.client.heartbeat(self.task, progress=progress)
        except (ValidationError, PayloadTooLarge) as exc:
            logger.warning("task %s: progress refused (%s); dropped", self.task.id, exc)
        except LeaseLost:
            raise
        except TaskboardError as exc:
            logger.warning("task %s: could not send its progress: %s", self.task.id, exc)
            return
        self._mark_sent(number)

    def _unsent_progress(self) -> tuple[Any, int]:
        """Return the latest progress and its number, or (None, 0) when it was sent."""
        with self._progress_lock:
            if self._sent == self._reported:
                return None, 0
            return self._progress, self._reported

    def _mark_sent(self, number: int) -> None:
        with self._progress_lock:
            self._sent = max(self._sent, number)

    def _due(self) -> float:
        """Return when the next heartbeat is due: brought forward for unsent progress."""
        with self._progress_lock:
            unsent = self._sent != self._reported
        return min(self._next_beat, self._not_before) if unsent else self._next_beat

    def _renewed(self, task: Task, sent: float) -> None:
        self.latest = task
        # The server set leased_until = (its now) + lease, and its now came after ``sent``;
        # it never extends the lease past the attempt deadline.
        self._deadline = min(max(self._deadline, sent + self.lease_seconds), self._attempt_ends)
        self._next_beat = sent + self.interval

    def _lose(self, error: TaskboardError, *, notify: bool = True) -> None:
        if self._lost.is_set():
            return
        self.error = error
        self._lost.set()
        if notify and self.on_lost is not None:
            try:
                self.on_lost(self)
            except Exception:
                logger.exception("task %s: the on_lost callback failed", self.task.id)

    def _ran_out(self) -> LeaseLost:
        if self._deadline >= self._attempt_ends:
            return LeaseLost(
                f"The attempt deadline passed (max_attempt_seconds "
                f"{self.task.max_attempt_seconds}).",
                code="attempt_deadline",
            )
        return LeaseLost("The lease ran out before a heartbeat got through.")

    def _run(self) -> None:
        pause = 0.25
        while True:
            now = time.monotonic()
            if now >= self._deadline:
                self._lose(self._ran_out())
                return
            # Woken early by stop() and by report_progress().
            self._wake.wait(max(0.0, min(self._due(), self._deadline) - now))
            self._wake.clear()
            if self._stopping.is_set():
                return
            now = time.monotonic()
            if now < self._due():
                continue  # woke for the deadline check, or progress that must wait
            if now >= self._deadline:
                continue
            progress, number = self._unsent_progress()
            self._not_before = now + self.progress_interval
            try:
                # No retries inside: this loop retries, and must notice the deadline.
                task = self.client.heartbeat(
                    self.task,
                    progress=progress,
                    timeout=max(0.5, self._deadline - now),
                    retries=0,
                )
            except Unavailable as exc:
                if self._stopping.is_set():
                    return
                logger.warning("task %s: heartbeat failed (%s); retrying", self.task.id, exc)
                self._next_beat = time.monotonic() + min(pause, self.interval)
                pause = min(pause * 2, 5.0)
                continue
            except TaskboardError as exc:
                if self._stopping.is_set():
                    return
                if progress is not None and isinstance(exc, ValidationError | PayloadTooLarge):
                    # The progress was refused, not the lease: drop it, heartbeat without.
                    logger.warning("task %s: progress refused (%s); dropped", self.task.id, exc)
                    self._mark_sent(number)
                    continue
                self._lose(exc)
                return
            pause = 0.25
            self._mark_sent(number)
            if self._stopping.is_set():
                return
            self._renewed(task, now)
