"""Claims under real concurrency, and leases that run out in real time.

Every test here commits for real (``transaction=True``), so that several connections see
each other's work and PostgreSQL's now() moves on. Threads use Django's per-thread
connection and close it when done; a barrier makes them start together.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection

from board import transitions
from board.exceptions import LeaseLost
from board.models import Task, TaskEvent, TaskStatus
from tests.factories import UserFactory

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("fast_password_hashing"),
]

THREAD_TIMEOUT = 30


def in_threads(count: int, work: Callable[[int], Any]) -> list[Any]:
    """Run ``work(i)`` in ``count`` threads released together; return their results in order.

    Each thread closes its own database connection when it ends. An exception in any
    thread is raised here.
    """
    barrier = threading.Barrier(count)
    results: list[Any] = [None] * count
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            barrier.wait(timeout=THREAD_TIMEOUT)
            results[index] = work(index)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=THREAD_TIMEOUT)
    assert not any(thread.is_alive() for thread in threads), "a thread is still running"
    if errors:
        raise errors[0]
    return results


def expire(task_id: int) -> None:
    """Move a lease's deadline into the past (test setup only)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE tasks SET leased_until = now() - interval '1 second' WHERE id = %s", [task_id]
        )


def timeline(task_id: int) -> list[tuple[str, str, str]]:
    """Return the task's events as (type, status, actor), oldest first."""
    return list(
        TaskEvent.objects.filter(task_id=task_id)
        .order_by("id")
        .values_list("type", "status", "actor")
    )


def lease_of(task_id: int) -> tuple[Any, ...]:
    return Task.objects.values_list("status", "leased_by", "lease_token", "leased_until").get(
        pk=task_id
    )


HOLDER_CALLS: dict[str, Callable[..., Task]] = {
    "heartbeat": lambda **kw: transitions.heartbeat(**kw, progress={"p": 1}),
    "complete": lambda **kw: transitions.complete(**kw, result="stale"),
    "fail": lambda **kw: transitions.fail(**kw, error="stale"),
    "release": transitions.release,
    "escalate": lambda **kw: transitions.escalate(**kw, reason="stale"),
}


def test_concurrent_claimers_get_every_task_exactly_once(
    make_task: Callable[..., Task],
) -> None:
    tasks = [make_task(priority=i % 7, queue=f"q{i % 3}") for i in range(150)]
    agents = [UserFactory.create(username=f"racer-{i}") for i in range(16)]

    def claim_until_empty(index: int) -> list[tuple[int, str]]:
        got: list[tuple[int, str]] = []
        while claims := transitions.claim(actor=agents[index], limit=1 + index % 3):
            got += [(c.task.pk, c.lease_token) for c in claims]
        return got

    results = in_threads(16, claim_until_empty)

    claimed = Counter(task_id for got in results for task_id, _ in got)
    assert claimed == Counter(t.pk for t in tasks)  # each one, exactly once
    tokens = [token for got in results for _, token in got]
    assert len(set(tokens)) == len(tokens)
    assert not Task.objects.exclude(status=TaskStatus.IN_PROGRESS).exists()
    # Through the username: django-stubs types a to_field foreign key's values as ints.
    holders = dict(Task.objects.values_list("id", "leased_by__username"))
    for index, got in enumerate(results):
        assert all(holders[task_id] == f"racer-{index}" for task_id, _ in got)
    claimed_events = Counter(
        TaskEvent.objects.filter(type="claimed").values_list("task_id", flat=True)
    )
    assert claimed_events == claimed


def test_a_claim_passes_over_a_row_locked_by_another_transaction_without_waiting(
    make_task: Callable[..., Task], agent: Any, open_raw_connection: Callable[..., Any]
) -> None:
    best = make_task(priority=10)
    runner_up = make_task(priority=5)
    locker = open_raw_connection()  # psycopg opens a transaction on the first statement
    locker.execute("SELECT id FROM tasks WHERE id = %s FOR UPDATE", [best.pk])
    with connection.cursor() as cursor:
        # Were the claim to wait for the lock, fail after 5 s instead of hanging.
        cursor.execute("SET lock_timeout = '5s'")

    started = time.monotonic()
    claims = transitions.claim(actor=agent, limit=2)
    elapsed = time.monotonic() - started

    assert [c.task.pk for c in claims] == [runner_up.pk]
    assert elapsed < 2
    locker.rollback()
    assert Task.objects.get(pk=best.pk).status == TaskStatus.PENDING
    assert [c.task.pk for c in transitions.claim(actor=agent)] == [best.pk]


def test_concurrent_claims_of_one_expired_lease_record_its_expiry_once(
    make_task: Callable[..., Task], agent: Any
) -> None:
    task = make_task()
    transitions.claim(actor=agent)
    expire(task.pk)
    agents = [UserFactory.create(username=f"racer-{i}") for i in range(8)]

    results = in_threads(8, lambda i: transitions.claim(actor=agents[i]))

    winners = [i for i, claims in enumerate(results) if claims]
    assert len(winners) == 1
    assert [c.task.pk for c in results[winners[0]]] == [task.pk]
    assert Task.objects.get(pk=task.pk).failure_count == 1
    assert timeline(task.pk) == [
        ("created", "pending", "agent-smith"),
        ("claimed", "in_progress", "agent-smith"),
        ("expired", "pending", "system"),
        ("claimed", "in_progress", f"racer-{winners[0]}"),
    ]


def test_an_expired_lease_is_reclaimed_and_its_expiry_recorded(
    make_task: Callable[..., Task], agent: Any, other_agent: Any
) -> None:
    task = make_task()
    (stale,) = transitions.claim(actor=agent, lease_seconds=1)
    assert transitions.claim(actor=other_agent) == []

    time.sleep(1.2)
    (fresh,) = transitions.claim(actor=other_agent, lease_seconds=60)

    assert fresh.task.pk == task.pk
    assert fresh.lease_token != stale.lease_token
    assert fresh.task.leased_by_id == "agent-jones"
    assert fresh.task.failure_count == 1
    assert fresh.task.last_error == "lease expired (held by agent-smith)"
    assert timeline(task.pk) == [
        ("created", "pending", "agent-smith"),
        ("claimed", "in_progress", "agent-smith"),
        ("expired", "pending", "system"),
        ("claimed", "in_progress", "agent-jones"),
    ]
    expired = TaskEvent.objects.get(task_id=task.pk, type="expired")
    assert expired.payload["previous_holder"] == "agent-smith"
    assert expired.payload["failure_count"] == 1
    assert expired.payload["max_failures"] == 3
    assert expired.payload["reason"] == "lease_expired"
    assert set(expired.payload) == {
        "previous_holder",
        "previous_holder_seen_at",
        "leased_until",
        "reason",
        "failure_count",
        "max_failures",
    }
    claimed = TaskEvent.objects.filter(task_id=task.pk, type="claimed").last()
    assert claimed is not None
    assert claimed.payload["failure_count"] == 1


@pytest.mark.parametrize("call", HOLDER_CALLS.values(), ids=HOLDER_CALLS.keys())
def test_the_stale_holder_is_refused_after_its_task_was_reclaimed(
    make_task: Callable[..., Task],
    agent: Any,
    other_agent: Any,
    call: Callable[..., Task],
) -> None:
    task = make_task()
    (stale,) = transitions.claim(actor=agent)
    expire(task.pk)
    (fresh,) = transitions.claim(actor=other_agent)
    lease_before, events_before = lease_of(task.pk), timeline(task.pk)

    with pytest.raises(LeaseLost) as refused:
        call(task_id=task.pk, actor=agent, lease_token=stale.lease_token)

    assert refused.value.status == "in_progress"
    assert lease_of(task.pk) == lease_before
    assert timeline(task.pk) == events_before
    done = transitions.complete(task_id=task.pk, actor=other_agent, lease_token=fresh.lease_token)
    assert done.status == TaskStatus.DONE


def test_a_token_from_an_earlier_lease_is_refused_even_to_the_same_agent(
    make_task: Callable[..., Task], agent: Any
) -> None:
    task = make_task()
    (first,) = transitions.claim(actor=agent)
    expire(task.pk)
    (second,) = transitions.claim(actor=agent)

    with pytest.raises(LeaseLost):
        transitions.complete(task_id=task.pk, actor=agent, lease_token=first.lease_token)
    assert transitions.complete(task_id=task.pk, actor=agent, lease_token=second.lease_token)


def test_the_third_expired_lease_escalates_and_the_claim_goes_on_to_the_next_task(
    make_task: Callable[..., Task], agent: Any, other_agent: Any
) -> None:
    doomed = make_task(priority=10)
    next_best = make_task(priority=0)
    agents = [agent, other_agent]
    for strike in range(3):
        (lease,) = transitions.claim(actor=agents[strike % 2])
        assert lease.task.pk == doomed.pk
        expire(doomed.pk)

    claims = transitions.claim(actor=agent)

    assert [c.task.pk for c in claims] == [next_best.pk]
    task = Task.objects.get(pk=doomed.pk)
    assert task.status == TaskStatus.ESCALATED
    assert task.failure_count == 3
    assert task.last_error == "lease expired (held by agent-smith)"
    assert (task.leased_by_id, task.lease_token, task.leased_until) == (None, None, None)
    assert timeline(doomed.pk) == [
        ("created", "pending", "agent-smith"),
        ("claimed", "in_progress", "agent-smith"),
        ("expired", "pending", "system"),
        ("claimed", "in_progress", "agent-jones"),
        ("expired", "pending", "system"),
        ("claimed", "in_progress", "agent-smith"),
        ("expired", "escalated", "system"),
        ("escalated", "escalated", "system"),
    ]
    escalated = TaskEvent.objects.filter(task_id=doomed.pk).last()
    assert escalated is not None
    assert escalated.payload == {"reason": "lease expired 3 of 3 times", "failure_count": 3}
    # Its events come before the next task's claim, in the same claim.
    last_claim = TaskEvent.objects.get(task_id=next_best.pk, type="claimed")
    assert escalated.pk < last_claim.pk


def set_lease_end(task_id: int, seconds_from_now: float) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE tasks SET leased_until = now() + make_interval(secs => %s) WHERE id = %s",
            [seconds_from_now, task_id],
        )


def test_a_claim_whose_candidate_escalated_looks_again_for_the_next_one(
    make_task: Callable[..., Task], agent: Any, other_agent: Any
) -> None:
    # limit=1: the first expired lease found (the oldest) is on its last strike and
    # escalates; the claim must go on and hand out the other expired task.
    doomed = make_task(max_failures=1)
    survivor = make_task(max_failures=3)
    transitions.claim(actor=agent, limit=2)
    set_lease_end(doomed.pk, -20)
    set_lease_end(survivor.pk, -10)

    claims = transitions.claim(actor=other_agent, limit=1)

    assert [c.task.pk for c in claims] == [survivor.pk]
    assert claims[0].task.failure_count == 1
    assert Task.objects.get(pk=doomed.pk).status == TaskStatus.ESCALATED
    assert timeline(doomed.pk)[-2:] == [
        ("expired", "escalated", "system"),
        ("escalated", "escalated", "system"),
    ]


def test_an_expired_lease_is_claimed_in_priority_order(
    make_task: Callable[..., Task], agent: Any, other_agent: Any
) -> None:
    low = make_task(priority=0)
    high = make_task(priority=10)
    transitions.claim(actor=agent, limit=2)
    make_task(priority=5)
    set_lease_end(low.pk, -20)  # expired first
    set_lease_end(high.pk, -10)

    claims = transitions.claim(actor=other_agent, limit=1)

    assert [c.task.pk for c in claims] == [high.pk]


def test_the_third_failure_escalates_and_the_next_claim_skips_the_task(
    make_task: Callable[..., Task], agent: Any, other_agent: Any, staff: Any
) -> None:
    doomed = make_task(priority=10)
    next_best = make_task(priority=0)
    agents = [agent, other_agent, agent]
    for strike, actor in enumerate(agents, start=1):
        (lease,) = transitions.claim(actor=actor)
        assert lease.task.pk == doomed.pk
        transitions.fail(
            task_id=doomed.pk, actor=actor, lease_token=lease.lease_token, error=f"no {strike}"
        )

    assert [c.task.pk for c in transitions.claim(actor=other_agent, limit=5)] == [next_best.pk]
    task = Task.objects.get(pk=doomed.pk)
    assert (task.status, task.failure_count, task.last_error) == ("escalated", 3, "no 3")
    assert timeline(doomed.pk)[-4:] == [
        ("failed", "pending", "agent-jones"),
        ("claimed", "in_progress", "agent-smith"),
        ("failed", "escalated", "agent-smith"),
        ("escalated", "escalated", "agent-smith"),
    ]
    # A human requeue wipes the strikes and makes it claimable again.
    transitions.requeue(task_id=doomed.pk, actor=staff)
    (again,) = transitions.claim(actor=agent)
    assert again.task.pk == doomed.pk
    assert again.task.failure_count == 0


def test_a_task_failed_with_retry_after_is_claimable_only_once_that_time_has_passed(
    make_task: Callable[..., Task], agent: Any
) -> None:
    task = make_task()
    (lease,) = transitions.claim(actor=agent)

    failed = transitions.fail(
        task_id=task.pk, actor=agent, lease_token=lease.lease_token, error="later", retry_after=1
    )
    assert transitions.claim(actor=agent) == []

    assert failed.run_after is not None
    assert (failed.run_after - failed.updated_at).total_seconds() == 1
    time.sleep(1.2)
    (again,) = transitions.claim(actor=agent)

    assert again.task.pk == task.pk
    assert again.task.failure_count == 1


def test_leases_in_flight_are_kept_apart_under_concurrent_heartbeats_and_claims(
    make_task: Callable[..., Task],
) -> None:
    # Half the threads hold a lease and heartbeat it while the others claim: no claim may
    # take a live lease, and every heartbeat of a live lease succeeds.
    for _ in range(8):
        make_task()
    holders = [UserFactory.create(username=f"holder-{i}") for i in range(8)]
    claimers = [UserFactory.create(username=f"claimer-{i}") for i in range(8)]
    leases = [transitions.claim(actor=holder, lease_seconds=60)[0] for holder in holders]

    def work(index: int) -> int:
        if index < 8:
            lease = leases[index]
            for _ in range(10):
                transitions.heartbeat(
                    task_id=lease.task.pk, actor=holders[index], lease_token=lease.lease_token
                )
            return 10
        return sum(len(transitions.claim(actor=claimers[index - 8], limit=8)) for _ in range(10))

    results = in_threads(16, work)

    assert results[:8] == [10] * 8
    assert results[8:] == [0] * 8
    assert sorted(Task.objects.values_list("leased_by__username", flat=True)) == sorted(
        h.username for h in holders
    )
    assert not TaskEvent.objects.filter(type="expired").exists()


def test_lease_tokens_are_unique_across_concurrent_claims(
    make_task: Callable[..., Task],
) -> None:
    for _ in range(40):
        make_task()
    agents = [UserFactory.create(username=f"racer-{i}") for i in range(8)]

    results = in_threads(8, lambda i: transitions.claim(actor=agents[i], limit=5))

    tokens = [uuid.UUID(c.lease_token) for claims in results for c in claims]
    assert len(tokens) == 40
    assert len(set(tokens)) == 40
