"""Work graphs, attempt deadlines, idempotent creates and queue counters, under real
concurrency and in real time (contract: "Additions to v1").

Every test commits for real (``transaction=True``) so that parallel connections see each
other's work; threads use Django's per-thread connections (tests.test_claim.in_threads).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from django.db import connection, transaction

from board import queues as glance
from board import transitions
from board.exceptions import IdempotencyConflict, InvalidTransition, LeaseLost
from board.models import QueueCounter, Task, TaskEvent, TaskStatus
from tests.factories import UserFactory
from tests.test_claim import in_threads

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("fast_password_hashing"),
]


def claim_one(agent: Any, **kwargs: Any) -> transitions.Claim | None:
    claims = transitions.claim(actor=agent, **kwargs)
    return claims[0] if claims else None


# -- Dependencies -----------------------------------------------------------------------


def test_a_blocked_task_is_not_claimed_until_its_last_dependency_is_done(agent: Any) -> None:
    first = transitions.create(actor=agent, title="first", priority=1)
    second = transitions.create(actor=agent, title="second", priority=1)
    after = transitions.create(
        actor=agent, title="after both", priority=100, depends_on=[first.pk, second.pk]
    )
    assert after.blocked and after.open_dependencies == 2

    # The blocked task has the higher priority, yet the claims pass over it.
    one, two = transitions.claim(actor=agent, limit=5)
    assert {one.task.pk, two.task.pk} == {first.pk, second.pk}
    assert claim_one(agent) is None

    transitions.complete(task_id=first.pk, actor=agent, lease_token=one.lease_token)
    assert Task.objects.get(pk=after.pk).blocked
    assert not TaskEvent.objects.filter(task_id=after.pk, type="unblocked").exists()
    assert claim_one(agent) is None

    transitions.complete(task_id=second.pk, actor=agent, lease_token=two.lease_token)
    unblocked = TaskEvent.objects.get(task_id=after.pk, type="unblocked")
    assert (unblocked.actor, unblocked.status, unblocked.payload) == (
        "system",
        "pending",
        {"after": second.pk},
    )
    # Written in the transaction of the complete: right after its event.
    completed = TaskEvent.objects.get(task_id=second.pk, type="completed")
    assert unblocked.pk == completed.pk + 1
    claim = claim_one(agent)
    assert claim is not None and claim.task.pk == after.pk


def test_dependents_of_a_cancelled_or_escalated_task_stay_blocked(agent: Any, staff: Any) -> None:
    cancelled = transitions.create(actor=agent, title="will be cancelled")
    doomed = transitions.create(actor=agent, title="will escalate", max_failures=1)
    waits_on_cancelled = transitions.create(actor=agent, title="a", depends_on=[cancelled.pk])
    waits_on_escalated = transitions.create(actor=agent, title="b", depends_on=[doomed.pk])

    transitions.cancel(task_id=cancelled.pk, actor=staff)
    claim = claim_one(agent)
    assert claim is not None and claim.task.pk == doomed.pk
    transitions.fail(task_id=doomed.pk, actor=agent, lease_token=claim.lease_token, error="no")

    assert claim_one(agent) is None
    blocked = set(Task.objects.blocked().values_list("pk", flat=True))
    assert blocked == {waits_on_cancelled.pk, waits_on_escalated.pk}

    # A human decides: resolving the escalated task as done unblocks its dependent.
    transitions.resolve(task_id=doomed.pk, actor=staff, note="done by hand")
    assert TaskEvent.objects.filter(task_id=waits_on_escalated.pk, type="unblocked").exists()
    claim = claim_one(agent)
    assert claim is not None and claim.task.pk == waits_on_escalated.pk


def test_requeueing_a_done_dependency_blocks_its_pending_dependents_again(
    agent: Any, staff: Any
) -> None:
    first = transitions.create(actor=agent, title="first")
    then = transitions.create(actor=agent, title="then", depends_on=[first.pk])
    claim = claim_one(agent)
    assert claim is not None
    transitions.complete(task_id=first.pk, actor=agent, lease_token=claim.lease_token)
    assert not Task.objects.get(pk=then.pk).blocked

    transitions.requeue(task_id=first.pk, actor=staff, note="redo it")

    assert Task.objects.get(pk=then.pk).blocked
    claim = claim_one(agent)
    assert claim is not None and claim.task.pk == first.pk
    assert claim_one(agent) is None


def test_a_dependency_completing_while_a_dependent_is_created_never_strands_it(
    agent: Any,
) -> None:
    # The create counts the dependencies that are not done and writes its edges; a
    # complete running at the same time either commits first (the create counts it done)
    # or unblocks through the new edge. Either way, no task stays blocked on a done task.
    rounds = 40
    for _ in range(rounds):
        dependency = transitions.create(actor=agent, title="dependency", queue="deps")
        claim = claim_one(agent, queues=["deps"])
        assert claim is not None and claim.task.pk == dependency.pk

        def work(index: int, dependency: Task = dependency, claim: Any = claim) -> Any:
            if index == 0:
                return transitions.complete(
                    task_id=dependency.pk, actor=agent, lease_token=claim.lease_token
                )
            return transitions.create(actor=agent, title="dependent", depends_on=[dependency.pk])

        in_threads(2, work)
    stranded = Task.objects.blocked().count()
    assert stranded == 0
    assert Task.objects.filter(status=TaskStatus.PENDING, open_dependencies=0).count() == rounds


def test_concurrent_creates_that_share_dependencies_never_deadlock(agent: Any) -> None:
    # Each create locks and marks its dependencies: with a share lock upgraded by the mark,
    # two creates of one dependency deadlocked.
    shared = [transitions.create(actor=agent, title=f"shared {n}").pk for n in range(3)]

    def work(index: int) -> list[int]:
        rng = random.Random(index)
        made = []
        for _ in range(5):
            depends_on = rng.sample(shared, k=rng.randint(1, 3))
            made.append(transitions.create(actor=agent, title="d", depends_on=depends_on).pk)
        return made

    made = [pk for pks in in_threads(16, work) for pk in pks]

    assert len(made) == 80
    assert Task.objects.blocked().count() == 80
    assert set(Task.objects.filter(pk__in=shared).values_list("has_dependents", flat=True)) == {
        True
    }


def test_sixteen_threads_never_claim_a_task_before_all_its_dependencies_are_done() -> None:
    agents = [UserFactory.create(username=f"graph-agent-{i}") for i in range(16)]
    planner = UserFactory.create(username="planner")
    rng = random.Random(9)
    ids: list[int] = []
    for number in range(120):
        depends_on = rng.sample(ids, k=min(len(ids), rng.randint(0, 3)))
        task = transitions.create(
            actor=planner,
            title=f"step {number}",
            depends_on=depends_on,
            priority=rng.randint(0, 5),
        )
        ids.append(task.pk)
    done: list[int] = []
    lock = threading.Lock()

    def work(index: int) -> int:
        finished = 0
        idle_since = time.monotonic()
        while time.monotonic() - idle_since < 3:
            claims = transitions.claim(actor=agents[index], limit=2, lease_seconds=60)
            if not claims:
                time.sleep(0.005)
                continue
            idle_since = time.monotonic()
            for claim in claims:
                transitions.complete(
                    task_id=claim.task.pk, actor=agents[index], lease_token=claim.lease_token
                )
                finished += 1
                with lock:
                    done.append(claim.task.pk)
        return finished

    assert sum(in_threads(16, work)) == len(ids)
    assert sorted(done) == sorted(ids)

    # Event ids come from one sequence in insertion order: a claim made after the
    # dependency's complete committed has the larger id.
    events = {
        (event.task_id, event.type): event.pk
        for event in TaskEvent.objects.filter(type__in=["claimed", "completed"])
    }
    for task in Task.objects.filter(pk__in=ids):
        for dependency in task.depends_on:
            assert events[(task.pk, "claimed")] > events[(dependency, "completed")], (
                f"task {task.pk} was claimed before its dependency {dependency} was done"
            )


# -- Progress and attempt deadlines -----------------------------------------------------


def test_progress_survives_release_fail_and_expiry_and_requeue_clears_it(
    agent: Any, other_agent: Any, staff: Any
) -> None:
    task = transitions.create(actor=agent, title="long job")
    claim = claim_one(agent, lease_seconds=1)
    assert claim is not None and claim.task.progress is None
    transitions.heartbeat(
        task_id=task.pk, actor=agent, lease_token=claim.lease_token, progress={"page": 10}
    )
    # A heartbeat without progress keeps the last one.
    transitions.heartbeat(task_id=task.pk, actor=agent, lease_token=claim.lease_token)
    time.sleep(1.2)

    # The lease ran out: the next holder resumes from the progress.
    claim = claim_one(other_agent)
    assert claim is not None and claim.task.progress == {"page": 10}
    transitions.heartbeat(
        task_id=task.pk, actor=other_agent, lease_token=claim.lease_token, progress={"page": 20}
    )
    transitions.release(task_id=task.pk, actor=other_agent, lease_token=claim.lease_token)
    claim = claim_one(agent)
    assert claim is not None and claim.task.progress == {"page": 20}
    transitions.fail(task_id=task.pk, actor=agent, lease_token=claim.lease_token, error="x")
    assert Task.objects.get(pk=task.pk).progress == {"page": 20}

    claim = claim_one(agent)
    assert claim is not None
    transitions.escalate(task_id=task.pk, actor=agent, lease_token=claim.lease_token, reason="?")
    transitions.requeue(task_id=task.pk, actor=staff)
    assert Task.objects.get(pk=task.pk).progress is None


def test_the_attempt_deadline_holds_in_real_time_however_often_the_holder_heartbeats(
    agent: Any, other_agent: Any
) -> None:
    task = transitions.create(actor=agent, title="spinner", max_attempt_seconds=2)
    claim = claim_one(agent, lease_seconds=60)
    assert claim is not None
    deadline = claim.task.attempt_deadline
    assert deadline is not None and claim.task.leased_until == deadline

    # Heartbeats on schedule never push the lease past the deadline.
    for _ in range(3):
        beat = transitions.heartbeat(
            task_id=task.pk, actor=agent, lease_token=claim.lease_token, lease_seconds=60
        )
        assert beat.leased_until == deadline
        time.sleep(0.5)
    time.sleep(max(0.0, 2.1 - 1.5))

    holder_actions: list[tuple[Callable[..., Task], dict[str, str]]] = [
        (transitions.heartbeat, {}),
        (transitions.complete, {}),
        (transitions.fail, {"error": "x"}),
        (transitions.release, {}),
        (transitions.escalate, {"reason": "x"}),
    ]
    for action, extra in holder_actions:
        with pytest.raises(LeaseLost, match="attempt deadline passed"):
            action(task_id=task.pk, actor=agent, lease_token=claim.lease_token, **extra)

    # The next claim records the expiry with its reason, counts a strike, and starts a
    # new attempt with a deadline of its own.
    again = claim_one(other_agent, lease_seconds=60)
    assert again is not None and again.task.pk == task.pk
    assert again.task.failure_count == 1
    assert again.task.last_error == f"attempt deadline passed (held by {agent.username})"
    expired = TaskEvent.objects.get(task_id=task.pk, type="expired")
    assert expired.payload["reason"] == "attempt_deadline"
    assert expired.payload["previous_holder"] == agent.username
    assert again.task.attempt_deadline is not None and again.task.attempt_deadline > deadline


def test_three_attempts_past_the_deadline_escalate(agent: Any) -> None:
    task = transitions.create(actor=agent, title="spinner", max_attempt_seconds=1)
    for _attempt in range(3):
        claim = claim_one(agent, lease_seconds=60)
        assert claim is not None and claim.task.pk == task.pk
        time.sleep(1.1)
    assert claim_one(agent) is None
    task.refresh_from_db()
    assert (task.status, task.failure_count) == (TaskStatus.ESCALATED, 3)
    escalated = TaskEvent.objects.get(task_id=task.pk, type="escalated")
    assert escalated.payload["reason"] == "attempt deadline passed 3 of 3 times"


def test_a_plain_expiry_reads_lease_expired(agent: Any) -> None:
    task = transitions.create(actor=agent, title="slow", max_attempt_seconds=3600)
    assert claim_one(agent, lease_seconds=1) is not None
    time.sleep(1.1)
    assert claim_one(agent) is not None
    expired = TaskEvent.objects.get(task_id=task.pk, type="expired")
    assert expired.payload["reason"] == "lease_expired"


# -- Idempotent create ------------------------------------------------------------------


def test_racing_creates_with_one_key_create_exactly_one_task(agent: Any) -> None:
    def work(index: int) -> tuple[int, bool]:
        task, created = transitions.create_once(
            actor=agent, idempotency_key="plan-42", title="the one task", queue="plans"
        )
        return task.pk, created

    results = in_threads(16, work)

    assert len({pk for pk, _ in results}) == 1
    assert [created for _, created in results].count(True) == 1
    assert Task.objects.count() == 1
    assert TaskEvent.objects.filter(type="created").count() == 1


def test_a_key_repeated_with_another_body_conflicts_and_keys_are_per_user(
    agent: Any, other_agent: Any
) -> None:
    task, created = transitions.create_once(actor=agent, idempotency_key="k", title="one")
    assert created
    with pytest.raises(IdempotencyConflict):
        transitions.create_once(actor=agent, idempotency_key="k", title="another")
    theirs, created = transitions.create_once(actor=other_agent, idempotency_key="k", title="one")
    assert created and theirs.pk != task.pk


# -- Queue counters ---------------------------------------------------------------------


def counts_by_scan() -> dict[str, dict[str, int]]:
    counts: dict[str, dict[str, int]] = {}
    for task in Task.objects.all():
        bucket = "blocked" if task.blocked else task.status
        queue = counts.setdefault(task.queue, dict.fromkeys(glance.COUNTS, 0))
        queue[bucket] += 1
    return counts


def test_queue_counts_equal_a_count_after_thousands_of_concurrent_random_transitions(
    staff: Any,
) -> None:
    agents = [UserFactory.create(username=f"busy-agent-{i}") for i in range(8)]
    queues = ["alpha", "beta", "gamma"]
    transitions_done = Counter[str]()
    lock = threading.Lock()

    def work(index: int) -> None:
        rng = random.Random(index)
        agent = agents[index]
        held: list[transitions.Claim] = []
        created: list[int] = []
        for _ in range(300):
            roll = rng.random()
            try:
                if roll < 0.25 or not created:
                    depends_on = rng.sample(created, k=min(len(created), rng.randint(0, 1)))
                    # Some creates repeat a key: the repeat creates nothing.
                    task, _ = transitions.create_once(
                        actor=agent,
                        idempotency_key=f"k{rng.randrange(40)}" if rng.random() < 0.3 else None,
                        title="random",
                        queue=rng.choice(queues),
                        depends_on=depends_on,
                        max_failures=2,
                    )
                    created.append(task.pk)
                    name = "create"
                elif roll < 0.5:
                    # Some leases are short enough to expire: later claims record the
                    # expiries, count the strikes and escalate some tasks.
                    held += transitions.claim(
                        actor=agent,
                        queues=rng.sample(queues, 2),
                        limit=2,
                        lease_seconds=rng.choice([1, 30, 30]),
                    )
                    name = "claim"
                elif roll < 0.85 and held:
                    claim = held.pop(rng.randrange(len(held)))
                    kind = rng.choice(["complete", "complete", "fail", "release", "escalate"])
                    action = getattr(transitions, kind)
                    extra = {"fail": {"error": "e"}, "escalate": {"reason": "r"}}.get(kind, {})
                    action(
                        task_id=claim.task.pk, actor=agent, lease_token=claim.lease_token, **extra
                    )
                    name = kind
                else:
                    task_id = rng.choice(created)
                    kind = rng.choice(["cancel", "requeue", "resolve"])
                    getattr(transitions, kind)(task_id=task_id, actor=staff)
                    name = kind
            except (InvalidTransition, LeaseLost, IdempotencyConflict):
                name = "refused"
            with lock:
                transitions_done[name] += 1
        # The 1 s leases still held run out; these claims record their expiries (strikes,
        # some escalations) while the other threads do the same.
        time.sleep(1.1)
        transitions.claim(actor=agent, limit=10, lease_seconds=30)

    in_threads(8, work)

    assert sum(transitions_done.values()) == 2400
    assert TaskEvent.objects.filter(type="expired").count() > 10
    assert transitions_done["create"] > 300 and transitions_done["claim"] > 300
    listed = {queue["name"]: queue["counts"] for queue in glance.queue_list()}
    assert listed == counts_by_scan()
    assert sum(sum(counts.values()) for counts in listed.values()) == Task.objects.count()


def test_concurrent_transitions_on_one_queue_never_wait_for_a_counter_row(
    agent: Any, open_raw_connection: Any
) -> None:
    # One transaction holds a counter row of the queue until it commits; another
    # transition on the same queue must not wait for it (a lock_timeout would fire).
    task = transitions.create(actor=agent, title="first", queue="hot")
    with transaction.atomic():
        transitions.create(actor=agent, title="held open", queue="hot")
        with open_raw_connection(autocommit=True) as other:
            other.execute("SET lock_timeout = '1s'")
            started = time.monotonic()
            other.execute(
                "INSERT INTO tasks (title, description, payload, queue, priority, max_failures,"
                " status, failure_count, created_by) VALUES ('other', '', '{}', 'hot', 0, 3,"
                " 'pending', 0, %s)",
                [agent.username],
            )
            other.execute("UPDATE tasks SET status = 'cancelled' WHERE id = %s", [task.pk])
            assert time.monotonic() - started < 0.9
    assert QueueCounter.objects.filter(queue="hot").count() == 2
    (hot,) = glance.queue_list()
    assert hot["counts"]["pending"] == 2 and hot["counts"]["cancelled"] == 1


def test_a_single_counter_row_would_make_them_wait(agent: Any, open_raw_connection: Any) -> None:
    # The control of the test above: a row this transaction holds does make another
    # writer wait, so the test above would see a lock timeout if there were one row.
    transitions.create(actor=agent, title="first", queue="hot")
    with transaction.atomic():
        QueueCounter.objects.select_for_update().filter(queue="hot").update(pending=1)
        with (
            open_raw_connection(autocommit=True) as other,
            pytest.raises(psycopg.errors.LockNotAvailable),
        ):
            other.execute("SET lock_timeout = '200ms'")
            other.execute("UPDATE queue_counters SET pending = pending + 1 WHERE queue = 'hot'")


# -- Pause ------------------------------------------------------------------------------


def test_a_paused_queue_hands_out_nothing_and_leases_held_run_on(agent: Any, staff: Any) -> None:
    held = transitions.create(actor=agent, title="held", queue="reports")
    claim = claim_one(agent)
    assert claim is not None
    waiting = transitions.create(actor=agent, title="waiting", queue="reports")
    elsewhere = transitions.create(actor=agent, title="elsewhere", queue="other")

    transitions.pause_queue(queue="reports", actor=staff, note="deploying")

    assert [c.task.pk for c in transitions.claim(actor=agent, limit=5)] == [elsewhere.pk]
    assert transitions.claim(actor=agent, queues=["reports"]) == []
    transitions.heartbeat(task_id=held.pk, actor=agent, lease_token=claim.lease_token)
    transitions.complete(task_id=held.pk, actor=agent, lease_token=claim.lease_token)

    transitions.resume_queue(queue="reports", actor=staff)
    again = claim_one(agent)
    assert again is not None and again.task.pk == waiting.pk
    with connection.cursor() as cursor:
        cursor.execute("SELECT queue, paused, actor, note FROM queue_pauses ORDER BY id")
        assert cursor.fetchall() == [
            ("reports", True, staff.username, "deploying"),
            ("reports", False, staff.username, ""),
        ]


def test_an_expired_lease_on_a_task_whose_dependency_was_reopened_goes_back_blocked(
    agent: Any, other_agent: Any, staff: Any
) -> None:
    first = transitions.create(actor=agent, title="first")
    then = transitions.create(actor=agent, title="then", depends_on=[first.pk])
    claim = claim_one(agent)
    assert claim is not None
    transitions.complete(task_id=first.pk, actor=agent, lease_token=claim.lease_token)
    held = claim_one(agent, lease_seconds=1)
    assert held is not None and held.task.pk == then.pk
    transitions.requeue(task_id=first.pk, actor=staff, note="wrong, redo")
    time.sleep(1.1)

    # The claim records the expiry and hands out the reopened dependency, not its dependent.
    claims = transitions.claim(actor=other_agent, limit=5)

    assert [c.task.pk for c in claims] == [first.pk]
    then.refresh_from_db()
    assert then.status == TaskStatus.PENDING and then.blocked
    assert TaskEvent.objects.filter(task_id=then.pk, type="expired").count() == 1


def test_dependencies_completing_together_with_shared_dependents_never_deadlock(
    agent: Any,
) -> None:
    # Each completes' unblock locks the shared dependents in id order.
    for _ in range(10):
        roots = [
            transitions.create(actor=agent, title=f"root {n}", queue="roots") for n in range(4)
        ]
        for n in range(20):
            transitions.create(
                actor=agent, title=f"join {n}", queue="joins", depends_on=[r.pk for r in roots]
            )
        claims = transitions.claim(actor=agent, queues=["roots"], limit=4)
        assert len(claims) == 4

        def work(index: int, claims: list[transitions.Claim] = claims) -> Task:
            claim = claims[index]
            return transitions.complete(
                task_id=claim.task.pk, actor=agent, lease_token=claim.lease_token
            )

        in_threads(4, work)
    assert not Task.objects.blocked().exists()
    assert TaskEvent.objects.filter(type="unblocked").count() == 200


def test_the_holder_hears_of_its_deadline_after_another_claim_recorded_the_expiry(
    agent: Any, other_agent: Any
) -> None:
    task = transitions.create(actor=agent, title="spinner", max_attempt_seconds=1)
    claim = claim_one(agent, lease_seconds=60)
    assert claim is not None
    time.sleep(1.1)
    assert claim_one(other_agent) is not None

    with pytest.raises(LeaseLost, match="attempt deadline passed"):
        transitions.complete(task_id=task.pk, actor=agent, lease_token=claim.lease_token)
