"""taskboard_agent.client against a live server: every endpoint, its errors, the lease helper
and the stream. What needs no server (the retries against a fake transport, the stream's
parser) is tested in the agent's own tests, agent/tests/test_client.py."""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from django.contrib.auth.models import User
from django.db import connection, transaction

import taskboard_agent.client as client_module
from board import transitions
from board.access import limit_queues
from board.models import Task as TaskRow
from taskboard_agent.client import (
    NO_LIMIT,
    Agent,
    AuthenticationError,
    ClaimedTask,
    Client,
    Event,
    ForbiddenQueue,
    IdempotencyConflict,
    InvalidTransition,
    Lease,
    LeaseLost,
    NotFound,
    PayloadTooLarge,
    PermissionDenied,
    Queue,
    RateLimited,
    Task,
    ValidationError,
)
from tests.factories import TokenFactory, UserFactory, grant
from tests.live import LiveServer, free_port, live_server
from tests.processes import eventually

# The Python client against a live server: what it tests is the client's side, the same
# on any PostgreSQL (the server's side is tested on both by the API's tests).
pytestmark = pytest.mark.once

live = pytest.mark.django_db(transaction=True)


def token_of(user: User) -> str:
    """Return the API token of ``user`` (made on first use)."""
    token = TokenFactory.create(user=user)
    return str(token.key)


@pytest.fixture
def token(fast_password_hashing: None, agent: Any) -> str:
    return token_of(agent)


@pytest.fixture
def server(module_server: LiveServer) -> LiveServer:
    """The module's one server: these tests only call the API, as users of their own (the
    stream's resume after a dropped connection starts and stops servers of its own)."""
    return module_server


@pytest.fixture
def board(server: LiveServer, token: str) -> Iterator[Client]:
    with Client(server.url, token) as client:
        yield client


@pytest.fixture
def other_board(
    server: LiveServer, fast_password_hashing: None, other_agent: Any
) -> Iterator[Client]:
    with Client(server.url, token_of(other_agent)) as client:
        yield client


@pytest.fixture
def staff_board(server: LiveServer, fast_password_hashing: None, staff: Any) -> Iterator[Client]:
    with Client(server.url, token_of(grant(staff, "escalations.triage_task"))) as client:
        yield client


def expire_and_claim(task_id: int, actor: Any) -> Any:
    """Let the lease on ``task_id`` run out and have ``actor`` claim the task, atomically:
    nothing can take it in between."""
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(
                "UPDATE tasks SET leased_until = now() - interval '1 second' WHERE id = %s",
                [task_id],
            )
        [claim] = transitions.claim(actor=actor, queues=[TaskRow.objects.get(id=task_id).queue])
    assert claim.task.id == task_id
    return claim


# -- Tasks and their transitions ---------------------------------------------------------


@live
def test_it_creates_a_task_and_reads_it_back_typed(board: Client) -> None:
    due = datetime.now(UTC) + timedelta(hours=1)

    task = board.create(
        "Resize images",
        description="all of them",
        payload={"bucket": "in"},
        queue="images",
        priority=5,
        max_failures=2,
        run_after=due,
    )

    assert isinstance(task, Task)
    assert (task.title, task.description, task.payload) == (
        "Resize images",
        "all of them",
        {"bucket": "in"},
    )
    assert (task.queue, task.priority, task.max_failures) == ("images", 5, 2)
    assert (task.status, task.failure_count, task.created_by) == ("pending", 0, "agent-smith")
    assert task.leased_by is None and task.leased_until is None and task.result is None
    assert task.run_after == due
    assert task.created_at.tzinfo is not None
    assert abs(task.created_at - datetime.now(UTC)) < timedelta(minutes=1)
    assert board.get(task.id) == task
    assert board.get(task) == task


@live
def test_it_lists_tasks_by_filter_and_follows_the_next_pages(board: Client) -> None:
    images = [board.create(f"image {n}", queue="images").id for n in range(5)]
    board.create("mail", queue="mail")

    page = board.list_tasks(queue="images", limit=2)
    assert [t.id for t in page.results] == images[::-1][:2]
    assert page.next is not None

    assert [t.id for t in board.iter_tasks(queue="images", page_size=2)] == images[::-1]
    assert len(list(board.iter_tasks())) == 6

    [claimed] = board.claim(queues=["mail"])
    assert [t.id for t in board.iter_tasks(status="in_progress")] == [claimed.id]
    assert [t.id for t in board.iter_tasks(leased_by="agent-smith")] == [claimed.id]
    assert list(board.iter_tasks(leased_by="nobody")) == []


@live
def test_a_claim_carries_the_lease_token_and_the_holder_heartbeats_and_completes(
    board: Client,
) -> None:
    created = board.create("work", queue="q", payload={"n": 1})

    [task] = board.claim(queues=["q"], lease_seconds=30)

    assert isinstance(task, ClaimedTask)
    assert task.id == created.id
    assert task.lease_token
    assert task.lease_token not in repr(task)
    assert task.status == "in_progress" and task.leased_by == "agent-smith"
    assert task.lease_seconds == 30
    assert task.leased_until is not None

    beaten = board.heartbeat(task, lease_seconds=120, progress={"done": 40})
    assert beaten.leased_until is not None
    assert beaten.leased_until > task.leased_until + timedelta(seconds=60)
    [heartbeat] = board.events(task=task, type="heartbeat").results
    assert heartbeat.payload["progress"] == {"done": 40}

    done = board.complete(task, result={"resized": 12})
    assert (done.status, done.result, done.leased_by) == ("done", {"resized": 12}, None)
    assert board.claim(queues=["q"]) == []


@live
def test_the_holder_fails_releases_and_escalates_its_tasks(board: Client) -> None:
    for title in ("to fail", "to release", "to escalate"):
        board.create(title, queue="q", max_failures=3)
    to_fail, to_release, to_escalate = sorted(
        board.claim(queues=["q"], limit=3), key=lambda t: t.id
    )

    failed = board.fail(to_fail, "bucket not found", retry_after=60)
    assert (failed.status, failed.failure_count, failed.last_error) == (
        "pending",
        1,
        "bucket not found",
    )
    assert failed.run_after is not None and failed.run_after > datetime.now(UTC)

    released = board.release(to_release.id, lease_token=to_release.lease_token)
    assert (released.status, released.failure_count) == ("pending", 0)

    escalated = board.escalate(to_escalate, "needs a human")
    assert (escalated.status, escalated.last_error) == ("escalated", "needs a human")


@live
def test_queues_reads_every_page_of_queues(
    board: Client, agent: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client_module, "QUEUE_PAGE", 2)
    for name in ("e", "d", "c", "b", "a"):
        transitions.create(actor=agent, title="t", queue=name)

    assert [q.name for q in board.queues()] == ["a", "b", "c", "d", "e"]


@live
def test_staff_requeue_resolve_and_cancel_and_agents_may_not(
    board: Client, staff_board: Client
) -> None:
    a, b, c = (board.create(title, queue="q") for title in ("a", "b", "c"))
    for task in board.claim(queues=["q"], limit=2):
        board.escalate(task, "stuck")

    with pytest.raises(PermissionDenied) as refused:
        board.requeue(a)
    assert (refused.value.status, refused.value.code) == (403, "permission_denied")

    assert staff_board.requeue(a, note="try again").status == "pending"
    resolved = staff_board.resolve(b, note="done by hand", result={"by": "hand"})
    assert (resolved.status, resolved.result) == ("done", {"by": "hand"})
    assert staff_board.cancel(c, note="not needed").status == "cancelled"

    with pytest.raises(InvalidTransition) as invalid:
        staff_board.resolve(a)
    assert (invalid.value.status, invalid.value.code, invalid.value.task_status) == (
        409,
        "invalid_transition",
        "pending",
    )


@live
def test_a_limited_agent_gets_forbidden_queue_a_permission_denied_with_that_code(
    server: LiveServer, fast_password_hashing: None
) -> None:
    agent = UserFactory.create(username="images-only")
    limit_queues(agent, ["images"])

    with Client(server.url, token_of(agent)) as limited:
        with pytest.raises(PermissionDenied) as refused:
            limited.claim(queues=["video"])
        created = limited.create("fine", queue="images")

    assert isinstance(refused.value, ForbiddenQueue)
    assert (refused.value.status, refused.value.code) == (403, "forbidden_queue")
    assert "video" in refused.value.detail and "images" in refused.value.detail
    assert created.queue == "images"


@live
def test_a_stale_lease_token_raises_lease_lost(board: Client, other_board: Client) -> None:
    board.create("contested", queue="q")
    [task] = board.claim(queues=["q"])

    with pytest.raises(LeaseLost) as wrong_token:
        board.heartbeat(task.id, lease_token="not-the-token")
    assert (wrong_token.value.status, wrong_token.value.code) == (409, "lease_lost")

    with pytest.raises(LeaseLost):
        other_board.complete(task)  # the right token, but another agent

    board.complete(task)
    with pytest.raises(LeaseLost) as finished:
        board.heartbeat(task)
    assert finished.value.task_status == "done"
    with pytest.raises(LeaseLost):
        board.fail(task, "too late")


@live
def test_an_invalid_request_raises_validation_error_with_its_fields(board: Client) -> None:
    with pytest.raises(ValidationError) as refused:
        board.create("", priority=5000, queue="Not A Queue")

    error = refused.value
    assert (error.status, error.code) == (400, "invalid")
    assert set(error.fields) == {"title", "priority", "queue"}
    assert all(error.fields[name] for name in error.fields)
    assert "title" in str(error)

    with pytest.raises(ValidationError) as bad_wait:
        board.claim(wait=61)
    assert "wait" in bad_wait.value.fields


@live
def test_a_body_over_the_limit_raises_payload_too_large(board: Client) -> None:
    with pytest.raises(PayloadTooLarge) as refused:
        board.create("big", payload={"blob": "x" * (1024 * 1024)})
    assert refused.value.status == 413


@live
def test_a_bad_token_raises_authentication_error(server: LiveServer) -> None:
    with Client(server.url, "not-a-token") as stranger:
        with pytest.raises(AuthenticationError) as refused:
            stranger.list_tasks()
        assert refused.value.status == 401
        with pytest.raises(AuthenticationError):
            next(stranger.stream())
    with Client(server.url, None) as anonymous, pytest.raises(AuthenticationError):
        anonymous.claim()


@live
def test_an_unknown_task_raises_not_found(board: Client) -> None:
    with pytest.raises(NotFound) as missing:
        board.get(999999)
    assert (missing.value.status, missing.value.code) == (404, "not_found")
    with pytest.raises(NotFound):
        board.heartbeat(999999, lease_token="x")
    with pytest.raises(NotFound):
        board.task_events(999999)


@live
def test_events_are_read_by_page_filter_and_task(board: Client) -> None:
    first = board.create("first", queue="q")
    second = board.create("second", queue="q")
    [claimed] = board.claim(queues=["q"])
    board.complete(claimed, result=1)

    log = list(board.iter_events(page_size=2))
    assert [(e.task_id, e.type) for e in log] == [
        (first.id, "created"),
        (second.id, "created"),
        (first.id, "claimed"),
        (first.id, "completed"),
    ]
    assert all(isinstance(e, Event) and e.created_at.tzinfo for e in log)
    assert log[0].payload["title"] == "first"
    assert log[-1].actor == "agent-smith" and log[-1].status == "done"

    page = board.events(after=log[0].id, limit=2)
    assert [e.id for e in page.results] == [log[1].id, log[2].id]
    assert page.next is not None
    assert [e.id for e in board.events(type="created").results] == [log[0].id, log[1].id]
    assert [e.type for e in board.events(task=first).results] == ["created", "claimed", "completed"]

    assert [e.type for e in board.task_events(first).results] == ["created", "claimed", "completed"]
    assert [e.type for e in board.task_events(first, after=log[2].id).results] == ["completed"]
    assert [e.id for e in board.iter_task_events(first.id, page_size=1)] == [
        log[0].id,
        log[2].id,
        log[3].id,
    ]


@live
def test_a_claim_that_waits_gets_a_timeout_longer_than_its_wait(
    server: LiveServer, token: str, agent: Any
) -> None:
    with Client(server.url, token, timeout=0.5) as impatient:
        started = time.monotonic()
        assert impatient.claim(queues=["empty"], wait=1.5) == []
        assert time.monotonic() - started >= 1.4

        threading.Timer(
            0.5, lambda: transitions.create(actor=agent, title="new", queue="w")
        ).start()
        [task] = impatient.claim(queues=["w"], wait=10)
        assert task.title == "new"


# -- Work graphs, idempotent creates, comments, queues and agents ------------------------


@live
def test_no_limit_asks_for_no_attempt_deadline_whatever_the_servers_default(
    board: Client, settings: Any
) -> None:
    settings.TASKBOARD_MAX_ATTEMPT_SECONDS = 900

    assert board.create("default").max_attempt_seconds == 900
    assert board.create("none given", max_attempt_seconds=None).max_attempt_seconds == 900
    assert board.create("capped", max_attempt_seconds=60).max_attempt_seconds == 60
    assert board.create("unbounded", max_attempt_seconds=NO_LIMIT).max_attempt_seconds is None


@live
def test_it_creates_tasks_with_dependencies_a_parent_and_an_attempt_limit(board: Client) -> None:
    plan = board.create("plan", queue="q")
    fetch = board.create("fetch", queue="q")
    build = board.create("build", queue="q", depends_on=[plan, fetch.id], max_attempt_seconds=90)
    step = board.create("a step of the plan", queue="q", parent_id=plan)

    assert (build.depends_on, build.blocked, build.max_attempt_seconds) == (
        [plan.id, fetch.id],
        True,
        90,
    )
    assert (step.parent_id, step.depends_on, step.blocked) == (plan.id, [], False)
    assert plan.parent_id is None and plan.max_attempt_seconds is None
    assert build.attempt_started_at is None and build.attempt_deadline is None
    assert board.get(build) == build

    assert [t.id for t in board.iter_tasks(parent=plan)] == [step.id]
    assert [t.id for t in board.list_tasks(parent=plan.id).results] == [step.id]
    assert [t.id for t in board.iter_tasks(blocked=True)] == [build.id]
    assert {t.id for t in board.iter_tasks(blocked=False)} == {plan.id, fetch.id, step.id}
    assert [t.id for t in board.iter_tasks(depends_on=fetch)] == [build.id]
    assert list(board.iter_tasks(depends_on=build)) == []

    first, second, third = board.claim(queues=["q"], limit=3)
    assert [first.id, second.id, third.id] == [plan.id, fetch.id, step.id]  # not build
    board.complete(first)
    assert board.get(build).blocked
    board.complete(second)
    assert not board.get(build).blocked
    [claimed] = board.claim(queues=["q"], lease_seconds=30)
    assert (claimed.id, claimed.blocked) == (build.id, False)
    assert claimed.attempt_started_at is not None and claimed.attempt_deadline is not None
    assert claimed.attempt_deadline - claimed.attempt_started_at == timedelta(seconds=90)
    [unblocked] = board.events(task=build, type="unblocked").results
    assert (unblocked.actor, unblocked.payload) == ("system", {"after": fetch.id})


@live
def test_every_create_carries_a_fresh_idempotency_key(board: Client) -> None:
    first, second = board.create("same title"), board.create("same title")

    assert first.id != second.id
    assert first.idempotency_key and second.idempotency_key
    assert first.idempotency_key != second.idempotency_key
    assert str(uuid.UUID(first.idempotency_key, version=4)) == first.idempotency_key


@live
def test_a_create_repeated_with_its_key_returns_the_first_task_and_another_body_conflicts(
    board: Client, other_board: Client
) -> None:
    created = board.create("deploy", queue="q", payload={"v": 2}, idempotency_key="deploy-v2")
    [claimed] = board.claim(queues=["q"])

    again = board.create("deploy", queue="q", payload={"v": 2}, idempotency_key="deploy-v2")
    assert again.id == created.id
    assert (again.status, again.leased_by) == ("in_progress", "agent-smith")  # as it is now
    assert again.idempotency_key == "deploy-v2"

    with pytest.raises(IdempotencyConflict) as conflict:
        board.create("deploy", queue="q", payload={"v": 3}, idempotency_key="deploy-v2")
    assert (conflict.value.status, conflict.value.code) == (409, "idempotency_conflict")

    theirs = other_board.create("deploy", queue="q", payload={"v": 2}, idempotency_key="deploy-v2")
    assert theirs.id != created.id  # keys of different users never collide
    assert TaskRow.objects.filter(title="deploy").count() == 2
    assert claimed.id == created.id


class LoseFirstAnswer(httpx.BaseTransport):
    """Send each request to the real server, but lose the answer to the first one that
    ``lose`` picks (the connection breaks as the answer comes back)."""

    def __init__(self, lose: Callable[[httpx.Request], bool]) -> None:
        self.real = httpx.HTTPTransport()
        self.lose = lose
        self.sent: list[httpx.Request] = []
        self.lost: list[httpx.Response] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(request)
        response = self.real.handle_request(request)
        if not self.lost and self.lose(request):
            response.read()
            response.close()
            self.lost.append(response)
            raise httpx.ReadError("connection reset by peer", request=request)
        return response

    def close(self) -> None:
        self.real.close()


@live
def test_a_create_whose_answer_was_lost_is_sent_again_and_makes_one_task(
    server: LiveServer, token: str
) -> None:
    transport = LoseFirstAnswer(lambda request: request.method == "POST")
    with Client(server.url, token, transport=transport, backoff=0.01) as board:
        task = board.create("exactly once", queue="q")

    [lost] = transport.lost
    assert lost.status_code == 201  # the server did create it the first time
    first, retry = transport.sent
    assert first.headers["Idempotency-Key"] == retry.headers["Idempotency-Key"]
    assert first.content == retry.content
    [row] = TaskRow.objects.filter(title="exactly once")
    assert (task.id, task.idempotency_key) == (row.id, first.headers["Idempotency-Key"])


@live
def test_anyone_comments_on_a_task_in_its_history(board: Client, other_board: Client) -> None:
    task = board.create("discuss me", queue="q")
    [claimed] = board.claim(queues=["q"])
    board.complete(claimed)

    comment = other_board.comment(task, "Looks done to me.")

    assert isinstance(comment, Event)
    assert (comment.task_id, comment.type, comment.actor) == (task.id, "commented", "agent-jones")
    assert (comment.status, comment.payload) == ("done", {"body": "Looks done to me."})
    assert board.task_events(task).results[-1] == comment
    with pytest.raises(ValidationError) as empty:
        board.comment(task, "")
    assert "body" in empty.value.fields
    with pytest.raises(NotFound):
        board.comment(999999, "nobody hears this")


@live
def test_queues_are_counted_and_staff_pause_and_resume_them(
    board: Client, staff_board: Client
) -> None:
    first = board.create("first", queue="mail")
    board.create("second", queue="mail", depends_on=[first])
    board.create("elsewhere", queue="video")

    queues = {q.name: q for q in board.queues()}
    mail = queues["mail"]
    assert isinstance(mail, Queue) and mail.paused is False
    assert mail.counts == {
        "pending": 1,  # not blocked
        "blocked": 1,
        "in_progress": 0,
        "escalated": 0,
        "done": 0,
        "cancelled": 0,
        "awaiting_input": 0,
    }
    assert mail.oldest_pending_at == first.created_at
    assert queues["video"].counts["pending"] == 1

    with pytest.raises(PermissionDenied):
        board.pause_queue("mail")
    paused = staff_board.pause_queue("mail", note="mail server down")
    assert (paused.name, paused.paused) == ("mail", True)
    assert board.claim(queues=["mail"]) == []
    assert [q.paused for q in board.queues() if q.name == "mail"] == [True]

    resumed = staff_board.resume_queue("mail")
    assert resumed.paused is False
    [claimed] = board.claim(queues=["mail"])
    assert claimed.id == first.id


@live
def test_agents_are_listed_with_what_they_hold(board: Client, other_board: Client) -> None:
    for title in ("a", "b", "c"):
        board.create(title, queue="q")
    held, done = board.claim(queues=["q"], limit=2)
    board.complete(done)
    [theirs] = other_board.claim(queues=["q"])
    other_board.fail(theirs, "no luck")

    agents = {a.name: a for a in board.agents()}

    smith = agents["agent-smith"]
    assert isinstance(smith, Agent)
    assert (smith.holding, smith.completed_24h, smith.failed_24h) == ([held.id], 1, 0)
    assert smith.last_seen_at is not None
    jones = agents["agent-jones"]
    assert (jones.holding, jones.completed_24h, jones.failed_24h) == ([], 0, 1)


# -- Progress and attempt deadlines ------------------------------------------------------


def progress_of_heartbeats(board: Client, task: Task) -> list[Any]:
    """Return the progress each heartbeat on ``task`` reported (None: none), in order."""
    return [e.payload.get("progress") for e in board.events(task=task, type="heartbeat").results]


@live
def test_the_lease_sends_reported_progress_within_a_second_and_only_the_latest(
    board: Client,
) -> None:
    board.create("long job", queue="q")
    [task] = board.claim(queues=["q"], lease_seconds=60)  # a heartbeat every 20 s

    def reported() -> list[Any]:
        return [
            e.payload.get("progress") for e in board.events(task=task, type="heartbeat").results
        ]

    with board.lease(task) as lease:
        for n in range(20):
            lease.report_progress({"done": n})
        eventually(lambda: reported() == [{"done": 19}], timeout=3, what="the progress")
        sent = time.monotonic()
        lease.report_progress({"done": 20})
        eventually(lambda: len(reported()) == 2, timeout=10, what="the next progress")
        # Not sooner than a second after the previous heartbeat.
        assert time.monotonic() - sent >= 0.8
        assert reported() == [{"done": 19}, {"done": 20}]
        lease.complete()


@live
def test_a_progress_the_server_refuses_is_dropped_and_the_lease_lives_on(board: Client) -> None:
    board.create("careless", queue="q")
    [task] = board.claim(queues=["q"], lease_seconds=3)  # a heartbeat every second

    with board.lease(task) as lease:
        lease.report_progress({"text": "a NUL \u0000 PostgreSQL cannot store"})
        time.sleep(2.5)
        assert not lease.lost
        lease.report_progress({"fine": True})
        eventually(
            lambda: board.events(task=task, type="heartbeat").results[-1].payload.get("progress"),
            timeout=10,
            what="the next progress",
        )
        lease.complete()

    reported = [
        e.payload.get("progress") for e in board.events(task=task, type="heartbeat").results
    ]
    assert len(reported) >= 3
    assert [p for p in reported if p is not None] == [{"fine": True}]


@live
def test_progress_reported_before_a_fail_comes_back_with_the_next_claim(board: Client) -> None:
    board.create("resumable", queue="q")
    [task] = board.claim(queues=["q"], lease_seconds=60)
    assert task.progress is None

    with board.lease(task) as lease:
        lease.report_progress({"page": 7})
        lease.fail("interrupted")  # before the heartbeat thread sent it

    assert board.get(task).progress == {"page": 7}
    [again] = board.claim(queues=["q"])
    assert (again.id, again.progress) == (task.id, {"page": 7})
    with board.lease(again) as lease:
        lease.report_progress({"page": 9})
        lease.release()
    [third] = board.claim(queues=["q"])
    assert third.progress == {"page": 9}


@live
def test_the_lease_is_lost_at_the_attempt_deadline_however_often_it_heartbeats(
    board: Client,
) -> None:
    board.create("spinner", queue="q", max_attempt_seconds=2)
    [task] = board.claim(queues=["q"], lease_seconds=60)
    assert task.max_attempt_seconds == 2
    told: list[Lease] = []

    lease = board.lease(task, on_lost=told.append, interval=0.5)
    assert lease.wait_lost(timeout=4)
    assert 1.8 <= time.monotonic() - task.claimed_at < 2.5
    assert told == [lease] and isinstance(lease.error, LeaseLost)
    assert lease.error.code == "attempt_deadline"
    lease.stop()

    # The server holds the deadline too: the holder's calls are refused from then on.
    eventually(lambda: datetime.now(UTC) > task.attempt_deadline, timeout=2)  # type: ignore[operator]
    with pytest.raises(LeaseLost) as refused:
        board.heartbeat(task)
    assert "deadline" in refused.value.detail
    with pytest.raises(LeaseLost):
        board.complete(task, result="too late")


@live
def test_a_refused_finish_keeps_the_lease_alive_unless_it_was_stopped(board: Client) -> None:
    """A complete the server refuses for its body finishes nothing: the heartbeats go on,
    so the holder can send a corrected one. After stop(), they stay stopped."""
    board.create("retry", queue="q")
    [task] = board.claim(queues=["q"], lease_seconds=2)
    lease = board.lease(task).start()
    with pytest.raises(ValidationError):
        lease.fail("   ")
    assert not lease.finished
    time.sleep(3)  # past the lease: only the heartbeats keep it
    assert not lease.lost
    assert lease.complete(result="ok").status == "done"

    board.create("stopped", queue="q")
    [task] = board.claim(queues=["q"], lease_seconds=2)
    lease = board.lease(task).start()
    lease.stop()
    with pytest.raises(ValidationError):
        lease.fail("   ")
    assert not lease._thread.is_alive(), "stopped heartbeats started again"


# -- The stream --------------------------------------------------------------------------


class StreamReader:
    """Iterate ``client.stream()`` in a thread, collecting what it yields."""

    def __init__(self, client: Client) -> None:
        self.events: queue.Queue[Event | BaseException] = queue.Queue()
        self._thread = threading.Thread(target=self._run, args=(client,), daemon=True)
        self._thread.start()

    def _run(self, client: Client) -> None:
        try:
            for event in client.stream():
                self.events.put(event)
        except BaseException as exc:  # closing the client ends the thread
            self.events.put(exc)

    def get(self, timeout: float = 5.0) -> Event:
        item = self.events.get(timeout=timeout)
        if isinstance(item, BaseException):
            raise item
        return item


@live
def test_the_stream_yields_events_and_resumes_after_a_dropped_connection(
    token: str, agent: Any
) -> None:
    port = free_port()
    first = LiveServer(port).start()
    watcher = Client(first.url, token, backoff=0.1, max_backoff=0.3)
    try:
        stream = StreamReader(watcher)
        # The stream starts with the next event once it is open: knock until it answers.
        deadline = time.monotonic() + 10
        while stream.events.empty() and time.monotonic() < deadline:
            transitions.create(actor=agent, title="knock", queue="knock")
            time.sleep(0.2)
        task = transitions.create(actor=agent, title="watched", queue="q")
        while (seen := stream.get()).task_id != task.id:
            pass
        assert (seen.type, seen.status, seen.actor) == ("created", "pending", "agent-smith")
        assert seen.payload["title"] == "watched"
        assert seen.stream_id
        # The task as it is right after the event, as the stream sends it.
        assert seen.task is not None
        assert (seen.task.id, seen.task.status, seen.task.title) == (task.id, "pending", "watched")

        first.stop()  # the connection drops; these happen while nobody serves the stream
        [claim] = transitions.claim(actor=agent, queues=["q"])
        transitions.complete(task_id=task.id, actor=agent, lease_token=claim.lease_token)
        with live_server(port):
            missed = [stream.get(timeout=10), stream.get(timeout=10)]
            assert [(e.task_id, e.type) for e in missed] == [
                (task.id, "claimed"),
                (task.id, "completed"),
            ]
            # A replayed event whose task has a later event carries no task: the later does.
            assert [e.task.status if e.task else None for e in missed] == [None, "done"]
            assert [e.id for e in missed] == [e.id for e in watcher.iter_events(after=seen.id)]
            with pytest.raises(queue.Empty):
                stream.events.get(timeout=0.3)  # nothing twice
    finally:
        watcher.close()
        first.stop()


# -- The lease helper --------------------------------------------------------------------


class UnavailableOnce(httpx.BaseTransport):
    """The real transport, except that the first request whose path ends with ``path``
    is answered 503 with a Retry-After, as the board answers while its database is away."""

    def __init__(self, path: str, retry_after: int) -> None:
        self.real = httpx.HTTPTransport()
        self.path, self.retry_after = path, retry_after
        self.refused = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith(self.path) and not self.refused:
            self.refused += 1
            body = {"error": "unavailable", "detail": "The database is unavailable."}
            return httpx.Response(503, json=body, headers={"Retry-After": str(self.retry_after)})
        return self.real.handle_request(request)


@live
def test_a_complete_refused_503_is_tried_again_with_the_lease_heartbeating_meanwhile(
    server: LiveServer, token: str
) -> None:
    # The retry waited out the 503's Retry-After (3 s) with the heartbeats stopped: the 2 s
    # lease ran out first, and the complete that then went through got lease_lost.
    outage = UnavailableOnce("/complete/", retry_after=3)
    with Client(server.url, token, transport=outage) as board:
        board.create("finished during an outage", queue="q")
        [task] = board.claim(queues=["q"], lease_seconds=2)
        with board.lease(task) as lease:
            done = lease.complete({"ok": True})

    assert outage.refused == 1
    assert done.status == "done" and not lease.lost
    row = TaskRow.objects.get(id=task.id)
    assert (row.status, row.failure_count) == ("done", 0)


@live
def test_the_lease_helper_heartbeats_until_the_task_is_completed(board: Client) -> None:
    board.create("long job", queue="q")
    claimed = time.monotonic()
    [task] = board.claim(queues=["q"], lease_seconds=3)  # a heartbeat every second
    assert task.leased_until is not None

    def heartbeats() -> int:
        return len(board.events(task=task, type="heartbeat").results)

    with board.lease(task) as lease:
        eventually(lambda: heartbeats() >= 2, timeout=5, what="two heartbeats")
        assert time.monotonic() - claimed >= 1.9, "every third of the lease, not more often"
        assert not lease.lost
        leased_until = TaskRow.objects.get(id=task.id).leased_until
        assert leased_until is not None and leased_until > task.leased_until + timedelta(
            seconds=1.5
        )
        assert lease.latest.leased_until is not None
        assert lease.latest.leased_until > task.leased_until
        done = lease.complete({"ok": True})

    assert (done.status, done.result) == ("done", {"ok": True})
    beats = heartbeats()
    time.sleep(1.2)
    assert heartbeats() == beats, "no heartbeat after the task is done"
    assert not lease.lost


@live
def test_the_lease_helper_reports_the_loss_at_once_when_another_agent_reclaims(
    board: Client, other_board: Client, other_agent: Any
) -> None:
    board.create("contested", queue="q")
    [task] = board.claim(queues=["q"], lease_seconds=3)
    told: list[Lease] = []
    lease = board.lease(task, on_lost=told.append)

    expire_and_claim(task.id, other_agent)  # as if our heartbeats had not got through
    reclaimed = time.monotonic()

    assert lease.wait_lost(timeout=3.0)
    # At the next heartbeat (every second), not when the 3 s lease would have run out.
    assert time.monotonic() - reclaimed < 2.0
    assert lease.lost and told == [lease]
    assert isinstance(lease.error, LeaseLost)
    with pytest.raises(LeaseLost):
        lease.complete("too late")
    assert told == [lease], "told once"
    now = TaskRow.objects.get(id=task.id)
    assert (now.status, now.leased_by_id, now.failure_count) == ("in_progress", "agent-jones", 1)


@live
def test_a_lease_claimed_after_a_wait_longer_than_the_lease_lives_on(
    board: Client, agent: Any
) -> None:
    threading.Timer(3, lambda: transitions.create(actor=agent, title="late", queue="w")).start()
    sent = time.monotonic()
    [task] = board.claim(queues=["w"], wait=10, lease_seconds=2)
    received = time.monotonic()

    # Counted from the claim, not from the request sent 3 s before it.
    assert received - sent >= 2.9
    assert received - 0.5 <= task.claimed_at <= received
    with board.lease(task) as lease:
        assert not lease.wait_lost(timeout=2.5)  # heartbeats every 2/3 s keep it
        lease.complete()
    assert board.get(task).status == "done"


@live
def test_the_lease_helper_says_the_lease_is_lost_when_no_heartbeat_gets_through(
    board: Client,
) -> None:
    board.create("unreachable", queue="q")
    claimed = time.monotonic()
    [task] = board.claim(queues=["q"], lease_seconds=2)
    # The same lease, seen through a client whose server has gone away.
    with Client(f"http://127.0.0.1:{free_port()}", "token", timeout=0.5) as cut_off:
        lease = cut_off.lease(task)
        assert lease.wait_lost(timeout=5.0)
        lost_after = time.monotonic() - claimed
        assert isinstance(lease.error, LeaseLost)
        lease.stop()
    assert 1.9 <= lost_after < 3.5  # when the lease ran out, and not before


@live
def test_a_lease_block_that_raises_fails_the_task_and_one_that_just_ends_releases_it(
    board: Client,
) -> None:
    board.create("raises", queue="q")
    board.create("ends", queue="q")
    raises, ends = sorted(board.claim(queues=["q"], limit=2), key=lambda t: t.id)

    with pytest.raises(RuntimeError), board.lease(raises):
        raise RuntimeError("disk full")
    with board.lease(ends):
        pass

    failed, released = board.get(raises), board.get(ends)
    assert (failed.status, failed.failure_count, failed.last_error) == (
        "pending",
        1,
        "RuntimeError: disk full",
    )
    assert (released.status, released.failure_count) == ("pending", 0)
    assert board.task_events(ends).results[-1].type == "released"


@live
def test_creates_and_comments_past_the_rate_raise_rate_limited(
    board: Client, settings: Any
) -> None:
    settings.TASKBOARD_CREATE_RATE = 1
    settings.TASKBOARD_COMMENT_RATE = 1
    task = board.create("one")
    board.comment(task, "first")

    with pytest.raises(RateLimited) as created:
        board.create("two")
    with pytest.raises(RateLimited) as commented:
        board.comment(task, "second")

    for refused in (created.value, commented.value):
        assert (refused.status, refused.code) == (429, "rate_limited")
        assert refused.retry_after is not None and 1 <= refused.retry_after <= 120
    assert [t.title for t in board.list_tasks().results] == ["one"]
