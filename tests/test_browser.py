"""The board in a real browser: headless Chromium driven by Playwright, against a real
uvicorn server (tests/live.py) on the test database.

Agents act as they do in production, through board.transitions or the REST API with a
token; people act through the pages. Each test checks what a person sees, and what the
database recorded.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.db import connection, transaction
from django.utils import timezone
from playwright.sync_api import Page, expect

from board import transitions
from board.api.serializers import TaskSerializer
from board.models import Task, TaskEvent
from tests.browser import PASSWORD, card, count, log_in, requires_chromium, wait_until_live
from tests.factories import TokenFactory
from tests.live import LiveServer

pytestmark = [
    pytest.mark.once,
    pytest.mark.django_db(transaction=True),
    requires_chromium,
]


def history(task_id: int) -> list[tuple[str, str]]:
    return list(
        TaskEvent.objects.filter(task_id=task_id).order_by("id").values_list("type", "actor")
    )


def test_the_board_shows_a_task_an_agent_claims_as_it_happens_without_a_reload(
    server: LiveServer, page: Page, person: Any, agent: Any
) -> None:
    log_in(page, person)
    navigations: list[str] = []
    page.on("framenavigated", lambda frame: navigations.append(frame.url))
    page.evaluate("window.boardMarker = 'the same page'")
    api = httpx.Client(
        base_url=f"{server.url}/api/v1",
        headers={"Authorization": f"Bearer {TokenFactory.create(user=agent).key}"},
    )

    created = api.post("/tasks/", json={"title": "Resize images", "queue": "images"}).json()
    expect(card(page, "pending", created["id"])).to_contain_text("Resize images")
    claimed = api.post("/tasks/claim/", json={"queues": ["images"], "lease_seconds": 60})
    started = time.monotonic()
    assert claimed.json()["tasks"][0]["id"] == created["id"]

    in_progress = card(page, "in_progress", created["id"])
    expect(in_progress).to_contain_text(agent.username, timeout=5000)
    elapsed = time.monotonic() - started

    assert elapsed < 5.0  # pushed by the stream, not a reload or a 30 s check
    expect(in_progress).to_contain_text("Resize images")
    expect(in_progress.locator(".lease")).to_have_text(re.compile(r"^[01]:\d\d left$"))
    expect(card(page, "pending", created["id"])).to_have_count(0)
    expect(count(page, "in_progress")).to_have_text("1")
    expect(count(page, "pending")).to_have_text("0")
    assert page.evaluate("window.boardMarker") == "the same page"
    assert navigations == [], "the board never reloaded"
    api.close()


def test_a_person_creates_a_task_on_the_board_then_claims_and_completes_it(
    page: Page, person: Any
) -> None:
    log_in(page, person)

    page.get_by_role("button", name="New task").click()
    form = page.locator("#new-task-form")
    form.get_by_label("Title").fill("Write the release notes")
    form.get_by_label("Queue").fill("docs")
    form.get_by_label("Priority").fill("3")
    form.get_by_label("Description").fill("For 1.2, from the changelog.")
    form.get_by_label("Payload").fill('{"version": "1.2"}')
    form.get_by_role("button", name="Create task").click()

    pending = page.locator('[data-column="pending"] .card', has_text="Write the release notes")
    expect(pending).to_be_visible()
    expect(count(page, "pending")).to_have_text("1")
    task = Task.objects.get(title="Write the release notes")
    assert (task.queue, task.priority, task.payload) == ("docs", 3, {"version": "1.2"})
    assert (task.description, task.created_by_id) == ("For 1.2, from the changelog.", "pat")
    expect(pending).to_contain_text("docs")

    page.get_by_role("button", name="Claim next").click()

    mine = card(page, "in_progress", task.id)
    expect(mine).to_contain_text("pat")
    expect(mine).to_have_class(re.compile(r"\bmine\b"))
    mine.get_by_role("button", name="Complete").click()

    done = card(page, "finished", task.id)
    expect(done).to_contain_text("done")
    expect(count(page, "done")).to_have_text("1")
    expect(count(page, "in_progress")).to_have_text("0")
    expect(count(page, "pending")).to_have_text("0")
    assert Task.objects.get(pk=task.id).status == "done"
    assert history(task.id) == [("created", "pat"), ("claimed", "pat"), ("completed", "pat")]
    assert page.evaluate("Object.keys(sessionStorage)") == [], "the lease token is dropped"


def test_a_person_releases_a_task_and_fails_it_with_an_error_text(
    page: Page, person: Any, make_task: Callable[..., Task]
) -> None:
    task = make_task(title="Import prices", max_failures=3)
    log_in(page, person)

    page.get_by_role("button", name="Claim next").click()
    card(page, "in_progress", task.id).get_by_role("button", name="Release").click()
    expect(card(page, "pending", task.id)).to_be_visible()

    page.get_by_role("button", name="Claim next").click()
    mine = card(page, "in_progress", task.id)
    mine.get_by_role("button", name="Fail…").click()
    mine.get_by_label("Error").fill("the supplier's file is empty")
    mine.get_by_role("button", name="Fail task").click()

    back = card(page, "pending", task.id)
    expect(back).to_contain_text("the supplier's file is empty")
    expect(back).to_contain_text("1/3 strikes")
    assert history(task.id) == [
        ("created", "agent-smith"),
        ("claimed", "pat"),
        ("released", "pat"),
        ("claimed", "pat"),
        ("failed", "pat"),
    ]
    assert Task.objects.get(pk=task.id).last_error == "the supplier's file is empty"


def test_an_event_the_board_already_counts_is_not_counted_again_when_the_stream_sends_it(
    page: Page,
    person: Any,
    agent: Any,
    make_task: Callable[..., Task],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A transaction left open holds the stream's stable prefix back: a task created after
    it began is in the page's counts, and the stream will still send its "created" event.
    (The column shows one card, so the page cannot tell from its cards.)"""
    monkeypatch.setattr("board.pages.views.OPEN_COLUMN_LIMIT", 1)
    make_task(title="Urgent", priority=10)
    inserted, release = threading.Event(), threading.Event()

    def open_transaction() -> None:
        try:
            with transaction.atomic():
                transitions.create(actor=agent, title="Committed last")
                inserted.set()
                release.wait(10)
        finally:
            connection.close()

    thread = threading.Thread(target=open_transaction)
    thread.start()
    try:
        assert inserted.wait(10)
        transitions.create(actor=agent, title="Counted, not drawn")
        log_in(page, person)
        expect(count(page, "pending")).to_have_text("2")
        expect(page.locator('[data-column="pending"] [data-more]')).to_have_text("1 more not shown")
    finally:
        release.set()
        thread.join(10)
    sentinel = transitions.create(actor=agent, title="After everything")

    # The stream is in order: once the last event is on the page, so are those before it.
    expect(card(page, "pending", sentinel.id)).to_be_visible()
    expect(count(page, "pending")).to_have_text("4")


def test_a_task_created_elsewhere_appears_on_the_board_as_the_server_has_it(
    server: LiveServer, page: Page, person: Any, agent: Any
) -> None:
    """The board draws a new task from the task its "created" event carries, not from the
    event's summary: a retry time the event does not mention still shows."""
    log_in(page, person)
    wait_until_live(page)
    api = httpx.Client(
        base_url=f"{server.url}/api/v1",
        headers={"Authorization": f"Bearer {TokenFactory.create(user=agent).key}"},
    )
    later = (timezone.now() + timedelta(hours=1)).isoformat()

    created = api.post("/tasks/", json={"title": "Nightly report", "run_after": later}).json()

    expect(card(page, "pending", created["id"])).to_contain_text("retry after")
    expect(count(page, "pending")).to_have_text("1")
    api.close()


def test_a_task_the_board_did_not_draw_is_fetched_and_counted_when_it_comes_back(
    page: Page,
    person: Any,
    agent: Any,
    staff: Any,
    make_task: Callable[..., Task],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("board.pages.views.FINISHED_LIMIT", 1)
    older, newer = make_task(title="Older export"), make_task(title="Newer export")
    for task in (older, newer):
        transitions.cancel(task_id=task.id, actor=staff)
    log_in(page, person)
    expect(page.locator('[data-column="finished"] .card')).to_have_count(1)
    expect(count(page, "cancelled")).to_have_text("2")

    transitions.requeue(task_id=older.id, actor=staff)

    expect(card(page, "pending", older.id)).to_contain_text("Older export")
    expect(count(page, "cancelled")).to_have_text("1")
    expect(count(page, "pending")).to_have_text("1")


def test_a_board_filtered_by_queue_ignores_the_other_queues(
    page: Page, person: Any, agent: Any, make_task: Callable[..., Task]
) -> None:
    first = make_task(title="Send the invoices", queue="mail")
    log_in(page, person)
    page.get_by_label("Filter by queue").select_option("mail")
    expect(page).to_have_url(re.compile(r"/\?queue=mail$"))
    wait_until_live(page)
    expect(page.get_by_role("button", name="Claim next in mail")).to_be_visible()
    expect(card(page, "pending", first.id)).to_be_visible()

    images = make_task(title="Resize", queue="images")
    transitions.claim(actor=agent, queues=["images"])
    mail = make_task(title="Send the digest", queue="mail")

    expect(card(page, "pending", mail.id)).to_contain_text("Send the digest")
    expect(page.locator(f'.card[data-task-id="{images.id}"]')).to_have_count(0)
    expect(count(page, "pending")).to_have_text("2")
    expect(count(page, "in_progress")).to_have_text("0")
    expect(page.locator("#queue-select option")).to_have_text(["All queues", "images", "mail"])


def test_the_lease_countdown_turns_to_stalled_when_the_lease_runs_out(
    page: Page, person: Any, agent: Any, make_task: Callable[..., Task]
) -> None:
    log_in(page, person)
    task = make_task(title="Transcode video")

    transitions.claim(actor=agent, lease_seconds=1)

    in_progress = card(page, "in_progress", task.id)
    expect(in_progress).to_contain_text(agent.username)
    expect(in_progress.locator(".lease")).to_have_text("stalled", timeout=3000)
    expect(in_progress).to_have_class(re.compile(r"\bstalled\b"))
    assert Task.objects.get(pk=task.id).status == "in_progress", "nothing but a claim expires it"


def test_the_lease_countdown_keeps_the_servers_time_when_the_script_runs_late(
    page: Page, person: Any, agent: Any, make_task: Callable[..., Task]
) -> None:
    # The page took the server's clock minus its own when the script ran, so every second
    # between the server's render and the script (a slow script load here) was counted as
    # a clock difference: countdowns ran that much behind the server.
    task = make_task(title="Transcode video")
    transitions.claim(actor=agent, lease_seconds=120)
    leased_until = Task.objects.get(pk=task.id).leased_until
    assert leased_until is not None
    late = 5.0

    def slow_script(route: Any) -> None:
        time.sleep(late)
        route.continue_()

    page.route("**/board.js", slow_script)
    log_in(page, person)
    text = card(page, "in_progress", task.id).locator(".lease").inner_text()
    left = (leased_until - timezone.now()).total_seconds()

    minutes, seconds = re.fullmatch(r"(\d+):(\d\d) left", text).groups()  # type: ignore[union-attr]
    shown = int(minutes) * 60 + int(seconds)
    # Rounded up, refreshed once a second, read before ``left``: up to about 2 s ahead.
    assert -0.5 < shown - left < 2.5, (text, left)


def claim_on_the_board(
    page: Page, person: Any, make_task: Callable[..., Task], settings: Any
) -> Task:
    """Log ``person`` in and claim a new task on the board, with a 3 s lease (the page
    heartbeats every second); return the task once the page shows it as the person's."""
    settings.TASKBOARD_LEASE_SECONDS = 3
    task = make_task(title="Review the contract")
    log_in(page, person)
    page.get_by_role("button", name="Claim next").click()
    expect(card(page, "in_progress", task.id)).to_have_class(re.compile(r"\bmine\b"))
    return task


def take_the_lease_from_the_page(page: Page, task_id: int) -> None:
    """Give the page another holder's token, as if the lease had gone to someone else."""
    page.evaluate(
        "([key, token]) => sessionStorage.setItem(key, JSON.stringify({token, seconds: 3}))",
        [f"taskboard.lease.{task_id}", str(uuid.uuid4())],
    )


def test_the_open_board_keeps_a_persons_lease_alive_and_says_when_it_is_lost(
    page: Page, person: Any, make_task: Callable[..., Task], settings: Any
) -> None:
    task = claim_on_the_board(page, person, make_task, settings)
    time.sleep(4.5)  # longer than the lease

    held = Task.objects.get(pk=task.id)
    assert held.status == "in_progress" and held.leased_by_id == "pat"
    assert held.leased_until is not None and held.leased_until > timezone.now()
    assert TaskEvent.objects.filter(task=task, type="heartbeat", actor="pat").count() >= 2

    take_the_lease_from_the_page(page, task.id)

    expect(page.get_by_role("alert")).to_contain_text(f"You lost the lease on #{task.id}")
    expect(card(page, "in_progress", task.id)).to_contain_text("Lease lost")


def test_a_board_whose_session_ended_says_so_and_stops_asking(
    page: Page, person: Any, make_task: Callable[..., Task], settings: Any
) -> None:
    """Logged out elsewhere (or the session expired), an open board would ask for its
    stream, its panels and its leases' heartbeats for as long as it stays open, every one
    answered 401: it says the person is signed out and asks nothing more."""
    from django.contrib.sessions.models import Session

    claim_on_the_board(page, person, make_task, settings)  # heartbeats every second
    wait_until_live(page)
    asked: list[str] = []
    page.on("request", lambda request: asked.append(request.url))

    Session.objects.all().delete()

    expect(page.get_by_role("alert")).to_contain_text("You are signed out", timeout=5000)
    expect(page.locator(".live")).to_have_text("Signed out")
    login = page.get_by_role("link", name="Log in again")
    expect(login).to_have_attribute("href", "/accounts/login/?next=%2F")
    asked.clear()
    time.sleep(16)  # past the panels' refresh (15 s), many heartbeats, a stream retry
    assert asked == []


def test_the_lost_lease_warning_clears_once_the_task_is_finished(
    page: Page, person: Any, make_task: Callable[..., Task], settings: Any
) -> None:
    task = claim_on_the_board(page, person, make_task, settings)
    real_token = str(Task.objects.get(pk=task.id).lease_token)
    take_the_lease_from_the_page(page, task.id)
    warning = page.get_by_role("alert").filter(has_text=f"You lost the lease on #{task.id}")
    expect(warning).to_be_visible()

    # Whoever holds it now finishes it: nobody works on it any more.
    transitions.complete(task_id=task.id, actor=person, lease_token=real_token)

    expect(card(page, "finished", task.id)).to_be_visible()
    expect(warning).to_have_count(0)


def test_the_task_page_shows_the_timeline_growing_live(
    page: Page, person: Any, agent: Any, make_task: Callable[..., Task]
) -> None:
    task = make_task(title="Resize images", payload={"bucket": "in"})
    log_in(page, person)
    page.goto(f"/tasks/{task.id}/")
    wait_until_live(page)
    expect(page.locator("[data-timeline] .event")).to_have_count(1)

    [claim] = transitions.claim(actor=agent, lease_seconds=60)
    expect(page.locator('[data-field="holder"]')).to_have_text(agent.username)
    expect(page.locator('[data-field="status"]')).to_have_text("in progress")
    transitions.complete(
        task_id=task.id, actor=agent, lease_token=claim.lease_token, result={"resized": 12}
    )

    expect(page.locator('[data-field="status"]')).to_have_text("done")
    expect(page.locator(".event-type")).to_have_text(["created", "claimed", "completed"])
    expect(page.locator('[data-field="result"]')).to_contain_text('"resized": 12')
    expect(page.locator('[data-field="lease-panel"]')).to_be_hidden()


def test_the_task_page_reads_the_task_for_a_value_too_large_to_stream(
    page: Page, person: Any, agent: Any, make_task: Callable[..., Task]
) -> None:
    """A progress over 8 KiB comes on the stream as null, named in ``elided``: the page
    shows the one it reads from the API, never the null."""
    task = make_task(title="Count the rows")
    log_in(page, person)
    page.goto(f"/tasks/{task.id}/")
    wait_until_live(page)
    [claim] = transitions.claim(actor=agent, lease_seconds=60)
    expect(page.locator('[data-field="holder"]')).to_have_text(agent.username)

    transitions.heartbeat(
        task_id=task.id,
        actor=agent,
        lease_token=claim.lease_token,
        progress={"rows": "r" * 20_000, "step": "last"},
    )

    expect(page.locator('[data-field="progress"]')).to_contain_text('"step": "last"')
    expect(page.locator(".event-heartbeat")).to_contain_text("too large to show live")


def test_the_admin_requeue_action_puts_an_escalated_task_back_on_the_board(
    new_page: Callable[[], Page], agent: Any, make_task: Callable[..., Task], settings: Any
) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    admin = get_user_model().objects.create_superuser("root", password=PASSWORD)
    task = make_task(title="Import supplier prices", max_failures=1)
    [claim] = transitions.claim(actor=agent)
    transitions.fail(task_id=task.id, actor=agent, lease_token=claim.lease_token, error="bad CSV")
    assert Task.objects.get(pk=task.id).status == "escalated"

    triage = new_page()
    triage.goto("/admin/")
    triage.get_by_label("Username").fill("root")
    triage.get_by_label("Password").fill(PASSWORD)
    triage.get_by_role("button", name="Log in").click()
    expect(triage).to_have_url(re.compile(r"/admin/$"))

    board = new_page()  # the same browser, so the same session
    board.goto("/")
    wait_until_live(board)
    expect(card(board, "escalated", task.id)).to_contain_text("bad CSV")

    triage.goto("/admin/escalations/escalatedtask/")
    triage.locator(f'input[name="_selected_action"][value="{task.id}"]').check()
    triage.locator('select[name="action"]').select_option("requeue")
    triage.get_by_role("button", name="Go").click()
    expect(triage.locator(".messagelist")).to_contain_text("Requeued 1 task")

    requeued = Task.objects.get(pk=task.id)
    assert (requeued.status, requeued.failure_count) == ("pending", 0)
    assert history(task.id)[-1] == ("requeued", admin.username)
    expect(card(board, "pending", task.id)).to_be_visible()
    expect(count(board, "escalated")).to_have_text("0")
    expect(count(board, "pending")).to_have_text("1")


@pytest.mark.slow
def test_a_dependency_chain_completes_live_on_the_board(
    server: LiveServer, page: Page, person: Any, agent: Any
) -> None:
    """A -> B -> C, made and worked by an agent through the API while a person watches: each
    task shows it is blocked and by what, and is unblocked live when the one before is done."""
    log_in(page, person)
    navigations: list[str] = []
    page.on("framenavigated", lambda frame: navigations.append(frame.url))
    api = httpx.Client(
        base_url=f"{server.url}/api/v1",
        headers={"Authorization": f"Bearer {TokenFactory.create(user=agent).key}"},
    )
    a = api.post("/tasks/", json={"title": "Fetch the data", "queue": "plan"}).json()
    b = api.post(
        "/tasks/", json={"title": "Clean the data", "queue": "plan", "depends_on": [a["id"]]}
    ).json()
    c = api.post(
        "/tasks/", json={"title": "Chart the data", "queue": "plan", "depends_on": [b["id"]]}
    ).json()

    card_a, card_b, card_c = (card(page, "pending", task["id"]) for task in (a, b, c))
    expect(card_a).to_be_visible()
    expect(card_a.locator(".chip-blocked")).to_have_count(0)
    expect(card_b.locator(".chip-blocked")).to_have_text("blocked")
    expect(card_b.locator(".card-blockers")).to_have_text(f"Waiting for #{a['id']} pending")
    expect(card_c.locator(".card-blockers")).to_have_text(f"Waiting for #{b['id']} pending")
    plan = page.locator('[data-queues] tr[data-queue="plan"]')
    expect(plan.locator('[data-n="blocked"]')).to_have_text("2")

    def work(expected: dict[str, Any]) -> None:
        claimed = api.post("/tasks/claim/", json={"queues": ["plan"], "lease_seconds": 60})
        [task] = claimed.json()["tasks"]
        assert task["id"] == expected["id"], "a blocked task is never handed out"
        expect(card(page, "in_progress", task["id"])).to_contain_text(agent.username)
        token = task["lease_token"]
        assert api.post(f"/tasks/{task['id']}/complete/", json={"lease_token": token}).is_success

    # A is held: B still waits for it, and says so.
    claimed = api.post("/tasks/claim/", json={"queues": ["plan"], "lease_seconds": 60}).json()
    assert [task["id"] for task in claimed["tasks"]] == [a["id"]]
    expect(card_b.locator(".card-blockers")).to_have_text(f"Waiting for #{a['id']} in progress")
    token = claimed["tasks"][0]["lease_token"]
    assert api.post(f"/tasks/{a['id']}/complete/", json={"lease_token": token}).is_success

    expect(card(page, "finished", a["id"])).to_contain_text("done")
    expect(card_b.locator(".chip-blocked")).to_have_count(0)
    expect(card_b.locator(".card-blockers")).to_have_count(0)
    expect(card_c.locator(".card-blockers")).to_have_text(f"Waiting for #{b['id']} pending")
    expect(plan.locator('[data-n="blocked"]')).to_have_text("1")

    work(b)
    expect(card_c.locator(".chip-blocked")).to_have_count(0)
    work(c)
    expect(card(page, "finished", c["id"])).to_contain_text("done")
    expect(count(page, "done")).to_have_text("3")
    expect(plan.locator('[data-n="done"]')).to_have_text("3")
    expect(plan.locator('[data-n="blocked"]')).to_have_text("0")
    assert [event[0] for event in history(b["id"])] == [
        "created",
        "unblocked",
        "claimed",
        "completed",
    ]
    assert navigations == [], "the board never reloaded"
    api.close()


@pytest.mark.slow
def test_a_dependent_of_a_cancelled_task_shows_it_stays_blocked_live(
    page: Page, person: Any, staff: Any, make_task: Callable[..., Task]
) -> None:
    first = make_task(title="Order parts")
    then = make_task(title="Assemble", depends_on=[first.id])
    log_in(page, person)
    blockers = card(page, "pending", then.id).locator(".card-blockers")
    expect(blockers).to_have_text(f"Waiting for #{first.id} pending")

    transitions.cancel(task_id=first.id, actor=staff)

    expect(blockers).to_have_text(f"Waiting for #{first.id} cancelled")
    expect(card(page, "pending", then.id).locator(".chip-blocked")).to_be_visible()


@pytest.mark.slow
def test_a_comment_posted_on_the_task_page_appears_in_its_timeline_and_on_other_pages_live(
    new_page: Callable[[], Page], person: Any, make_task: Callable[..., Task]
) -> None:
    task = make_task(title="Check the translation")
    writer = new_page()
    log_in(writer, person)
    reader = new_page()  # the same browser, so the same session
    reader.goto(f"/tasks/{task.id}/")
    wait_until_live(reader)
    reader.evaluate("window.readerMarker = 'not reloaded'")
    writer.goto(f"/tasks/{task.id}/")
    wait_until_live(writer)

    writer.get_by_role("button", name="Post comment").click()
    expect(writer.get_by_role("alert")).to_have_text(
        "The comment is empty: write something to post."
    )
    writer.get_by_label("Comment").fill("The German <i>strings</i> are missing.\nSee row 12.")
    writer.get_by_role("button", name="Post comment").click()

    for page in (writer, reader):
        comment = page.locator("[data-timeline] .event-commented")
        expect(comment).to_have_count(1)
        expect(comment.locator(".comment-body")).to_have_text(
            "The German <i>strings</i> are missing.\nSee row 12."
        )
        expect(comment.locator(".event-actor")).to_have_text("by pat")
        expect(page.locator(".event-type")).to_have_text(["created", "commented"])
    assert reader.evaluate("window.readerMarker") == "not reloaded"
    assert history(task.id) == [("created", "agent-smith"), ("commented", "pat")]
    wait_until_live(writer)


@pytest.mark.slow
def test_staff_pause_a_queue_from_the_queues_panel(
    page: Page, make_task: Callable[..., Task], agent: Any, settings: Any
) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    admin = get_user_model().objects.create_superuser("root", password=PASSWORD)
    make_task(title="Send the digest", queue="mail")
    log_in(page, admin)
    row = page.locator('[data-queues] tr[data-queue="mail"]')
    expect(row.locator('[data-n="pending"]')).to_have_text("1")

    row.get_by_label("Note on mail").fill("the relay is down")
    row.get_by_role("button", name="Pause mail").click()

    expect(page.get_by_role("status").filter(has_text="Paused mail")).to_be_visible()
    expect(row.locator(".badge-paused")).to_have_text("paused")
    assert transitions.claim(actor=agent, queues=["mail"]) == []
    row.get_by_role("button", name="Resume mail").click()
    expect(row.locator(".badge-paused")).to_have_count(0)
    assert len(transitions.claim(actor=agent, queues=["mail"])) == 1


@pytest.mark.slow
def test_the_task_page_follows_its_work_graph_progress_and_attempt_deadline_live(
    page: Page, person: Any, agent: Any, make_task: Callable[..., Task]
) -> None:
    task = make_task(title="Translate the manual", max_attempt_seconds=3600)
    after = make_task(title="Print the manual", depends_on=[task.id])
    log_in(page, person)
    page.goto(f"/tasks/{task.id}/")
    wait_until_live(page)
    dependents = page.locator('[data-relation="dependents"]')
    expect(dependents.locator(f'[data-related-id="{after.id}"] .badge-blocked')).to_be_visible()
    expect(page.locator('[data-field="deadline"]')).to_be_hidden()

    [claim] = transitions.claim(actor=agent, lease_seconds=60)
    expect(page.locator('[data-field="lease"]')).to_have_text(re.compile(r"^[01]:\d\d left$"))
    expect(page.locator('[data-field="deadline"]')).to_have_text(
        re.compile(r"^attempt: (1h 00m|59:\d\d) left$")
    )
    child = transitions.create(actor=agent, title="Chapter one", parent_id=task.id)
    children = page.locator('[data-relation="children"]')
    expect(children.locator(f'[data-related-id="{child.id}"]')).to_contain_text("Chapter one")
    transitions.heartbeat(
        task_id=task.id, actor=agent, lease_token=claim.lease_token, progress={"chapters": 1}
    )
    expect(page.locator('[data-field="progress"]')).to_have_text('{\n  "chapters": 1\n}')
    [child_claim] = transitions.claim(actor=agent)
    assert child_claim.task.pk == child.id
    transitions.heartbeat(
        task_id=child.id, actor=agent, lease_token=child_claim.lease_token, progress={"pages": 4}
    )
    expect(children.locator(".related-progress")).to_have_text('{"pages":4}')
    expect(children.locator(".badge-in_progress")).to_be_visible()

    transitions.complete(task_id=task.id, actor=agent, lease_token=claim.lease_token)

    expect(page.locator('[data-field="status"]')).to_have_text("done")
    expect(dependents.locator(f'[data-related-id="{after.id}"] .badge-blocked')).to_have_count(0)
    expect(dependents.locator(f'[data-related-id="{after.id}"] .badge-pending')).to_be_visible()
    expect(page.locator('[data-field="deadline"]')).to_be_hidden()
    expect(page.locator('[data-field="progress"]')).to_have_text('{\n  "chapters": 1\n}')


@pytest.mark.slow
def test_the_board_says_when_the_attempt_deadline_took_a_task_from_its_holder(
    page: Page, person: Any, agent: Any, other_agent: Any, make_task: Callable[..., Task]
) -> None:
    task = make_task(title="Spin forever", max_attempt_seconds=1)
    log_in(page, person)

    transitions.claim(actor=agent, lease_seconds=60)
    held = card(page, "in_progress", task.id)
    expect(held).to_contain_text(agent.username)
    expect(held.locator(".deadline")).to_be_visible()
    time.sleep(1.2)  # past the attempt deadline (the lease was cut to it)
    transitions.claim(actor=other_agent)

    expect(held).to_contain_text(other_agent.username)
    expect(held.locator(".card-error")).to_have_text(
        f"attempt deadline passed (held by {agent.username})"
    )
    assert Task.objects.get(pk=task.id).last_error == (
        f"attempt deadline passed (held by {agent.username})"
    ), "the page says what the server recorded"
    expired = TaskEvent.objects.get(task=task, type="expired")
    assert expired.payload["reason"] == "attempt_deadline"


def test_cards_show_progress_and_comment_counts_as_they_change(
    page: Page, person: Any, agent: Any, make_task: Callable[..., Task]
) -> None:
    busy = make_task(title="Resize images", queue="images")
    waiting = make_task(title="Send the digest", queue="mail")
    transitions.comment(task_id=waiting.id, actor=agent, body="before the page")
    [claim] = transitions.claim(actor=agent, queues=["images"], lease_seconds=60)
    transitions.heartbeat(
        task_id=busy.id, actor=agent, lease_token=claim.lease_token, progress={"step": 1}
    )
    log_in(page, person)
    in_progress = card(page, "in_progress", busy.id)
    expect(in_progress.locator(".card-progress")).to_have_text('{"step":1}')
    expect(card(page, "pending", waiting.id).locator(".chip-comments")).to_have_text("1 comment")
    expect(in_progress.locator(".chip-comments")).to_have_count(0)

    transitions.heartbeat(
        task_id=busy.id, actor=agent, lease_token=claim.lease_token, progress="step 2 of 5"
    )
    expect(in_progress.locator(".card-progress")).to_have_text("step 2 of 5")
    transitions.heartbeat(
        task_id=busy.id, actor=agent, lease_token=claim.lease_token, progress={"step": 3}
    )
    expect(in_progress.locator(".card-progress")).to_have_text('{"step":3}')

    transitions.comment(task_id=waiting.id, actor=person, body="any news?")
    transitions.comment(task_id=busy.id, actor=person, body="nice")
    expect(card(page, "pending", waiting.id).locator(".chip-comments")).to_have_text("2 comments")
    expect(in_progress.locator(".chip-comments")).to_have_text("1 comment")
    expect(in_progress.locator(".card-progress")).to_have_text('{"step":3}')


# What a panel's content needs beyond the room it has: buttons whose label is cut, cells
# whose text is, tables wider than a container that cannot scroll them into view, and a
# page wider than the window.
CLIPPED = """() => {
  const problems = [];
  for (const node of document.querySelectorAll(".glance button, .glance .badge, .glance input")) {
    if (node.scrollWidth > node.clientWidth + 1) {
      problems.push(`${node.tagName} "${node.textContent || node.placeholder}": `
        + `${node.scrollWidth} > ${node.clientWidth}`);
    }
  }
  for (const table of document.querySelectorAll(".glance table")) {
    const box = table.parentElement;
    const scrolls = ["auto", "scroll"].includes(getComputedStyle(box).overflowX);
    if (table.offsetWidth > box.clientWidth + 1 && !scrolls) {
      const where = box.closest("section").id;
      problems.push(`table in ${where}: ${table.offsetWidth} > ${box.clientWidth}`);
    }
    for (const cell of table.querySelectorAll("th, td")) {
      if (cell.scrollWidth > cell.clientWidth + 1) {
        const text = cell.textContent.trim();
        problems.push(`cell "${text}": ${cell.scrollWidth} > ${cell.clientWidth}`);
      }
    }
  }
  const page = document.documentElement;
  if (page.scrollWidth > page.clientWidth + 1) {
    problems.push(`the page: ${page.scrollWidth} > ${page.clientWidth}`);
  }
  return problems;
}"""

# The glance tables' widths: [table width, its container's visible width, what it scrolls].
TABLE_WIDTHS = """() => [...document.querySelectorAll(".glance table")].map((table) => [
  table.offsetWidth, table.parentElement.clientWidth, table.parentElement.scrollWidth,
])"""


@pytest.mark.slow
@pytest.mark.parametrize("width", [1280, 390])
def test_the_panels_fit_common_widths_without_cutting_their_content(
    browser: Any,
    server: LiveServer,
    make_task: Callable[..., Task],
    agent: Any,
    other_agent: Any,
    settings: Any,
    width: int,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    admin = get_user_model().objects.create_superuser("root", password=PASSWORD)
    for queue in ("images", "mail-digests", "billing-exports", "default"):
        for n in range(12):
            make_task(title=f"{queue} {n}", queue=queue)
    for holder, queue in ((agent, "images"), (other_agent, "billing-exports")):
        for claim in transitions.claim(actor=holder, queues=[queue], limit=3, lease_seconds=600):
            transitions.heartbeat(
                task_id=claim.task.pk, actor=holder, lease_token=claim.lease_token
            )
        [claim] = transitions.claim(actor=holder, queues=[queue], lease_seconds=600)
        transitions.complete(task_id=claim.task.pk, actor=holder, lease_token=claim.lease_token)
    transitions.pause_queue(queue="mail-digests", actor=admin, note="relay down")
    context = browser.new_context(
        base_url=server.url, viewport={"width": width, "height": 900}, device_scale_factor=1
    )
    page = context.new_page()
    try:
        log_in(page, admin)
        expect(page.locator("[data-queues] tr")).to_have_count(4)
        expect(page.locator("[data-agents] tr")).to_have_count(2)

        shot = tmp_path / f"board-{width}.png"
        page.screenshot(path=str(shot), full_page=True)
        page.locator(".glance").screenshot(path=str(tmp_path / f"panels-{width}.png"))
        with capsys.disabled():
            print(f"\nscreenshots at {width} px: {shot}, {tmp_path / f'panels-{width}.png'}")

        assert page.evaluate(CLIPPED) == []
        for table, visible, scrolled in page.evaluate(TABLE_WIDTHS):
            assert table <= visible, "each table fits its panel: nothing is cut"
            assert scrolled <= visible, "nothing to scroll sideways to"
    finally:
        context.close()


def test_a_triager_requeues_an_escalated_task_from_its_page_on_the_board(
    page: Page, make_task: Callable[..., Task], agent: Any, settings: Any, tmp_path: Path
) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    admin = get_user_model().objects.create_superuser("root", password=PASSWORD)
    task = make_task(title="Import prices", queue="imports", max_failures=1)
    [claim] = transitions.claim(actor=agent, queues=["imports"])
    transitions.fail(task_id=task.id, actor=agent, lease_token=claim.lease_token, error="bad file")
    log_in(page, admin)
    page.goto(f"/tasks/{task.id}/")
    wait_until_live(page)

    panel = page.locator('[data-field="triage-panel"]')
    expect(panel).to_be_visible()
    expect(panel.get_by_role("link", name="Open the escalation queue")).to_have_attribute(
        "href", "/admin/escalations/escalatedtask/"
    )
    page.screenshot(path=str(tmp_path / "triage.png"), full_page=True)
    panel.get_by_label("Note").fill("the file is fixed")
    panel.get_by_role("button", name="Requeue").click()

    expect(page.get_by_role("status").filter(has_text="Requeued")).to_be_visible()
    expect(page.locator('[data-field="status"]')).to_have_text("pending")
    expect(panel).to_be_hidden()
    assert history(task.id)[-1] == ("requeued", "root")
    assert TaskEvent.objects.filter(task_id=task.id).latest("id").payload["note"] == (
        "the file is fixed"
    )


def test_the_task_pages_timeline_pages_back_and_only_its_newest_page_grows_live(
    page: Page, person: Any, agent: Any, make_task: Callable[..., Task]
) -> None:
    task = make_task(title="Much discussed")
    for n in range(60):
        transitions.comment(task_id=task.id, actor=agent, body=f"comment {n}")
    log_in(page, person)
    page.goto(f"/tasks/{task.id}/")
    wait_until_live(page)
    timeline = page.locator("[data-timeline] .event")
    expect(timeline).to_have_count(50)
    expect(page.locator('[data-field="event-count"]')).to_have_text("61")

    transitions.comment(task_id=task.id, actor=agent, body="long " + "x" * 5000)
    expect(timeline).to_have_count(51)
    newest = timeline.last
    expect(newest.locator(".comment-body")).to_have_text("long " + "x" * 994 + "…")
    expect(newest.get_by_role("link", name="Show all of this event")).to_have_attribute(
        "href", re.compile(rf"^/tasks/{task.id}/events/\d+/$")
    )
    expect(page.locator('[data-field="event-count"]')).to_have_text("62")

    page.get_by_role("link", name="Older events").first.click()
    wait_until_live(page)
    expect(timeline).to_have_count(11)
    expect(timeline.first.locator(".event-type")).to_have_text("created")
    transitions.comment(task_id=task.id, actor=agent, body="while reading old ones")
    expect(page.locator('[data-field="event-count"]')).to_have_text("63")
    expect(timeline).to_have_count(11)  # an older page stays as it is

    page.get_by_role("link", name="Latest").first.click()
    expect(timeline.last.locator(".comment-body")).to_have_text("while reading old ones")


def stream_once(page: Page, events: list[dict[str, Any]]) -> None:
    """Answer the page's first stream request with ``events`` (then the stream ends, and the
    page reconnects to the real one): an event as another server process may send it."""
    served: list[bool] = []

    def answer(route: Any) -> None:
        if served:
            route.continue_()
            return
        served.append(True)
        body = "".join(
            f"id: {event['id']}\nevent: task_event\ndata: {json.dumps(event)}\n\n"
            for event in events
        )
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=body)

    page.route("**/api/v1/stream/**", answer)


def elided_heartbeat(task: Task, agent: Any) -> dict[str, Any]:
    """A heartbeat event whose task's progress was too large for the stream."""
    data = json.loads(json.dumps(TaskSerializer(task).data, default=str))
    data.update(progress=None, elided=["progress"])
    return {
        "id": 10**9,
        "task_id": task.id,
        "type": "heartbeat",
        "status": "in_progress",
        "actor": agent.username,
        "payload": {"lease_until": data["leased_until"], "progress": None},
        "elided": ["progress"],
        "created_at": timezone.now().isoformat(),
        "task": data,
    }


def test_a_progress_too_large_for_the_stream_is_read_from_the_task_or_said_to_be_large(
    page: Page, person: Any, agent: Any, make_task: Callable[..., Task]
) -> None:
    task = make_task(title="Resize images")
    [claim] = transitions.claim(actor=agent, lease_seconds=600)
    transitions.heartbeat(
        task_id=task.id, actor=agent, lease_token=claim.lease_token, progress={"step": 1}
    )
    log_in(page, person)
    in_progress = card(page, "in_progress", task.id)
    expect(in_progress.locator(".card-progress")).to_have_text('{"step":1}')
    large = {"log": "x" * 20_000}
    transitions.heartbeat(
        task_id=task.id, actor=agent, lease_token=claim.lease_token, progress=large
    )
    event = elided_heartbeat(Task.objects.get(pk=task.id), agent)

    stream_once(page, [event])
    page.reload()
    expect(in_progress.locator(".card-progress")).to_have_text("(progress too large to show here)")

    stream_once(page, [event])
    page.goto(f"/tasks/{task.id}/")
    expect(page.locator('[data-field="progress"]')).to_contain_text('"log": "xxx')
    expect(page.locator(f"#event-{event['id']} .event-data")).to_contain_text(
        "too large to show live"
    )
