"""Every transition of board.transitions and every refusal, with the events each one writes.

These tests run inside one database transaction each, where PostgreSQL's now() stays at the
transaction's start: a lease or a run_after "passes" only when a test moves it into the past
with a direct UPDATE. Tests that need real time to pass live in test_claim.py.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.db import connection

from board import transitions
from board.exceptions import InvalidTransition, LeaseLost, TaskNotFound
from board.models import Task, TaskEvent, TaskStatus

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fast_password_hashing")]

_queue_names = itertools.count()

# The columns that make up a lease, and the ones a refused transition must leave alone.
TASK_STATE = (
    "status",
    "failure_count",
    "leased_by",
    "leased_until",
    "lease_token",
    "lease_seconds",
    "run_after",
    "result",
    "last_error",
    "updated_at",
)


def db_now() -> datetime:
    """Return PostgreSQL's now(): the start of the test's transaction."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        now: datetime = cursor.fetchone()[0]
        return now


def move_lease_end(task_id: int, seconds_from_now: float) -> None:
    """Set a lease's deadline relative to the database's now() (test setup only)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE tasks SET leased_until = now() + make_interval(secs => %s) WHERE id = %s",
            [seconds_from_now, task_id],
        )


def events_of(task_id: int) -> list[TaskEvent]:
    return list(TaskEvent.objects.filter(task_id=task_id).order_by("id"))


def timeline(task_id: int) -> list[tuple[str, str, str]]:
    """Return the task's events as (type, status, actor), oldest first."""
    return [(e.type, e.status, e.actor) for e in events_of(task_id)]


def state_of(task_id: int) -> dict[str, Any]:
    state: dict[str, Any] = Task.objects.values(*TASK_STATE).get(pk=task_id)
    return state


@pytest.fixture
def task_in_own_queue(make_task: Callable[..., Task]) -> Callable[..., Task]:
    """Make a pending task alone in a fresh queue, so a claim on that queue gets exactly it."""

    def make(**kwargs: Any) -> Task:
        kwargs.setdefault("queue", f"q-{next(_queue_names)}")
        return make_task(**kwargs)

    return make


def claim_task(task: Task, actor: Any, **kwargs: Any) -> transitions.Claim:
    """Claim exactly this task (it must be alone and claimable in its queue)."""
    claims = transitions.claim(actor=actor, queues=[task.queue], **kwargs)
    assert [c.task.pk for c in claims] == [task.pk]
    return claims[0]


@pytest.fixture
def task_in(
    task_in_own_queue: Callable[..., Task], agent: Any, staff: Any
) -> Callable[[str], Task]:
    """Return a function that brings a new task to the given status by transitions."""

    def make(status: str) -> Task:
        task = task_in_own_queue()
        if status == TaskStatus.PENDING:
            return task
        if status == TaskStatus.CANCELLED:
            return transitions.cancel(task_id=task.pk, actor=staff)
        lease = claim_task(task, agent)
        if status == TaskStatus.IN_PROGRESS:
            return lease.task
        if status == TaskStatus.DONE:
            return transitions.complete(task_id=task.pk, actor=agent, lease_token=lease.lease_token)
        if status == TaskStatus.AWAITING_INPUT:
            return transitions.ask(
                task_id=task.pk, actor=agent, lease_token=lease.lease_token, question="Which?"
            )
        assert status == TaskStatus.ESCALATED
        return transitions.escalate(
            task_id=task.pk, actor=agent, lease_token=lease.lease_token, reason="stuck"
        )

    return make


@pytest.fixture
def lease(task_in_own_queue: Callable[..., Task], agent: Any) -> transitions.Claim:
    """A task claimed by agent-smith with a 60 s lease."""
    return claim_task(task_in_own_queue(), agent, lease_seconds=60)


# --- create ---------------------------------------------------------------------------------


def test_create_makes_a_pending_task_with_a_created_event(agent: Any) -> None:
    task = transitions.create(
        actor=agent,
        title="Summarise the logs",
        description="all of them",
        payload={"path": "/var/log", "depth": 2},
        queue="reports",
        priority=7,
        max_failures=5,
    )

    stored = Task.objects.get(pk=task.pk)
    for fetched in (task, stored):
        assert fetched.title == "Summarise the logs"
        assert fetched.description == "all of them"
        assert fetched.payload == {"path": "/var/log", "depth": 2}
        assert fetched.queue == "reports"
        assert fetched.priority == 7
        assert fetched.max_failures == 5
        assert fetched.status == TaskStatus.PENDING
        assert fetched.failure_count == 0
        assert fetched.created_by_id == "agent-smith"
        assert fetched.leased_by_id is None
        assert fetched.lease_token is None
        assert fetched.leased_until is None
        assert fetched.result is None
        assert fetched.last_error is None
        assert fetched.run_after is None
    assert task.created_at == task.updated_at == db_now()
    assert timeline(task.pk) == [("created", "pending", "agent-smith")]
    (created,) = events_of(task.pk)
    assert created.payload == {"title": "Summarise the logs", "queue": "reports", "priority": 7}
    assert created.created_at == db_now()


def test_create_fills_in_the_defaults(agent: Any) -> None:
    task = transitions.create(actor=agent, title="Anything")

    assert task.description == ""
    assert task.payload == {}
    assert task.queue == "default"
    assert task.priority == 0
    assert task.max_failures == 3
    (created,) = events_of(task.pk)
    assert created.payload == {"title": "Anything", "queue": "default", "priority": 0}


def test_create_takes_max_failures_from_the_settings_when_none_is_given(
    agent: Any, settings: Any
) -> None:
    settings.TASKBOARD_MAX_FAILURES = 5

    assert transitions.create(actor=agent, title="Five strikes").max_failures == 5


def test_create_accepts_a_username_as_the_actor(agent: Any) -> None:
    task = transitions.create(actor="agent-smith", title="By name")

    assert task.created_by_id == "agent-smith"
    assert timeline(task.pk) == [("created", "pending", "agent-smith")]


# --- claim ----------------------------------------------------------------------------------


def test_claim_leases_the_task_to_the_claimer(make_task: Callable[..., Task], agent: Any) -> None:
    task = make_task(title="Only one")

    (lease,) = transitions.claim(actor=agent, lease_seconds=60)

    expected_until = db_now() + timedelta(seconds=60)
    stored = Task.objects.get(pk=task.pk)
    for claimed in (lease.task, stored):
        assert claimed.pk == task.pk
        assert claimed.status == TaskStatus.IN_PROGRESS
        assert claimed.leased_by_id == "agent-smith"
        assert claimed.leased_until == expected_until
        assert claimed.lease_seconds == 60
        assert str(claimed.lease_token) == lease.lease_token
    assert timeline(task.pk) == [
        ("created", "pending", "agent-smith"),
        ("claimed", "in_progress", "agent-smith"),
    ]
    claimed_event = events_of(task.pk)[-1]
    assert set(claimed_event.payload) == {"lease_until", "lease_seconds", "failure_count"}
    assert claimed_event.payload["lease_seconds"] == 60
    assert claimed_event.payload["failure_count"] == 0
    assert datetime.fromisoformat(claimed_event.payload["lease_until"]) == expected_until


def test_claim_leases_for_the_configured_default_when_no_length_is_asked(
    make_task: Callable[..., Task], agent: Any, settings: Any
) -> None:
    settings.TASKBOARD_LEASE_SECONDS = 300
    make_task()

    (lease,) = transitions.claim(actor=agent)

    assert lease.task.lease_seconds == 300
    assert lease.task.leased_until == db_now() + timedelta(seconds=300)


def test_claim_returns_nothing_when_nothing_is_claimable(
    task_in: Callable[[str], Task], agent: Any
) -> None:
    for status in TaskStatus.values:
        if status != TaskStatus.PENDING:
            task_in(status)

    assert transitions.claim(actor=agent, limit=10) == []


def test_claim_hands_out_the_highest_priority_first(
    make_task: Callable[..., Task], agent: Any
) -> None:
    low = make_task(priority=-5)
    high = make_task(priority=100)
    middle = make_task(priority=0)

    claimed = [transitions.claim(actor=agent)[0].task.pk for _ in range(3)]

    assert claimed == [high.pk, middle.pk, low.pk]


def test_claim_breaks_priority_ties_by_creation_time_then_id(
    make_task: Callable[..., Task], agent: Any
) -> None:
    first_id, second_id, third_id = (make_task(priority=1).pk for _ in range(3))
    # All three were created at the same now(); make the newest id the oldest task.
    Task.objects.filter(pk=third_id).update(created_at=db_now() - timedelta(minutes=5))

    one_by_one = [transitions.claim(actor=agent)[0].task.pk]
    one_by_one += [c.task.pk for c in transitions.claim(actor=agent, limit=2)]

    assert one_by_one == [third_id, first_id, second_id]


def test_claim_returns_its_tasks_in_claim_order(make_task: Callable[..., Task], agent: Any) -> None:
    tasks = [make_task(priority=p) for p in (1, 9, 5, 3)]

    claims = transitions.claim(actor=agent, limit=4)

    assert [c.task.priority for c in claims] == [9, 5, 3, 1]
    assert {c.task.pk for c in claims} == {t.pk for t in tasks}
    # Events follow the same order.
    claimed_events = TaskEvent.objects.filter(type="claimed").order_by("id")
    assert [e.task_id for e in claimed_events] == [c.task.pk for c in claims]


def test_claim_hands_out_at_most_limit_tasks(make_task: Callable[..., Task], agent: Any) -> None:
    tasks = [make_task(priority=p) for p in range(5)]

    claims = transitions.claim(actor=agent, limit=2)

    assert [c.task.pk for c in claims] == [tasks[4].pk, tasks[3].pk]
    assert Task.objects.filter(status=TaskStatus.PENDING).count() == 3


def test_claim_only_looks_in_the_queues_it_names(
    make_task: Callable[..., Task], agent: Any
) -> None:
    in_a = make_task(queue="a", priority=1)
    in_b = make_task(queue="b", priority=2)
    make_task(queue="c", priority=1000)

    claims = transitions.claim(actor=agent, queues=["a", "b"], limit=10)

    assert [c.task.pk for c in claims] == [in_b.pk, in_a.pk]
    assert transitions.claim(actor=agent, queues=["nothing-here"]) == []


@pytest.mark.parametrize("queues", [None, []], ids=["none", "empty-list"])
def test_claim_looks_in_every_queue_when_none_is_named(
    make_task: Callable[..., Task], agent: Any, queues: list[str] | None
) -> None:
    for queue in ("a", "b", "default"):
        make_task(queue=queue)

    claims = transitions.claim(actor=agent, queues=queues, limit=10)

    assert sorted(c.task.queue for c in claims) == ["a", "b", "default"]


def test_claim_does_not_hand_out_a_task_before_its_run_after(
    make_task: Callable[..., Task], agent: Any
) -> None:
    later = make_task(run_after=db_now() + timedelta(seconds=1), priority=10)
    due = make_task(run_after=db_now() - timedelta(seconds=1))

    claims = transitions.claim(actor=agent, limit=10)

    assert [c.task.pk for c in claims] == [due.pk]
    assert Task.objects.get(pk=later.pk).status == TaskStatus.PENDING


def test_claim_hands_out_a_task_whose_run_after_is_now(
    make_task: Callable[..., Task], agent: Any
) -> None:
    task = make_task(run_after=db_now())

    assert [c.task.pk for c in transitions.claim(actor=agent)] == [task.pk]


def test_claim_does_not_hand_out_a_live_lease_again(
    lease: transitions.Claim, other_agent: Any
) -> None:
    assert transitions.claim(actor=other_agent, limit=10) == []
    assert state_of(lease.task.pk)["leased_by"] == "agent-smith"


def test_each_claim_issues_a_fresh_lease_token(make_task: Callable[..., Task], agent: Any) -> None:
    make_task()
    make_task()
    tokens = []
    for _ in range(3):
        claims = transitions.claim(actor=agent, limit=2)
        assert len(claims) == 2
        for claim in claims:
            assert str(Task.objects.get(pk=claim.task.pk).lease_token) == claim.lease_token
            tokens.append(claim.lease_token)
            transitions.release(task_id=claim.task.pk, actor=agent, lease_token=claim.lease_token)

    assert len(set(tokens)) == len(tokens) == 6
    assert all(uuid.UUID(token).version == 4 for token in tokens)


def test_claim_with_a_limit_below_one_claims_nothing(
    make_task: Callable[..., Task], agent: Any
) -> None:
    make_task()

    assert transitions.claim(actor=agent, limit=0) == []
    assert Task.objects.get().status == TaskStatus.PENDING


# --- heartbeat ------------------------------------------------------------------------------


def test_heartbeat_extends_the_lease_by_the_claimed_length(
    lease: transitions.Claim, agent: Any
) -> None:
    move_lease_end(lease.task.pk, 5)

    task = transitions.heartbeat(task_id=lease.task.pk, actor=agent, lease_token=lease.lease_token)

    assert task.leased_until == db_now() + timedelta(seconds=60)
    assert task.status == TaskStatus.IN_PROGRESS
    assert task.leased_by_id == "agent-smith"
    assert str(task.lease_token) == lease.lease_token
    assert state_of(task.pk)["leased_until"] == task.leased_until
    assert timeline(task.pk)[-1] == ("heartbeat", "in_progress", "agent-smith")
    beat = events_of(task.pk)[-1]
    assert set(beat.payload) == {"lease_until"}
    assert datetime.fromisoformat(beat.payload["lease_until"]) == task.leased_until


def test_heartbeat_with_lease_seconds_extends_by_that_length(
    lease: transitions.Claim, agent: Any
) -> None:
    task = transitions.heartbeat(
        task_id=lease.task.pk, actor=agent, lease_token=lease.lease_token, lease_seconds=600
    )

    assert task.leased_until == db_now() + timedelta(seconds=600)
    assert task.lease_seconds == 600


def test_a_heartbeat_without_a_length_uses_the_one_last_asked_for(
    lease: transitions.Claim, agent: Any
) -> None:
    # The SQL's documented choice ("default: the length last asked for").
    transitions.heartbeat(
        task_id=lease.task.pk, actor=agent, lease_token=lease.lease_token, lease_seconds=600
    )
    move_lease_end(lease.task.pk, 5)

    task = transitions.heartbeat(task_id=lease.task.pk, actor=agent, lease_token=lease.lease_token)

    assert task.leased_until == db_now() + timedelta(seconds=600)


def test_heartbeat_records_its_progress_in_the_event(lease: transitions.Claim, agent: Any) -> None:
    transitions.heartbeat(
        task_id=lease.task.pk,
        actor=agent,
        lease_token=lease.lease_token,
        progress={"done": 3, "of": 10, "stage": "parsing"},
    )

    beat = events_of(lease.task.pk)[-1]
    assert beat.type == "heartbeat"
    assert set(beat.payload) == {"lease_until", "progress"}
    assert beat.payload["progress"] == {"done": 3, "of": 10, "stage": "parsing"}


def test_heartbeat_records_its_progress_exactly_as_given(
    lease: transitions.Claim, agent: Any
) -> None:
    progress = {"stage": "upload", "eta": None, "detail": {"retry": None}}

    transitions.heartbeat(
        task_id=lease.task.pk, actor=agent, lease_token=lease.lease_token, progress=progress
    )

    assert events_of(lease.task.pk)[-1].payload["progress"] == progress


# --- complete -------------------------------------------------------------------------------


def test_complete_marks_the_task_done_with_its_result(lease: transitions.Claim, agent: Any) -> None:
    result = {"summary": "ok", "lines": [1, 2, None]}

    task = transitions.complete(
        task_id=lease.task.pk, actor=agent, lease_token=lease.lease_token, result=result
    )

    stored = Task.objects.get(pk=task.pk)
    for done in (task, stored):
        assert done.status == TaskStatus.DONE
        assert done.result == result
        assert done.leased_by_id is None
        assert done.lease_token is None
        assert done.leased_until is None
        assert done.lease_seconds is None
    assert timeline(task.pk)[-1] == ("completed", "done", "agent-smith")
    assert events_of(task.pk)[-1].payload == {"result": result}


@pytest.mark.parametrize(
    "result",
    ["100% done", {"text": "%(actor)s %s %%"}, [1, "two", None], 0, False, ""],
    ids=["percent", "placeholders", "list", "zero", "false", "empty-string"],
)
def test_complete_stores_any_json_result_verbatim(
    lease: transitions.Claim, agent: Any, result: Any
) -> None:
    task = transitions.complete(
        task_id=lease.task.pk, actor=agent, lease_token=lease.lease_token, result=result
    )

    assert task.result == result
    assert Task.objects.get(pk=task.pk).result == result
    assert events_of(task.pk)[-1].payload == {"result": result}


def test_complete_without_a_result_records_a_null_result(
    lease: transitions.Claim, agent: Any
) -> None:
    task = transitions.complete(task_id=lease.task.pk, actor=agent, lease_token=lease.lease_token)

    assert task.status == TaskStatus.DONE
    assert task.result is None
    assert events_of(task.pk)[-1].payload == {"result": None}


# --- fail -----------------------------------------------------------------------------------


def test_fail_counts_a_strike_and_puts_the_task_back_to_pending(
    lease: transitions.Claim, agent: Any
) -> None:
    task = transitions.fail(
        task_id=lease.task.pk, actor=agent, lease_token=lease.lease_token, error="disk full"
    )

    assert task.status == TaskStatus.PENDING
    assert task.failure_count == 1
    assert task.last_error == "disk full"
    assert task.run_after is None
    assert (task.leased_by_id, task.lease_token, task.leased_until) == (None, None, None)
    assert state_of(task.pk)["failure_count"] == 1
    assert timeline(task.pk)[-1] == ("failed", "pending", "agent-smith")
    assert events_of(task.pk)[-1].payload == {
        "error": "disk full",
        "failure_count": 1,
        "max_failures": 3,
    }
    # Due again at once.
    assert [c.task.pk for c in transitions.claim(actor=agent)] == [task.pk]


def test_fail_with_retry_after_holds_the_task_back_until_then(
    lease: transitions.Claim, agent: Any
) -> None:
    task = transitions.fail(
        task_id=lease.task.pk,
        actor=agent,
        lease_token=lease.lease_token,
        error="rate limited",
        retry_after=30,
    )

    assert task.status == TaskStatus.PENDING
    assert task.run_after == db_now() + timedelta(seconds=30)
    failed = events_of(task.pk)[-1]
    assert set(failed.payload) == {
        "error",
        "failure_count",
        "max_failures",
        "retry_after",
        "run_after",
    }
    assert failed.payload["retry_after"] == 30
    assert datetime.fromisoformat(failed.payload["run_after"]) == task.run_after
    assert transitions.claim(actor=agent) == []

    Task.objects.filter(pk=task.pk).update(run_after=db_now() - timedelta(seconds=1))

    assert [c.task.pk for c in transitions.claim(actor=agent)] == [task.pk]


def test_the_failure_that_reaches_max_failures_escalates_the_task(
    task_in_own_queue: Callable[..., Task], agent: Any
) -> None:
    task = task_in_own_queue()
    for strike in (1, 2, 3):
        lease = claim_task(task, agent)
        task = transitions.fail(
            task_id=task.pk,
            actor=agent,
            lease_token=lease.lease_token,
            error=f"strike {strike}",
            retry_after=0,
        )

    assert task.status == TaskStatus.ESCALATED
    assert task.failure_count == 3
    assert task.last_error == "strike 3"
    assert (task.leased_by_id, task.lease_token, task.leased_until) == (None, None, None)
    assert timeline(task.pk) == [
        ("created", "pending", "agent-smith"),
        ("claimed", "in_progress", "agent-smith"),
        ("failed", "pending", "agent-smith"),
        ("claimed", "in_progress", "agent-smith"),
        ("failed", "pending", "agent-smith"),
        ("claimed", "in_progress", "agent-smith"),
        ("failed", "escalated", "agent-smith"),
        ("escalated", "escalated", "agent-smith"),
    ]
    failed, escalated = events_of(task.pk)[-2:]
    assert failed.payload == {
        "error": "strike 3",
        "failure_count": 3,
        "max_failures": 3,
        "retry_after": 0,
    }
    assert escalated.payload == {
        "reason": "failed 3 of 3 times",
        "error": "strike 3",
        "failure_count": 3,
    }
    assert transitions.claim(actor=agent, queues=[task.queue]) == []


def test_a_task_with_max_failures_one_escalates_on_its_first_failure(
    task_in_own_queue: Callable[..., Task], agent: Any
) -> None:
    task = task_in_own_queue(max_failures=1)
    lease = claim_task(task, agent)

    task = transitions.fail(
        task_id=task.pk, actor=agent, lease_token=lease.lease_token, error="no", retry_after=60
    )

    assert task.status == TaskStatus.ESCALATED
    assert task.failure_count == 1
    assert task.run_after is None  # an escalating failure schedules no retry
    assert [e.type for e in events_of(task.pk)] == ["created", "claimed", "failed", "escalated"]


# --- release --------------------------------------------------------------------------------


def test_release_gives_the_task_back_without_a_strike(
    lease: transitions.Claim, agent: Any, other_agent: Any
) -> None:
    task = transitions.release(task_id=lease.task.pk, actor=agent, lease_token=lease.lease_token)

    assert task.status == TaskStatus.PENDING
    assert task.failure_count == 0
    assert task.last_error is None
    assert (task.leased_by_id, task.lease_token, task.leased_until) == (None, None, None)
    assert timeline(task.pk)[-1] == ("released", "pending", "agent-smith")
    assert events_of(task.pk)[-1].payload == {}
    assert [c.task.pk for c in transitions.claim(actor=other_agent)] == [task.pk]


# --- escalate -------------------------------------------------------------------------------


def test_escalate_hands_the_task_to_the_humans_with_the_reason(
    lease: transitions.Claim, agent: Any
) -> None:
    task = transitions.escalate(
        task_id=lease.task.pk, actor=agent, lease_token=lease.lease_token, reason="needs a human"
    )

    assert task.status == TaskStatus.ESCALATED
    assert task.last_error == "needs a human"
    assert task.failure_count == 0
    assert (task.leased_by_id, task.lease_token, task.leased_until) == (None, None, None)
    assert timeline(task.pk)[-1] == ("escalated", "escalated", "agent-smith")
    assert events_of(task.pk)[-1].payload == {"reason": "needs a human", "failure_count": 0}
    assert transitions.claim(actor=agent, limit=10) == []


# --- the lease holder's refusals ------------------------------------------------------------

HOLDER_TRANSITIONS: dict[str, Callable[..., Task]] = {
    "heartbeat": lambda **kw: transitions.heartbeat(**kw, lease_seconds=600, progress={"p": 1}),
    "complete": lambda **kw: transitions.complete(**kw, result={"ok": True}),
    "fail": lambda **kw: transitions.fail(**kw, error="boom", retry_after=5),
    "release": transitions.release,
    "escalate": lambda **kw: transitions.escalate(**kw, reason="stuck"),
}
holder_transitions = pytest.mark.parametrize(
    "transition", HOLDER_TRANSITIONS.values(), ids=HOLDER_TRANSITIONS.keys()
)


def assert_refused_untouched(
    transition: Callable[..., Task], *, task_id: int, status: str, **kwargs: Any
) -> None:
    """Assert the call raises LeaseLost and changes neither the task nor its events."""
    before, events_before = state_of(task_id), timeline(task_id)

    with pytest.raises(LeaseLost) as refused:
        transition(task_id=task_id, **kwargs)

    assert refused.value.task_id == task_id
    assert refused.value.status == status
    assert state_of(task_id) == before
    assert timeline(task_id) == events_before


@holder_transitions
def test_the_holder_transitions_refuse_a_wrong_token(
    transition: Callable[..., Task], lease: transitions.Claim, agent: Any
) -> None:
    assert_refused_untouched(
        transition,
        task_id=lease.task.pk,
        status="in_progress",
        actor=agent,
        lease_token=str(uuid.uuid4()),
    )


@holder_transitions
@pytest.mark.parametrize("token", ["not-a-token", "", "1234"])
def test_the_holder_transitions_refuse_a_malformed_token(
    transition: Callable[..., Task], lease: transitions.Claim, agent: Any, token: str
) -> None:
    assert_refused_untouched(
        transition, task_id=lease.task.pk, status="in_progress", actor=agent, lease_token=token
    )


@holder_transitions
def test_the_holder_transitions_refuse_another_agent_even_with_the_right_token(
    transition: Callable[..., Task], lease: transitions.Claim, other_agent: Any
) -> None:
    assert_refused_untouched(
        transition,
        task_id=lease.task.pk,
        status="in_progress",
        actor=other_agent,
        lease_token=lease.lease_token,
    )


@holder_transitions
@pytest.mark.parametrize("seconds_from_now", [-1, 0], ids=["in-the-past", "now"])
def test_the_holder_transitions_refuse_an_expired_lease(
    transition: Callable[..., Task],
    lease: transitions.Claim,
    agent: Any,
    seconds_from_now: int,
) -> None:
    move_lease_end(lease.task.pk, seconds_from_now)

    assert_refused_untouched(
        transition,
        task_id=lease.task.pk,
        status="in_progress",
        actor=agent,
        lease_token=lease.lease_token,
    )


@holder_transitions
@pytest.mark.parametrize("ended_by", ["complete", "release", "fail", "escalate"])
def test_the_holder_transitions_refuse_a_task_no_longer_in_progress(
    transition: Callable[..., Task], lease: transitions.Claim, agent: Any, ended_by: str
) -> None:
    ended = HOLDER_TRANSITIONS[ended_by](
        task_id=lease.task.pk, actor=agent, lease_token=lease.lease_token
    )

    assert_refused_untouched(
        transition,
        task_id=lease.task.pk,
        status=ended.status,
        actor=agent,
        lease_token=lease.lease_token,
    )


def test_a_lease_that_ends_now_is_refused_to_its_holder_and_claimable_by_others(
    lease: transitions.Claim, agent: Any, other_agent: Any
) -> None:
    # At the very instant of leased_until the lease is expired for both sides: there is no
    # moment when the holder may still act and another claim may take the task too.
    move_lease_end(lease.task.pk, 0)

    with pytest.raises(LeaseLost):
        transitions.heartbeat(task_id=lease.task.pk, actor=agent, lease_token=lease.lease_token)
    (reclaimed,) = transitions.claim(actor=other_agent)

    assert reclaimed.task.pk == lease.task.pk
    assert reclaimed.task.leased_by_id == "agent-jones"


# --- the staff transitions ------------------------------------------------------------------


@pytest.mark.parametrize("status", ["escalated", "done", "cancelled"])
def test_requeue_puts_a_finished_task_back_with_its_strikes_reset(
    task_in: Callable[[str], Task], staff: Any, agent: Any, status: str
) -> None:
    task = task_in(status)
    Task.objects.filter(pk=task.pk).update(failure_count=2, run_after=db_now() + timedelta(hours=1))

    requeued = transitions.requeue(task_id=task.pk, actor=staff, note="try again")

    assert requeued.status == TaskStatus.PENDING
    assert requeued.failure_count == 0
    assert requeued.run_after is None
    assert requeued.result is None
    assert state_of(task.pk)["status"] == "pending"
    assert timeline(task.pk)[-1] == ("requeued", "pending", "ops-alice")
    assert events_of(task.pk)[-1].payload == {"note": "try again", "previous_status": status}
    assert [c.task.pk for c in transitions.claim(actor=agent, queues=[task.queue])] == [task.pk]


def test_requeue_of_a_done_task_clears_its_result(
    task_in_own_queue: Callable[..., Task], agent: Any, staff: Any
) -> None:
    task = task_in_own_queue()
    lease = claim_task(task, agent)
    transitions.complete(task_id=task.pk, actor=agent, lease_token=lease.lease_token, result=1)

    requeued = transitions.requeue(task_id=task.pk, actor=staff)

    assert requeued.result is None
    assert events_of(task.pk)[-1].payload == {"previous_status": "done"}


def test_resolve_settles_an_escalated_task_as_done(
    task_in: Callable[[str], Task], staff: Any
) -> None:
    task = task_in("escalated")

    resolved = transitions.resolve(
        task_id=task.pk, actor=staff, note="fixed by hand", result={"by": "hand"}
    )

    assert resolved.status == TaskStatus.DONE
    assert resolved.result == {"by": "hand"}
    assert timeline(task.pk)[-1] == ("resolved", "done", "ops-alice")
    assert events_of(task.pk)[-1].payload == {"note": "fixed by hand", "result": {"by": "hand"}}


def test_resolve_without_note_or_result_records_a_null_result(
    task_in: Callable[[str], Task], staff: Any
) -> None:
    task = task_in("escalated")

    resolved = transitions.resolve(task_id=task.pk, actor=staff)

    assert resolved.status == TaskStatus.DONE
    assert resolved.result is None
    assert events_of(task.pk)[-1].payload == {"result": None}


@pytest.mark.parametrize("status", ["pending", "escalated"])
def test_cancel_withdraws_a_pending_or_escalated_task(
    task_in: Callable[[str], Task], staff: Any, agent: Any, status: str
) -> None:
    task = task_in(status)

    cancelled = transitions.cancel(task_id=task.pk, actor=staff, note="not needed")

    assert cancelled.status == TaskStatus.CANCELLED
    assert timeline(task.pk)[-1] == ("cancelled", "cancelled", "ops-alice")
    assert events_of(task.pk)[-1].payload == {"note": "not needed", "previous_status": status}
    assert transitions.claim(actor=agent, queues=[task.queue]) == []


STAFF_TRANSITIONS: dict[str, tuple[Callable[..., Task], tuple[str, ...]]] = {
    "requeue": (transitions.requeue, ("escalated", "done", "cancelled")),
    "resolve": (transitions.resolve, ("escalated",)),
    "cancel": (transitions.cancel, ("pending", "escalated")),
}


@pytest.mark.parametrize(
    ("action", "status"),
    [
        (action, status)
        for action, (_, allowed) in STAFF_TRANSITIONS.items()
        for status in TaskStatus.values
        if status not in allowed
    ],
)
def test_the_staff_transitions_refuse_a_task_in_the_wrong_status(
    task_in: Callable[[str], Task], staff: Any, action: str, status: str
) -> None:
    transition, allowed = STAFF_TRANSITIONS[action]
    task = task_in(status)
    before, events_before = state_of(task.pk), timeline(task.pk)

    with pytest.raises(InvalidTransition) as refused:
        transition(task_id=task.pk, actor=staff, note="no")

    assert refused.value.task_id == task.pk
    assert refused.value.status == status
    assert refused.value.action == action
    assert tuple(refused.value.allowed) == allowed
    assert state_of(task.pk) == before
    assert timeline(task.pk) == events_before


# --- a task that does not exist -------------------------------------------------------------

MISSING_TASK_ID = 987_654_321


@holder_transitions
@pytest.mark.parametrize("token", ["well-formed", "malformed"])
def test_the_holder_transitions_report_a_missing_task(
    transition: Callable[..., Task], agent: Any, token: str
) -> None:
    lease_token = str(uuid.uuid4()) if token == "well-formed" else "nope"

    with pytest.raises(TaskNotFound) as missing:
        transition(task_id=MISSING_TASK_ID, actor=agent, lease_token=lease_token)

    assert missing.value.task_id == MISSING_TASK_ID
    assert not TaskEvent.objects.exists()


@pytest.mark.parametrize("action", STAFF_TRANSITIONS)
def test_the_staff_transitions_report_a_missing_task(staff: Any, action: str) -> None:
    transition, _ = STAFF_TRANSITIONS[action]

    with pytest.raises(TaskNotFound) as missing:
        transition(task_id=MISSING_TASK_ID, actor=staff)

    assert missing.value.task_id == MISSING_TASK_ID
    assert not TaskEvent.objects.exists()


def _prepared_statements() -> list[tuple[str, int, int]]:
    """The statements prepared on Django's session: (text, generic plans, custom plans)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements")
        return list(cursor.fetchall())


def _claim_and_complete(agent: Any, **claim: Any) -> None:
    [claimed] = transitions.claim(actor=agent, **claim)
    transitions.complete(task_id=claimed.task.id, actor=agent, lease_token=claimed.lease_token)


def test_transitions_are_prepared_once_per_session_and_planned_once(agent: Any) -> None:
    for n in range(8):
        transitions.create(actor=agent, title=f"any {n}")
        transitions.create(actor=agent, title=f"images {n}", queue="images")
    for _ in range(7):
        _claim_and_complete(agent)
        _claim_and_complete(agent, queues=["images"])

    prepared = _prepared_statements()
    claims = [row for row in prepared if "FOR UPDATE SKIP LOCKED" in row[0]]
    completes = [row for row in prepared if "'completed'" in row[0]]
    # One statement for a claim of any queue and one for named queues, each planned for
    # itself: after PostgreSQL's first five custom plans, the one generic plan is reused.
    assert len(claims) == 2, prepared
    assert sum("queue = ANY" in text for text, _, _ in claims) == 1
    assert all(generic >= 1 for _, generic, _ in claims + completes), prepared
    assert len(completes) == 1


@pytest.mark.django_db(transaction=True)
def test_a_claim_over_a_large_backlog_runs_on_a_generic_plan(agent: Any) -> None:
    """With 20,000 pending tasks (analysed), a claim of one task is still planned once: a
    bound LIMIT would be costed as a tenth of the rows and keep PostgreSQL planning it anew."""
    seed = transitions.create(actor=agent, title="seed", queue="images")
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT string_agg(quote_ident(column_name), ', ') FROM information_schema.columns"
            " WHERE table_name = 'tasks' AND column_name <> 'id'"
        )
        columns = cursor.fetchone()[0]
        cursor.execute(
            f"INSERT INTO tasks ({columns}) SELECT {columns} FROM tasks, generate_series(1, 20000)"
            " WHERE id = %s",
            [seed.id],
        )
        cursor.execute("ANALYZE tasks")
    for _ in range(7):
        _claim_and_complete(agent)
        _claim_and_complete(agent, queues=["images"])

    claims = [row for row in _prepared_statements() if "FOR UPDATE SKIP LOCKED" in row[0]]
    assert len(claims) == 2
    assert all(generic >= 1 for _, generic, _ in claims), claims


def test_without_prepared_statements_nothing_is_prepared(agent: Any, settings: Any) -> None:
    settings.DATABASE_PREPARED_STATEMENTS = False
    transitions.create(actor=agent, title="one")
    _claim_and_complete(agent)

    assert _prepared_statements() == []


@pytest.mark.django_db(transaction=True)
def test_a_column_added_under_a_prepared_claim_does_not_fail_the_next_claim(
    agent: Any, open_raw_connection: Callable[..., Any]
) -> None:
    """A migration that adds a column to tasks while a server's sessions live: the claim
    they prepared returns ``tasks.*``, whose shape changed; PostgreSQL refuses to run it
    ("cached plan must not change result type"), and the claim prepares it again."""
    for n in range(3):
        transitions.create(actor=agent, title=f"task {n}")
    _claim_and_complete(agent)
    _claim_and_complete(agent)
    admin = open_raw_connection(autocommit=True)
    admin.execute("ALTER TABLE tasks ADD COLUMN added_by_a_migration integer")
    try:
        _claim_and_complete(agent)
    finally:
        admin.execute("ALTER TABLE tasks DROP COLUMN added_by_a_migration")
    assert Task.objects.filter(status=TaskStatus.DONE).count() == 3
