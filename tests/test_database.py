"""The invariants PostgreSQL keeps by itself: the append-only event log, the NOTIFY of each
new event, the tasks table's constraints, and the partial indexes the claim runs on."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from django.db import IntegrityError, connection, transaction

from board import transitions
from board.exceptions import EventLogIsAppendOnly, InvalidTask, translated_database_errors
from board.models import Task, TaskEvent
from board.sql import QUERIES

pytestmark = pytest.mark.usefixtures("fast_password_hashing")

REFUSED_CHANGES = {
    "update": "UPDATE task_events SET actor = 'mallory' WHERE id = %(id)s",
    "delete": "DELETE FROM task_events WHERE id = %(id)s",
    "truncate": "TRUNCATE task_events",
    "truncate-cascade": "TRUNCATE task_events CASCADE",
}


def run_sql(sql: str, params: Any = None) -> None:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)


def check_deferred_constraints() -> None:
    """Run the foreign-key checks Django defers to commit, inside the test's transaction.

    PostgreSQL refuses to TRUNCATE a table with pending trigger events ("cannot TRUNCATE
    ... because it has pending trigger events"), which would hide the append-only refusal.
    """
    run_sql("SET CONSTRAINTS ALL IMMEDIATE")


# --- the append-only event log --------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("sql", REFUSED_CHANGES.values(), ids=REFUSED_CHANGES.keys())
def test_the_event_log_refuses_raw_sql_that_changes_it(
    make_task: Callable[..., Task], sql: str
) -> None:
    task = make_task()
    event = TaskEvent.objects.get(task=task)
    check_deferred_constraints()

    with pytest.raises(IntegrityError) as refused, transaction.atomic():
        run_sql(sql, {"id": event.pk})

    cause = refused.value.__cause__
    assert isinstance(cause, psycopg.Error)
    assert cause.diag.constraint_name == "task_events_append_only"
    assert "append-only" in str(refused.value)
    stored = TaskEvent.objects.get(pk=event.pk)
    assert (stored.actor, stored.type, stored.payload) == (event.actor, event.type, event.payload)


@pytest.mark.django_db
@pytest.mark.parametrize("sql", REFUSED_CHANGES.values(), ids=REFUSED_CHANGES.keys())
def test_the_refusal_is_translated_into_event_log_is_append_only(
    make_task: Callable[..., Task], sql: str
) -> None:
    event = TaskEvent.objects.get(task=make_task())
    check_deferred_constraints()

    with pytest.raises(EventLogIsAppendOnly), transaction.atomic(), translated_database_errors():
        run_sql(sql, {"id": event.pk})

    assert TaskEvent.objects.filter(pk=event.pk).exists()


@pytest.mark.django_db
def test_the_event_log_refuses_changes_through_the_orm(make_task: Callable[..., Task]) -> None:
    make_task()
    make_task()

    with pytest.raises(IntegrityError), transaction.atomic():
        TaskEvent.objects.update(actor="mallory")
    with pytest.raises(IntegrityError), transaction.atomic():
        TaskEvent.objects.all().delete()
    event = TaskEvent.objects.first()
    assert event is not None
    event.actor = "mallory"
    with pytest.raises(IntegrityError), transaction.atomic():
        event.save()

    assert TaskEvent.objects.count() == 2
    assert not TaskEvent.objects.filter(actor="mallory").exists()


@pytest.mark.django_db
def test_the_event_log_still_takes_new_rows(make_task: Callable[..., Task]) -> None:
    task = make_task()

    TaskEvent.objects.create(task=task, type="heartbeat", status="pending", actor="agent-smith")

    assert TaskEvent.objects.filter(task=task).count() == 2


@pytest.mark.django_db
def test_event_ids_increase_in_insertion_order(make_task: Callable[..., Task], agent: Any) -> None:
    first, second = make_task(priority=1), make_task(priority=0)
    leases = {c.task.pk: c.lease_token for c in transitions.claim(actor=agent, limit=2)}
    for task in (second, first):
        transitions.complete(task_id=task.pk, actor=agent, lease_token=leases[task.pk])

    events = TaskEvent.objects.order_by("id").values_list("type", "task_id")

    assert list(events) == [
        ("created", first.pk),
        ("created", second.pk),
        ("claimed", first.pk),
        ("claimed", second.pk),
        ("completed", second.pk),
        ("completed", first.pk),
    ]


# --- the tasks table's constraints ----------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("values", "constraint"),
    [
        ({"priority": 1001}, "tasks_priority_range"),
        ({"priority": -1001}, "tasks_priority_range"),
        ({"max_failures": 101}, "tasks_max_failures_range"),
        ({"queue": "Not A Queue"}, "tasks_queue_format"),
        ({"queue": ""}, "tasks_queue_format"),
    ],
)
def test_create_refuses_values_the_table_forbids(
    agent: Any, values: dict[str, Any], constraint: str
) -> None:
    with pytest.raises(InvalidTask, match=constraint), transaction.atomic():
        transitions.create(actor=agent, title="bad", **values)

    assert not Task.objects.exists()
    assert not TaskEvent.objects.exists()


@pytest.mark.django_db
def test_create_refuses_zero_max_failures(agent: Any) -> None:
    # max_failures=0 is not "use the default": the table refuses it.
    with pytest.raises(InvalidTask, match="tasks_max_failures_range"), transaction.atomic():
        transitions.create(actor=agent, title="bad", max_failures=0)


@pytest.mark.django_db
@pytest.mark.parametrize(
    "assignment",
    [
        "status = 'in_progress'",
        "leased_by = 'agent-smith'",
        "leased_until = now()",
        "lease_token = gen_random_uuid()",
        "status = 'in_progress', leased_by = 'agent-smith', leased_until = now()",
    ],
)
def test_a_lease_exists_exactly_when_the_task_is_in_progress(
    make_task: Callable[..., Task], assignment: str
) -> None:
    task = make_task()

    with pytest.raises(IntegrityError, match="tasks_lease_iff_in_progress"), transaction.atomic():
        run_sql(f"UPDATE tasks SET {assignment} WHERE id = %s", [task.pk])


@pytest.mark.django_db
def test_an_in_progress_task_keeps_its_whole_lease(
    make_task: Callable[..., Task], agent: Any
) -> None:
    task = make_task()
    transitions.claim(actor=agent)

    for column in ("leased_by", "leased_until", "lease_token"):
        with pytest.raises(IntegrityError), transaction.atomic():
            run_sql(f"UPDATE tasks SET {column} = NULL WHERE id = %s", [task.pk])


@pytest.mark.django_db
def test_the_table_refuses_an_unknown_status(make_task: Callable[..., Task]) -> None:
    task = make_task()

    with pytest.raises(IntegrityError, match="tasks_status_valid"), transaction.atomic():
        run_sql("UPDATE tasks SET status = 'lost' WHERE id = %s", [task.pk])


# --- NOTIFY ---------------------------------------------------------------------------------


@pytest.fixture
def listener(transactional_db: None, open_raw_connection: Callable[..., Any]) -> Any:
    """An autocommit connection that LISTENs on task_events."""
    conn = open_raw_connection(autocommit=True)
    conn.execute("LISTEN task_events")
    return conn


def notified(listener: Any, *, timeout: float, count: int | None = None) -> list[str]:
    """Return the payloads on task_events received within ``timeout`` seconds."""
    return [
        note.payload
        for note in listener.notifies(timeout=timeout, stop_after=count)
        if note.channel == "task_events"
    ]


@pytest.mark.django_db(transaction=True)
def test_a_committed_event_is_announced_with_its_id(
    listener: Any, make_task: Callable[..., Task]
) -> None:
    task = make_task()

    payloads = notified(listener, timeout=5, count=1)

    assert payloads == [str(TaskEvent.objects.get(task=task).pk)]


@pytest.mark.django_db(transaction=True)
def test_each_statement_is_announced_once_with_its_last_event_id_in_order(
    listener: Any, make_task: Callable[..., Task], agent: Any
) -> None:
    task = make_task(max_failures=1)
    (lease,) = transitions.claim(actor=agent)
    # One statement writes two events: failed, then escalated (the last strike).
    transitions.fail(task_id=task.pk, actor=agent, lease_token=lease.lease_token, error="no")

    payloads = notified(listener, timeout=5, count=3)

    events = TaskEvent.objects.filter(task=task).order_by("id")
    assert [e.type for e in events] == ["created", "claimed", "failed", "escalated"]
    assert payloads == [str(events[0].pk), str(events[1].pk), str(events[3].pk)]
    assert notified(listener, timeout=0.3) == []


@pytest.mark.django_db(transaction=True)
def test_a_claim_of_a_hundred_tasks_sends_one_notification_and_an_empty_claim_none(
    listener: Any, make_task: Callable[..., Task], agent: Any
) -> None:
    for n in range(100):
        make_task(title=f"t{n}")
    assert len(notified(listener, timeout=5, count=100)) == 100  # 100 creates

    claimed = transitions.claim(actor=agent, limit=100)
    assert len(claimed) == 100
    last = TaskEvent.objects.filter(type="claimed").order_by("-id").first()
    assert last is not None
    assert notified(listener, timeout=5, count=1) == [str(last.pk)]
    assert notified(listener, timeout=0.5) == []

    assert transitions.claim(actor=agent) == []
    assert notified(listener, timeout=0.5) == []


@pytest.mark.django_db(transaction=True)
def test_an_event_is_announced_only_when_its_transaction_commits(
    listener: Any, make_task: Callable[..., Task]
) -> None:
    with transaction.atomic():
        task = make_task()
        assert notified(listener, timeout=0.3) == []

    assert notified(listener, timeout=5, count=1) == [str(TaskEvent.objects.get(task=task).pk)]


@pytest.mark.django_db(transaction=True)
def test_an_event_rolled_back_is_never_announced(
    listener: Any, make_task: Callable[..., Task]
) -> None:
    with pytest.raises(RuntimeError), transaction.atomic():
        make_task(title="never happened")
        raise RuntimeError("roll back")
    committed = make_task(title="happened")

    # The committed event is the first (and only) one heard: the rolled-back one never was.
    assert notified(listener, timeout=5, count=1) == [str(TaskEvent.objects.get(task=committed).pk)]
    assert notified(listener, timeout=0.3) == []
    assert not Task.objects.filter(title="never happened").exists()


# --- the claim's plan -----------------------------------------------------------------------


INSERT_TASKS = """
    INSERT INTO tasks (
        title, description, payload, queue, priority, max_failures, status, failure_count,
        created_by, created_at, updated_at, result,
        leased_by, lease_token, leased_until, lease_seconds
    )
    SELECT 'task ' || n, '', '{}'::jsonb, COALESCE(%(queue)s, 'q' || (n %% 20)), (n %% 200) - 100,
           3, %(status)s, 0,
           %(actor)s, now() - make_interval(secs => n), now(), NULL,
           lease.holder, lease.token, lease.until, lease.seconds
    FROM generate_series(1, %(count)s) AS n
    LEFT JOIN LATERAL (
        SELECT %(actor)s AS holder, gen_random_uuid() AS token,
               now() + make_interval(secs => 60 + n) AS until, 120 AS seconds
        WHERE %(status)s = 'in_progress'
    ) AS lease ON true
"""


@pytest.fixture
def a_busy_board(agent: Any) -> None:
    """50,000 done tasks, hundreds pending and in progress on live leases in the queues q0 to
    q19, three pending in the queue "rare"; fresh statistics.

    With only a handful of open tasks the planner's choice between indexes is a coin toss
    decided by ANALYZE's random sample; a board this shape is where the choice matters.
    """
    for status, count, queue in (
        ("done", 50_000, None),
        ("pending", 500, None),
        ("in_progress", 500, None),
        ("pending", 3, "rare"),
    ):
        run_sql(
            INSERT_TASKS,
            {"status": status, "count": count, "queue": queue, "actor": agent.username},
        )
    run_sql("ANALYZE tasks")


def claim_sql(queues: list[str] | None, limit: int = 1) -> str:
    """The claim statement that board.transitions.claim runs for these queues and limit."""
    return QUERIES[transitions.claim_statement(queues, limit)]


def claim_plan(*, queues: list[str] | None) -> str:
    """EXPLAIN the claim statement with the parameters board.transitions.claim passes."""
    params: dict[str, str | int | list[str]] = {
        "actor": "agent-smith",
        "queues": list(queues or []),
        "lease_seconds": 120,
        "limit": 1,
    }
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN " + claim_sql(queues), params)
        return "\n".join(row[0] for row in cursor.fetchall())


@pytest.mark.django_db
def test_a_claim_on_every_queue_reads_only_the_partial_indexes(a_busy_board: None) -> None:
    plan = claim_plan(queues=None)

    assert "tasks_pending_claim_idx" in plan, plan
    assert "tasks_in_progress_lease_idx" in plan, plan
    assert "Seq Scan on tasks" not in plan, plan


@pytest.mark.django_db
def test_a_claim_on_a_small_queue_reads_the_queue_index(a_busy_board: None) -> None:
    plan = claim_plan(queues=["rare"])

    assert "tasks_pending_queue_claim_idx" in plan, plan
    assert "tasks_in_progress_lease_idx" in plan, plan
    assert "Seq Scan on tasks" not in plan, plan


@pytest.mark.django_db
def test_a_claim_on_busy_queues_reads_only_the_partial_indexes(a_busy_board: None) -> None:
    # queue = ANY(...) does not give claim order from the queue index, so for queues that
    # hold much of the board the planner may rather walk tasks_pending_claim_idx in claim
    # order and filter by queue: either partial index is fine, a scan of the table is not.
    for queues in (["q1"], ["q1", "q2"], ["q1", "rare"]):
        plan = claim_plan(queues=queues)

        assert "tasks_pending_queue_claim_idx" in plan or "tasks_pending_claim_idx" in plan, plan
        assert "tasks_in_progress_lease_idx" in plan, plan
        assert "Seq Scan on tasks" not in plan, plan


@pytest.mark.django_db
@pytest.mark.parametrize("queues", [None, ["q1"]])
def test_a_claim_reads_a_few_index_entries_however_many_tasks_are_pending(
    agent: Any, queues: list[str] | None
) -> None:
    # A claim takes the first tasks in claim order from a partial index: it reads about
    # `limit` entries, not every pending task (and sorts nothing of that size). A pause of
    # another queue must not change that.
    run_sql(
        INSERT_TASKS, {"status": "pending", "count": 20_000, "queue": "q1", "actor": agent.username}
    )
    transitions.pause_queue(queue="q2", actor=agent)
    run_sql("ANALYZE tasks")
    params = {
        "actor": agent.username,
        "queues": list(queues or []),
        "lease_seconds": 120,
        "limit": 1,
    }
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, BUFFERS OFF) " + claim_sql(queues), params)
        plan = "\n".join(row[0] for row in cursor.fetchall())

    pending = [line for line in plan.splitlines() if "tasks_pending" in line and "Scan" in line]
    assert pending, plan
    for line in pending:
        actual = re.search(r"actual time=\S+ rows=(\d+)", line)
        assert actual and int(actual[1]) <= 5, plan
    assert "Seq Scan on tasks" not in plan, plan


# --- tables -------------------------------------------------------------------------------


@pytest.mark.django_db
def test_no_table_of_django_eventstream_is_made() -> None:
    tables = connection.introspection.table_names()
    assert not [table for table in tables if table.startswith("django_eventstream")]


@pytest.mark.django_db(transaction=True)
def test_an_older_installs_eventstream_tables_are_dropped_by_the_migration() -> None:
    from django.db.migrations.executor import MigrationExecutor

    before, after = (
        ("board", "0009_notify_per_statement"),
        ("board", "0010_drop_unused_eventstream_tables"),
    )
    executor = MigrationExecutor(connection)
    executor.migrate([before])
    with connection.cursor() as cursor:
        # As django-eventstream's own migration made them (the columns do not matter).
        cursor.execute("CREATE TABLE django_eventstream_event (id bigserial PRIMARY KEY)")
        cursor.execute("CREATE TABLE django_eventstream_eventcounter (id bigserial PRIMARY KEY)")
        cursor.execute(
            "INSERT INTO django_migrations (app, name, applied) "
            "VALUES ('django_eventstream', '0001_initial', now())"
        )
    try:
        executor = MigrationExecutor(connection)
        executor.migrate([after])

        tables = connection.introspection.table_names()
        assert not [table for table in tables if table.startswith("django_eventstream")]
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM django_migrations WHERE app = 'django_eventstream'"
            )
            assert cursor.fetchone() == (0,)
    finally:
        # The later migrations too, for the tests that follow.
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes())
