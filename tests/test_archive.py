"""The event log partitioned by month (migration 0011) and ``taskboard archive``
(board.ops.archive): partitions made ahead and on demand, the append-only log on every
partition, and archives that take whole months out, verified, with nothing else touched."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from io import StringIO
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.core.management import CommandError, call_command
from django.db import IntegrityError, connection, transaction
from django.db.migrations.executor import MigrationExecutor

from board import partitions as event_log
from board import transitions
from board.exceptions import ArchiveMismatch
from board.models import Delivery, Task, TaskEvent, Webhook
from board.notifications import deliveries
from tests.factories import TokenFactory, UserFactory
from tests.live import StreamCollector, live_server

NOW = datetime.now(UTC)


def month_start(months_ago: int) -> datetime:
    """The first instant (UTC) of the month ``months_ago`` months before this one."""
    index = NOW.year * 12 + NOW.month - 1 - months_ago
    return datetime(index // 12, index % 12 + 1, 1, tzinfo=UTC)


def partition_of(month: datetime) -> str:
    return f"task_events_{month:%Y_%m}"


def sql(statement: str, params: Any = None) -> list[tuple[Any, ...]]:
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return cursor.fetchall() if cursor.description else []


def past_event(task: Task, created_at: datetime, type: str = "commented") -> int:
    """Insert an event dated ``created_at`` (transitions date theirs now()); return its id.

    Its foreign key is checked at once: a table with pending checks cannot be dropped in
    the same transaction, and tests run in one (production's archive runs on its own).
    """
    sql("SET CONSTRAINTS ALL IMMEDIATE")
    [(event_id,)] = sql(
        "INSERT INTO task_events (task_id, type, status, actor, payload, created_at) "
        "VALUES (%s, %s, %s, 'agent-smith', %s, %s) RETURNING id",
        [task.pk, type, task.status, json.dumps({"body": f"on {created_at:%Y-%m-%d}"}), created_at],
    )
    return int(event_id)


def partitions() -> set[str]:
    rows = sql(
        "SELECT inhrelid::regclass::text FROM pg_inherits WHERE inhparent = 'task_events'::regclass"
    )
    return {row[0] for row in rows}


def home_of(event_id: int) -> str:
    [(table,)] = sql("SELECT tableoid::regclass::text FROM task_events WHERE id = %s", [event_id])
    return str(table)


def all_events() -> list[tuple[Any, ...]]:
    return sql(
        "SELECT id, task_id, type, status, actor, payload::text, created_at, txid::text "
        "FROM task_events ORDER BY id"
    )


# --- the migration ------------------------------------------------------------------------

BEFORE, AFTER = (
    ("board", "0010_drop_unused_eventstream_tables"),
    ("board", "0011_partition_task_events"),
)


@pytest.mark.django_db(transaction=True)
def test_the_migration_keeps_every_event_its_id_and_the_id_sequence(agent: Any) -> None:
    # Made before going back: today's create names columns that the older schema lacks.
    task = transitions.create(actor=agent, title="older than the partitions")
    MigrationExecutor(connection).migrate([BEFORE])
    try:
        for created_at in (month_start(14), month_start(2) - timedelta(microseconds=1), NOW):
            past_event(task, created_at)
        before = all_events()
        [(next_id_before,)] = sql("SELECT last_value FROM task_events_id_seq")

        MigrationExecutor(connection).migrate([AFTER])

        assert all_events() == before
        assert home_of(before[1][0]) == partition_of(month_start(14))
        assert home_of(before[2][0]) == partition_of(month_start(3))
        assert {partition_of(month_start(-n)) for n in range(4)} <= partitions()
        assert "task_events_default" in partitions()
        next_event = transitions.comment(task_id=task.pk, actor=agent, body="after")
        assert next_event.pk == next_id_before + 1
        [(sequence,)] = sql("SELECT pg_get_serial_sequence('task_events', 'id')")
        assert sequence == "public.task_events_id_seq"
    finally:
        MigrationExecutor(connection).migrate(
            MigrationExecutor(connection).loader.graph.leaf_nodes()
        )


# --- partitions ---------------------------------------------------------------------------


@pytest.mark.django_db
def test_every_migrate_makes_this_month_and_the_next_three() -> None:
    ahead = partition_of(month_start(-3))
    sql(f"ALTER TABLE task_events DETACH PARTITION {ahead}; DROP TABLE {ahead}")

    call_command("migrate", verbosity=0)

    assert {partition_of(month_start(-n)) for n in range(4)} <= partitions()


@pytest.mark.django_db
def test_an_event_dated_in_a_month_without_a_partition_is_kept(
    make_task: Callable[..., Task],
) -> None:
    task = make_task()
    far = datetime(2041, 5, 17, 12, tzinfo=UTC)
    assert partition_of(far) not in partitions()

    event_id = past_event(task, far)

    assert home_of(event_id) == "task_events_default"
    assert TaskEvent.objects.get(pk=event_id).created_at == far


@pytest.mark.django_db
def test_making_a_months_partition_moves_its_events_out_of_the_default(
    make_task: Callable[..., Task],
) -> None:
    task = make_task()
    in_may, in_june = datetime(2041, 5, 17, tzinfo=UTC), datetime(2041, 6, 1, tzinfo=UTC)
    may_id, june_id = past_event(task, in_may), past_event(task, in_june)
    before = all_events()

    assert event_log.ensure(at=in_may, months_ahead=0) == ["task_events_2041_05"]

    assert all_events() == before  # the same rows, ids and txids
    assert home_of(may_id) == "task_events_2041_05"
    assert home_of(june_id) == "task_events_2041_06"
    assert sql("SELECT count(*) FROM task_events_default") == [(0,)]
    # The new partitions refuse changes like every other one.
    with pytest.raises(IntegrityError), transaction.atomic():
        sql("DELETE FROM task_events_2041_05")


@pytest.mark.django_db
def test_a_transition_makes_its_months_partition_when_it_is_missing(
    make_task: Callable[..., Task], monkeypatch: pytest.MonkeyPatch
) -> None:
    this_month, next_month = partition_of(month_start(0)), partition_of(month_start(-1))
    for name in (this_month, next_month):
        sql(f"ALTER TABLE task_events DETACH PARTITION {name}")
        sql(f"DROP TABLE {name}")
    monkeypatch.setattr(event_log, "_month_made", None)

    task = make_task()

    assert home_of(TaskEvent.objects.get(task=task).pk) == this_month
    assert {this_month, next_month} <= partitions()


@pytest.mark.django_db
def test_a_transition_asks_for_partitions_once_a_month(
    make_task: Callable[..., Task], monkeypatch: pytest.MonkeyPatch
) -> None:
    make_task()
    asked: list[Any] = []
    monkeypatch.setattr(event_log, "ensure", lambda **kw: asked.append(kw))

    make_task()
    make_task()

    assert asked == []


@pytest.mark.django_db
def test_only_statements_that_write_events_ask_for_partitions(
    make_task: Callable[..., Task], monkeypatch: pytest.MonkeyPatch, staff: Any
) -> None:
    asked: list[Any] = []
    monkeypatch.setattr(event_log, "ensure", lambda **kw: asked.append(kw))
    monkeypatch.setattr(event_log, "_month_made", None)

    transitions.pause_queue(queue="default", actor=staff)
    deliveries.set_email_channel(active=False)
    assert asked == []

    make_task()
    assert len(asked) == 1


REFUSED = {
    "update": "UPDATE {table} SET actor = 'mallory'",
    "delete": "DELETE FROM {table}",
    "truncate": "TRUNCATE {table}",
}


@pytest.mark.django_db
@pytest.mark.parametrize("table", ["task_events", "this month", "task_events_default"])
@pytest.mark.parametrize("change", REFUSED.values(), ids=REFUSED.keys())
def test_changes_are_refused_on_the_log_and_on_each_partition(
    make_task: Callable[..., Task], table: str, change: str
) -> None:
    task = make_task()  # an event in this month's partition
    past_event(task, datetime(2041, 5, 17, tzinfo=UTC))  # one in the default partition
    table = partition_of(month_start(0)) if table == "this month" else table
    sql("SET CONSTRAINTS ALL IMMEDIATE")  # TRUNCATE refuses pending FK checks otherwise
    before = all_events()

    with pytest.raises(IntegrityError) as refused, transaction.atomic():
        sql(change.format(table=table))

    import psycopg

    cause = refused.value.__cause__
    assert isinstance(cause, psycopg.Error)
    assert cause.diag.constraint_name == "task_events_append_only"
    assert all_events() == before


# --- archive ------------------------------------------------------------------------------


def read_lines(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as lines:
        return [json.loads(line) for line in lines]


@pytest.fixture
def history(make_task: Callable[..., Task], agent: Any) -> dict[str, list[int]]:
    """Events over five months: two months to archive (one of them also in the DEFAULT
    partition), last month and this one to keep. Return their ids by fate."""
    old, recent = make_task(title="old"), make_task(title="recent")
    event_log.ensure(at=month_start(2), months_ahead=0)
    archived = [
        past_event(old, month_start(14) + timedelta(days=3)),
        past_event(old, month_start(3)),  # no partition (unless a test left one): the default
        past_event(old, month_start(2), type="heartbeat"),
        past_event(recent, month_start(1) - timedelta(microseconds=1)),
    ]
    kept = [
        past_event(recent, month_start(1)),
        past_event(old, month_start(1) + timedelta(days=9)),
        *TaskEvent.objects.filter(created_at__gte=month_start(0)).values_list("id", flat=True),
    ]
    transitions.comment(task_id=recent.pk, actor=agent, body="now")
    kept.append(TaskEvent.objects.latest("id").pk)
    return {"archived": archived, "kept": sorted(kept)}


@pytest.mark.django_db
@pytest.mark.parametrize("name", ["events.jsonl", "events.jsonl.gz"])
def test_an_archive_holds_every_event_of_those_months_and_the_database_the_rest(
    history: dict[str, list[int]], tmp_path: Path, name: str
) -> None:
    tasks_before = list(Task.objects.order_by("id").values_list("id", "status", "updated_at"))
    rendered = {
        event["id"]: event for event in json.loads(json.dumps(_api_events(history["archived"])))
    }
    target = tmp_path / name

    call_command("archive", "--before", f"{month_start(1):%Y-%m-%d}", "--to", str(target))

    lines = read_lines(target)
    assert [line["id"] for line in lines] == history["archived"]
    for line in lines:
        assert {k: v for k, v in line.items() if k != "txid"} == rendered[line["id"]]
        assert int(line["txid"]) > 0
    assert list(TaskEvent.objects.order_by("id").values_list("id", flat=True)) == history["kept"]
    assert (
        list(Task.objects.order_by("id").values_list("id", "status", "updated_at")) == tasks_before
    )
    assert not {partition_of(month_start(n)) for n in (2, 3, 14)} & partitions()
    assert partition_of(month_start(1)) in partitions()
    assert not (tmp_path / f"{name}.partial").exists()


@pytest.mark.django_db
def test_a_gzipped_archive_names_itself_in_its_header(
    history: dict[str, list[int]], tmp_path: Path
) -> None:
    """gzip's header carries the file's name (``gunzip -N`` restores it): the archive's
    own, not the ``.partial`` it was written as before it was verified."""
    target = tmp_path / "events-2026.jsonl.gz"

    call_command("archive", "--before", f"{month_start(1):%Y-%m-%d}", "--to", str(target))

    header = target.read_bytes()
    assert header[:2] == b"\x1f\x8b" and header[3] & 0x08, "no name in the gzip header"
    assert header[10 : header.index(b"\0", 10)] == b"events-2026.jsonl"
    assert [line["id"] for line in read_lines(target)] == history["archived"]


def _api_events(ids: list[int]) -> list[dict[str, Any]]:
    from board.api.serializers import EventSerializer

    return list(
        EventSerializer(TaskEvent.objects.filter(id__in=ids).order_by("id"), many=True).data
    )


@pytest.mark.django_db
def test_the_archive_command_says_what_it_archived(
    history: dict[str, list[int]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    call_command("archive", "--before", f"{month_start(1):%Y-%m-%d}", "--to", str(tmp_path / "a"))

    out = capsys.readouterr().out
    assert f"{month_start(2):%Y-%m}: 2 events" in out
    assert f"Archived {len(history['archived'])} events of " in out


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("before", "message"),
    [
        (f"{month_start(2) + timedelta(days=1):%Y-%m-%d}", "is not the first day of a month"),
        ("2026-13-01", "is not a date"),
    ],
)
def test_archive_refuses_a_boundary_that_is_not_the_first_of_a_month(
    history: dict[str, list[int]], tmp_path: Path, before: str, message: str
) -> None:
    with pytest.raises(CommandError, match=message):
        call_command("archive", "--before", before, "--to", str(tmp_path / "a.jsonl"))

    assert TaskEvent.objects.count() == len(history["archived"]) + len(history["kept"])
    assert not (tmp_path / "a.jsonl").exists()


@pytest.mark.django_db
def test_the_current_month_can_be_archived_too_and_the_log_goes_on(
    history: dict[str, list[int]], tmp_path: Path, agent: Any
) -> None:
    """``--before`` the first of next month takes this month's events so far as well (a
    black-box client can only make events now); the next transition still writes its
    event (into this month's partition made again, or the DEFAULT one)."""
    target = tmp_path / "everything.jsonl"
    target.touch()  # an empty file, as mktemp makes: nothing in it to lose

    call_command("archive", "--before", f"{month_start(-1):%Y-%m-%d}", "--to", str(target))

    archived = sorted(history["archived"] + history["kept"])
    # Month by month, in id order within each.
    assert sorted(line["id"] for line in read_lines(target)) == archived
    assert not TaskEvent.objects.exists()
    task = transitions.create(actor=agent, title="after the archive")
    [event] = TaskEvent.objects.filter(task=task)
    assert event.pk > archived[-1]


@pytest.mark.django_db
def test_archive_refuses_an_existing_file_unless_forced(
    history: dict[str, list[int]], tmp_path: Path
) -> None:
    target = tmp_path / "a.jsonl"
    target.write_text("keep me\n")
    before = f"{month_start(1):%Y-%m-%d}"

    with pytest.raises(CommandError, match="exists"):
        call_command("archive", "--before", before, "--to", str(target))
    assert target.read_text() == "keep me\n"
    assert TaskEvent.objects.count() == len(history["archived"]) + len(history["kept"])

    call_command("archive", "--before", before, "--to", str(target), "--force")
    assert [line["id"] for line in read_lines(target)] == history["archived"]


@pytest.mark.django_db(transaction=True)
def test_archive_refuses_a_database_before_the_partitioned_log(tmp_path: Path) -> None:
    MigrationExecutor(connection).migrate([BEFORE])
    try:
        with pytest.raises(CommandError, match="run `taskboard migrate`"):
            call_command(
                "archive", "--before", f"{month_start(1):%Y-%m-%d}", "--to", str(tmp_path / "a")
            )
    finally:
        MigrationExecutor(connection).migrate(
            MigrationExecutor(connection).loader.graph.leaf_nodes()
        )
    assert not (tmp_path / "a").exists()


@pytest.mark.django_db
def test_a_file_that_does_not_read_back_as_written_drops_nothing(
    history: dict[str, list[int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from board.ops import archive

    read_back = archive._read_back

    def lose_the_last_line(path: Path, *, gzipped: bool) -> dict[Any, archive.Tally]:
        path.write_text("".join(path.read_text().splitlines(keepends=True)[:-1]))
        return read_back(path, gzipped=gzipped)

    monkeypatch.setattr(archive, "_read_back", lose_the_last_line)
    target = tmp_path / "a.jsonl"

    with pytest.raises(CommandError, match="does not match the database"):
        call_command("archive", "--before", f"{month_start(1):%Y-%m-%d}", "--to", str(target))

    assert not target.exists()
    assert TaskEvent.objects.count() == len(history["archived"]) + len(history["kept"])


@pytest.mark.django_db
def test_a_partition_that_does_not_hold_what_the_file_holds_is_not_dropped(
    history: dict[str, list[int]],
) -> None:
    month = month_start(2)
    [(count, id_sum)] = sql(f"SELECT count(*), sum(id) FROM {partition_of(month)}")

    with pytest.raises(ArchiveMismatch, match="holds 2 events"):
        event_log.drop(month=month, count=count, id_sum=id_sum + 1)

    assert partition_of(month) in partitions()
    assert sql(f"SELECT count(*) FROM {partition_of(month)}") == [(count,)]


@pytest.mark.django_db
@pytest.mark.parametrize("name", ["events.jsonl", "events.jsonl.gz"])
def test_a_month_that_gains_an_event_after_the_export_stays_out_of_the_file(
    history: dict[str, list[int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """A month still being written (the current one, say) refuses its drop; the file then
    holds the months dropped before it and nothing else, so archiving that month again to
    another file puts none of its events in two files."""
    from board.ops import archive

    read_back = archive._read_back
    late: list[int] = []

    def an_event_arrives_meanwhile(path: Path, *, gzipped: bool) -> dict[Any, archive.Tally]:
        late.append(past_event(Task.objects.get(title="old"), month_start(2) + timedelta(days=2)))
        return read_back(path, gzipped=gzipped)

    monkeypatch.setattr(archive, "_read_back", an_event_arrives_meanwhile)
    target = tmp_path / name
    before = f"{month_start(1):%Y-%m-%d}"

    with pytest.raises(CommandError) as stopped:
        call_command("archive", "--before", before, "--to", str(target))

    message = str(stopped.value)
    assert "\n" not in message
    assert f"{month_start(2):%Y-%m} gained events since they were written to the file" in message
    assert f"were archived to {target} and dropped" in message
    assert [line["id"] for line in read_lines(target)] == history["archived"][:2]
    assert not (tmp_path / f"{name}.partial").exists()
    assert partition_of(month_start(2)) in partitions()
    assert partition_of(month_start(3)) not in partitions()

    monkeypatch.setattr(archive, "_read_back", read_back)
    again = tmp_path / f"again-{name}"
    call_command("archive", "--before", before, "--to", str(again))
    assert [line["id"] for line in read_lines(again)] == [*history["archived"][2:], *late]


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_month_held_by_a_reader_stops_the_archive_in_one_line_and_leaves_no_file(
    history: dict[str, list[int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transaction reading the month's partition (as pg_dump does) holds its drop back:
    once the archive gives up waiting it says so in one line, drops nothing and leaves no
    file, neither under its name nor as ``.partial``."""
    import psycopg

    from tests.processes import tests_database_url

    # The drop's twenty tries, without their growing pauses between them.
    monkeypatch.setattr("board.partitions.random.uniform", lambda low, high: 0.0)
    target = tmp_path / "a.jsonl.gz"
    before = f"{month_start(1):%Y-%m-%d}"
    events_before = TaskEvent.objects.count()
    event_log.split_default(before=month_start(1))  # before the reader

    with psycopg.connect(tests_database_url()) as reader:
        reader.execute(f"SELECT count(*) FROM {partition_of(month_start(2))}").fetchone()
        with pytest.raises(CommandError) as stopped:
            call_command("archive", "--before", before, "--to", str(target))
        reader.rollback()

    message = str(stopped.value)
    assert "\n" not in message
    assert f"{month_start(14):%Y-%m} could not be dropped: another transaction kept " in message
    assert message.endswith("Nothing was dropped and no file was written.")
    assert list(tmp_path.iterdir()) == []
    assert TaskEvent.objects.count() == events_before
    assert {partition_of(month_start(n)) for n in (2, 3, 14)} <= partitions()

    call_command("archive", "--before", before, "--to", str(target))
    assert [line["id"] for line in read_lines(target)] == history["archived"]


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_events_held_in_the_default_partition_by_a_reader_refuse_the_archive_in_one_line(
    history: dict[str, list[int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import psycopg

    from tests.processes import tests_database_url

    monkeypatch.setattr("board.partitions.random.uniform", lambda low, high: 0.0)
    stray = past_event(Task.objects.get(title="old"), month_start(40))  # a month no test makes
    assert home_of(stray) == "task_events_default"

    with psycopg.connect(tests_database_url()) as reader:
        reader.execute("SELECT count(*) FROM task_events_default").fetchone()
        with pytest.raises(CommandError) as refused:
            call_command(
                "archive", "--before", f"{month_start(1):%Y-%m-%d}", "--to", str(tmp_path / "a")
            )
        reader.rollback()

    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("The events of the DEFAULT partition could not be moved")
    assert message.endswith("Nothing was written or dropped.")
    assert list(tmp_path.iterdir()) == []
    assert home_of(stray) == "task_events_default"


# --- archive and the deliveries still to make ---------------------------------------------


def webhook(staff: Any) -> Webhook:
    return deliveries.create_webhook(
        actor=staff, url="http://127.0.0.1:9/hook", events=["escalated"], queues=None, secret="s"
    )


def attempt(delivery_id: int, *, delivered: bool = False, for_good: bool = True) -> None:
    """Claim the due deliveries and record the attempt on ``delivery_id``: delivered, failed
    for good, or failed and due again at once; the others stay leased."""
    [claimed] = [
        d for d in deliveries.claim_deliveries(limit=100, lease_seconds=30) if d.pk == delivery_id
    ]
    assert claimed.lease_token is not None
    deliveries.record_delivery(
        delivery_id=claimed.pk,
        lease_token=claimed.lease_token,
        delivered=delivered,
        error=None if delivered else "answered 500",
        retry_in=3600 if for_good else 0,
        horizon_seconds=0 if for_good else 3600,
    )


@pytest.mark.django_db
@pytest.mark.parametrize("then", ["delivered", "webhook deleted"])
def test_archive_refuses_while_a_delivery_of_those_months_is_pending(
    history: dict[str, list[int]], tmp_path: Path, staff: Any, then: str
) -> None:
    hook = webhook(staff)
    old = Task.objects.get(title="old")
    past_event(old, month_start(2) + timedelta(days=1), type="escalated")
    past_event(old, month_start(1), type="escalated")  # a month that stays: no matter
    waiting, kept = Delivery.objects.order_by("event_id")
    attempt(waiting.pk, for_good=False)  # its receiver answered 500: pending, to be retried
    events_before, partitions_before = TaskEvent.objects.count(), partitions()
    target = tmp_path / "a.jsonl"
    before = f"{month_start(1):%Y-%m-%d}"

    with pytest.raises(CommandError) as refused:
        call_command("archive", "--before", before, "--to", str(target))

    message = str(refused.value)
    assert f"1 webhook or email delivery of events before {before} is still pending" in message
    assert f"(webhook {hook.pk} at http://127.0.0.1:9/hook: 1)" in message
    assert "must be delivered" in message and "webhook deleted" in message
    assert "Nothing was written or dropped" in message
    assert not target.exists() and not (tmp_path / "a.jsonl.partial").exists()
    assert TaskEvent.objects.count() == events_before
    assert partitions() == partitions_before

    if then == "delivered":
        attempt(waiting.pk, delivered=True)
    else:
        assert deliveries.delete_webhook(webhook_id=hook.pk, actor=staff)
    call_command("archive", "--before", before, "--to", str(target))
    assert waiting.event_id in {line["id"] for line in read_lines(target)}
    assert kept.event_id is not None
    assert TaskEvent.objects.filter(pk=kept.event_id).exists()


@pytest.mark.django_db
def test_a_failed_delivery_does_not_hold_the_archive_back_and_is_not_retried_after_it(
    history: dict[str, list[int]], tmp_path: Path, staff: Any
) -> None:
    webhook(staff)
    past_event(Task.objects.get(title="old"), month_start(2) + timedelta(days=1), type="escalated")
    [delivery] = Delivery.objects.all()
    attempt(delivery.pk)

    call_command("archive", "--before", f"{month_start(1):%Y-%m-%d}", "--to", str(tmp_path / "a"))

    # Its event is no longer in the log: a staff retry would have nothing to send.
    assert deliveries.retry_deliveries(delivery_ids=[delivery.pk], actor=staff) == 0
    delivery.refresh_from_db()
    assert delivery.status == "failed"


@pytest.mark.django_db
def test_a_delivery_retried_during_the_archive_stops_the_drop_of_its_month(
    history: dict[str, list[int]], tmp_path: Path, staff: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checked again under the locks of each month's drop: a staff retry of a failed
    delivery after the first check (here, while the file is read back) makes it pending."""
    from board.ops import archive

    webhook(staff)
    past_event(Task.objects.get(title="old"), month_start(2) + timedelta(days=1), type="escalated")
    [delivery] = Delivery.objects.all()
    attempt(delivery.pk)
    read_back = archive._read_back

    def retried_meanwhile(path: Path, *, gzipped: bool) -> dict[Any, archive.Tally]:
        assert deliveries.retry_deliveries(delivery_ids=[delivery.pk], actor=staff) == 1
        return read_back(path, gzipped=gzipped)

    monkeypatch.setattr(archive, "_read_back", retried_meanwhile)
    target = tmp_path / "a.jsonl"

    with pytest.raises(
        CommandError, match=f"of events of {month_start(2):%Y-%m} became pending since"
    ):
        call_command("archive", "--before", f"{month_start(1):%Y-%m-%d}", "--to", str(target))

    assert partition_of(month_start(2)) in partitions()  # and so the event and its delivery
    assert delivery.event_id is not None
    assert TaskEvent.objects.filter(pk=delivery.event_id).exists()
    assert partition_of(month_start(14)) not in partitions()  # the months before it went
    # The file holds the months dropped, and only them.
    assert [line["id"] for line in read_lines(target)] == history["archived"][:2]
    assert not (tmp_path / "a.jsonl.partial").exists()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_staff_retry_made_during_a_drop_waits_for_it_and_rearms_nothing(
    tmp_path: Path, agent: Any, staff: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from django.db import connections

    # Empty months that tests before this one made (a flush empties them but keeps them)
    # are archived first, so that the drop below is that of the event's month.
    boundary = f"{month_start(1):%Y-%m-%d}"
    call_command("archive", "--before", boundary, "--to", str(tmp_path / "left"), stdout=StringIO())
    webhook(staff)
    task = transitions.create(actor=agent, title="old")
    past_event(task, month_start(2), type="escalated")
    [delivery] = Delivery.objects.all()
    attempt(delivery.pk)
    query = event_log._query
    retried: list[int] = []

    def retry() -> None:
        try:
            retried.append(deliveries.retry_deliveries(delivery_ids=[delivery.pk], actor=staff))
        finally:
            connections.close_all()

    retrying = threading.Thread(target=retry)

    def drop_while_staff_retry(name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        # Inside the drop's transaction, after its check: the retry must wait for it.
        # (Once: a busy lock makes the drop run its transaction again.)
        if name == "drop_event_partition" and retrying.ident is None:
            retrying.start()
            retrying.join(timeout=1)
            assert retrying.is_alive(), f"the retry did not wait for the drop: {retried}"
        return query(name, params)

    monkeypatch.setattr(event_log, "_query", drop_while_staff_retry)

    call_command("archive", "--before", boundary, "--to", str(tmp_path / "a"))

    retrying.join(timeout=10)
    assert retried == [0]
    delivery.refresh_from_db()
    assert delivery.status == "failed"


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_stream_and_the_events_cursor_carry_on_after_an_archive(
    tmp_path: Path, agent: Any
) -> None:
    task = transitions.create(actor=agent, title="lives on")
    old = [past_event(task, month_start(2) + timedelta(days=n)) for n in range(3)]
    kept = transitions.comment(task_id=task.pk, actor=agent, body="kept")
    token = TokenFactory.create(user=UserFactory.create(username="watcher"))
    headers = {"Authorization": f"Bearer {token.key}"}

    call_command("archive", "--before", f"{month_start(1):%Y-%m-%d}", "--to", str(tmp_path / "a"))

    with live_server() as server:
        stream_url = f"{server.url}/api/v1/stream/"
        with StreamCollector(stream_url, {**headers, "Last-Event-ID": str(kept.pk)}) as stream:
            newer = transitions.comment(task_id=task.pk, actor=agent, body="newer")
            assert stream.get(timeout=5)["json"]["id"] == newer.pk
        with StreamCollector(stream_url, headers, lastEventId="0") as stream:
            replayed = [event["json"]["id"] for event in stream.take(3)]
            assert stream.nothing_within(0.3)
        listed = httpx.get(
            f"{server.url}/api/v1/events/", params={"after": old[0]}, headers=headers
        )
        history = httpx.get(f"{server.url}/api/v1/tasks/{task.pk}/events/", headers=headers)

    assert replayed == [TaskEvent.objects.get(task=task, type="created").pk, kept.pk, newer.pk]
    assert [event["id"] for event in listed.json()["results"]] == [kept.pk, newer.pk]
    assert [event["type"] for event in history.json()["results"]] == [
        "created",
        "commented",
        "commented",
    ]


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_agents_keep_working_while_an_archive_runs(tmp_path: Path, agent: Any) -> None:
    import threading

    from django.db import connections

    task = transitions.create(actor=agent, title="old history")
    sql("SET CONSTRAINTS ALL IMMEDIATE")
    sql(
        "INSERT INTO task_events (task_id, type, status, actor, payload, created_at) "
        "SELECT %s, 'commented', 'pending', 'agent-smith', '{}', %s + n * interval '1 minute' "
        "FROM generate_series(1, 5000) AS n",
        [task.pk, month_start(3)],
    )
    old_ids = [
        row[0]
        for row in sql(
            "SELECT id FROM task_events WHERE created_at < %s ORDER BY id", [month_start(1)]
        )
    ]
    stop, failures, cycles = threading.Event(), [], []

    def work() -> None:
        try:
            while not stop.is_set():
                made = transitions.create(actor=agent, title="now")
                [claim] = transitions.claim(actor=agent)
                transitions.complete(
                    task_id=claim.task.pk, actor=agent, lease_token=claim.lease_token
                )
                cycles.append(made.pk)
        except Exception as exc:
            failures.append(exc)
        finally:
            connections.close_all()

    workers = [threading.Thread(target=work) for _ in range(2)]
    for worker in workers:
        worker.start()
    try:
        call_command(
            "archive", "--before", f"{month_start(1):%Y-%m-%d}", "--to", str(tmp_path / "a")
        )
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=30)

    assert failures == [], [str(f) for f in failures]
    assert len(cycles) > 0
    assert [line["id"] for line in read_lines(tmp_path / "a")] == old_ids
    # Every cycle's created, claimed and completed events (a claim may take another's task).
    assert TaskEvent.objects.filter(id__gt=old_ids[-1]).count() == 3 * len(cycles)
    assert not TaskEvent.objects.filter(created_at__lt=month_start(1)).exists()


@pytest.mark.django_db(transaction=True)
def test_an_archive_with_nothing_before_its_boundary_says_so(tmp_path: Path) -> None:
    boundary = f"{month_start(1):%Y-%m-%d}"
    # Months that tests before this one made (a flush empties them but keeps them) are
    # archived first, so that nothing is left before the boundary.
    call_command("archive", "--before", boundary, "--to", str(tmp_path / "left"), stdout=StringIO())
    out = StringIO()
    call_command("archive", "--before", boundary, "--to", str(tmp_path / "a"), stdout=out)
    assert out.getvalue().startswith(f"Nothing to archive: no month before {month_start(1):%Y-%m}")
