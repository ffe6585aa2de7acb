"""The board's HTML pages (board.views): the board, a task's page, the login and the 404s.

What the browser does with them (the live stream, the buttons) is in test_browser.py.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from html.parser import HTMLParser
from typing import Any

import pytest
from django.db import connection, transaction
from django.test import Client

from board import transitions
from board.models import Task, TaskEvent
from board.views import stream_head_id, stream_horizon
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


class BoardParser(HTMLParser):
    """Collect the card ids in each column and the numbers shown as counts."""

    def __init__(self) -> None:
        super().__init__()
        self.columns: dict[str, list[int]] = {}
        self.counts: dict[str, int] = {}
        self._column: str | None = None
        self._count: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if tag == "section" and attributes.get("data-column"):
            self._column = attributes["data-column"]
            self.columns[self._column or ""] = []
        elif tag == "article" and self._column and attributes.get("data-task-id"):
            self.columns[self._column].append(int(attributes["data-task-id"] or 0))
        elif attributes.get("data-count"):
            self._count = attributes["data-count"]

    def handle_data(self, data: str) -> None:
        if self._count:
            self.counts[self._count] = int(data)
            self._count = None


def parse_board(html: str) -> BoardParser:
    parser = BoardParser()
    parser.feed(html)
    return parser


def state_of(html: str) -> dict[str, Any]:
    """Return the JSON the page hands its script (#board-state)."""
    match = re.search(r'<script id="board-state" type="application/json">(.*?)</script>', html)
    assert match, "the page embeds its state"
    return dict(json.loads(match.group(1)))


@pytest.fixture
def person(fast_password_hashing: None) -> Any:
    return UserFactory(username="pat")


@pytest.fixture
def browser(person: Any) -> Client:
    client = Client()
    client.force_login(person)
    return client


@pytest.fixture
def tasks_in_every_status(
    make_task: Callable[..., Task], agent: Any, staff: Any
) -> dict[str, Task]:
    """One task per status, made as in production, through board.transitions."""
    done = make_task(title="ship it", priority=40)
    [claim] = transitions.claim(actor=agent)
    transitions.complete(task_id=done.id, actor=agent, lease_token=claim.lease_token, result={})
    escalated = make_task(title="stuck", priority=30, max_failures=1)
    [claim] = transitions.claim(actor=agent)
    transitions.fail(task_id=escalated.id, actor=agent, lease_token=claim.lease_token, error="no")
    in_progress = make_task(title="busy", priority=20)
    transitions.claim(actor=agent)
    cancelled = make_task(title="never mind")
    transitions.cancel(task_id=cancelled.id, actor=staff)
    pending = make_task(title="waiting")
    return {
        "pending": pending,
        "in_progress": in_progress,
        "escalated": escalated,
        "done": done,
        "cancelled": cancelled,
    }


# -- Login ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/", "/tasks/1/"])
def test_the_board_pages_send_a_visitor_who_is_not_logged_in_to_the_login_page(
    client: Client, path: str
) -> None:
    response = client.get(path)

    assert response.status_code == 302
    assert response["Location"] == f"/accounts/login/?next={path}"


def test_the_login_page_logs_a_person_in_and_sends_them_back_to_the_board(
    client: Client, person: Any
) -> None:
    page = client.get("/accounts/login/?next=/")
    assert page.status_code == 200
    assert b'name="username"' in page.content and b'name="password"' in page.content

    response = client.post(
        "/accounts/login/", {"username": "pat", "password": "secret-password", "next": "/"}
    )

    assert response.status_code == 302
    assert response["Location"] == "/"
    assert client.get("/").status_code == 200


def test_the_login_page_says_when_the_password_is_wrong(client: Client, person: Any) -> None:
    response = client.post("/accounts/login/", {"username": "pat", "password": "nope"})

    assert response.status_code == 200
    assert b'class="form-error"' in response.content


def test_logging_out_ends_the_session(browser: Client) -> None:
    response = browser.post("/accounts/logout/")

    assert response.status_code == 302
    assert browser.get("/").status_code == 302


# -- The board --------------------------------------------------------------------------


def test_the_board_shows_each_task_in_its_status_column_and_the_counts(
    browser: Client, tasks_in_every_status: dict[str, Task]
) -> None:
    tasks = tasks_in_every_status
    response = browser.get("/")

    assert response.status_code == 200
    board = parse_board(response.content.decode())
    assert board.columns == {
        "pending": [tasks["pending"].id],
        "in_progress": [tasks["in_progress"].id],
        "escalated": [tasks["escalated"].id],
        "finished": [tasks["cancelled"].id, tasks["done"].id],  # the latest first
    }
    assert board.counts == {
        "pending": 1,
        "in_progress": 1,
        "escalated": 1,
        "done": 1,
        "cancelled": 1,
    }
    html = response.content.decode()
    assert "agent-smith" in html, "the holder is on the in-progress card"
    assert 'class="lease" data-until="' in html


def test_the_board_orders_pending_tasks_as_a_claim_would(
    browser: Client, make_task: Callable[..., Task]
) -> None:
    low = make_task(title="low", priority=-1)
    first = make_task(title="first", priority=5)
    second = make_task(title="second", priority=5)

    board = parse_board(browser.get("/").content.decode())

    assert board.columns["pending"] == [first.id, second.id, low.id]


def test_the_board_shows_only_the_latest_finished_tasks(
    browser: Client, make_task: Callable[..., Task], staff: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("board.views.FINISHED_LIMIT", 2)
    cancelled = [make_task(title=f"old {n}") for n in range(3)]
    for task in cancelled:
        transitions.cancel(task_id=task.id, actor=staff)

    board = parse_board(browser.get("/").content.decode())

    assert board.columns["finished"] == [cancelled[2].id, cancelled[1].id]
    assert board.counts["cancelled"] == 3


def test_the_board_hands_its_script_the_cards_the_counts_and_where_to_resume_the_stream(
    browser: Client, tasks_in_every_status: dict[str, Task], person: Any
) -> None:
    state = state_of(browser.get("/").content.decode())

    assert state["page"] == "board"
    assert state["user"] == person.username
    assert state["queue"] is None
    assert state["counts"]["pending"] == 1
    assert {task["id"] for task in state["tasks"]} == {
        task.id for task in tasks_in_every_status.values()
    }
    assert "payload" not in state["tasks"][0], "cards leave the task's data to its page"
    assert isinstance(state["resume_id"], int)
    assert isinstance(state["skip"], list)


@pytest.mark.django_db(transaction=True)
def test_the_resume_id_is_the_last_event_committed_before_the_page_was_drawn(
    fast_password_hashing: None, agent: Any
) -> None:
    client = Client()
    client.force_login(UserFactory(username="pat"))
    assert state_of(client.get("/").content.decode())["resume_id"] == 0, "an empty log"
    transitions.create(actor=agent, title="one")
    latest = transitions.create(actor=agent, title="two")

    state = state_of(client.get("/").content.decode())

    assert state["resume_id"] == TaskEvent.objects.get(task=latest).id
    assert state["skip"] == []
    assert stream_head_id(stream_horizon()) == state["resume_id"]


@pytest.mark.django_db(transaction=True)
def test_events_the_page_shows_but_the_stream_will_send_again_are_listed_to_skip(
    fast_password_hashing: None, agent: Any
) -> None:
    """An open transaction holds the stream's stable prefix back: an event committed after
    it began is on the page, and the stream (resumed before it) will deliver it again."""
    client = Client()
    client.force_login(UserFactory(username="pat"))
    before = transitions.create(actor=agent, title="before")
    inserted, release = threading.Event(), threading.Event()

    def open_transaction() -> None:
        try:
            with transaction.atomic():
                transitions.create(actor=agent, title="uncommitted")
                inserted.set()
                release.wait(10)
        finally:
            connection.close()

    thread = threading.Thread(target=open_transaction)
    thread.start()
    try:
        assert inserted.wait(10)
        after = transitions.create(actor=agent, title="committed while it was open")
        html = client.get("/").content.decode()
    finally:
        release.set()
        thread.join(10)

    state = state_of(html)
    assert state["resume_id"] == TaskEvent.objects.get(task=before).id
    assert state["skip"] == [TaskEvent.objects.get(task=after).id]
    assert after.id in parse_board(html).columns["pending"]


def test_the_queue_filter_shows_only_that_queues_tasks_and_counts(
    browser: Client, make_task: Callable[..., Task]
) -> None:
    mail = make_task(title="send", queue="mail")
    make_task(title="resize", queue="images")
    make_task(title="crop", queue="images")

    response = browser.get("/", {"queue": "mail"})

    board = parse_board(response.content.decode())
    assert board.columns["pending"] == [mail.id]
    assert board.counts["pending"] == 1
    assert state_of(response.content.decode())["queue"] == "mail"
    html = response.content.decode()
    assert '<option value="mail" selected>mail</option>' in html
    assert '<option value="images">images</option>' in html
    assert "Claim next in mail" in html


def test_a_queue_filter_that_is_no_queue_name_shows_every_queue(
    browser: Client, make_task: Callable[..., Task]
) -> None:
    make_task(queue="mail")
    make_task(queue="images")

    response = browser.get("/", {"queue": "NOT A QUEUE"})

    assert response.status_code == 200
    assert parse_board(response.content.decode()).counts["pending"] == 2


def test_the_board_escapes_what_people_and_agents_write(
    browser: Client, make_task: Callable[..., Task]
) -> None:
    make_task(title="<script>alert('title')</script>")

    html = browser.get("/").content.decode()

    assert "<script>alert" not in html
    assert "&lt;script&gt;alert" in html
    state = state_of(html)  # json_script escapes <, > and & inside the JSON too
    assert state["tasks"][0]["title"] == "<script>alert('title')</script>"


# -- A task's page ----------------------------------------------------------------------


def test_the_task_page_shows_the_task_its_payload_its_result_and_its_timeline_oldest_first(
    browser: Client, make_task: Callable[..., Task], agent: Any
) -> None:
    task = make_task(title="resize images", payload={"bucket": "in", "sizes": [64, 128]})
    [claim] = transitions.claim(actor=agent)
    transitions.heartbeat(task_id=task.id, actor=agent, lease_token=claim.lease_token)
    transitions.complete(
        task_id=task.id, actor=agent, lease_token=claim.lease_token, result={"resized": 12}
    )

    response = browser.get(f"/tasks/{task.id}/")

    assert response.status_code == 200
    html = response.content.decode()
    assert "<h1>resize images</h1>" in html
    assert "&quot;bucket&quot;: &quot;in&quot;" in html, "the payload as pretty JSON"
    assert "&quot;resized&quot;: 12" in html, "the result as pretty JSON"
    types = re.findall(r'<span class="event-type">(\w+)</span>', html)
    assert types == ["created", "claimed", "heartbeat", "completed"]
    ids = [int(n) for n in re.findall(r'data-event-id="(\d+)"', html)]
    assert ids == list(
        TaskEvent.objects.filter(task=task).order_by("id").values_list("id", flat=True)
    )
    state = state_of(html)
    assert state["page"] == "task"
    assert state["task"]["id"] == task.id
    assert state["task"]["result"] == {"resized": 12}
    assert isinstance(state["resume_id"], int)


def test_the_task_page_of_a_task_in_progress_shows_its_holder_and_lease(
    browser: Client, make_task: Callable[..., Task], agent: Any
) -> None:
    task = make_task(title="busy")
    transitions.claim(actor=agent, lease_seconds=300)

    html = browser.get(f"/tasks/{task.id}/").content.decode()

    assert '<b data-field="holder">agent-smith</b>' in html
    assert "left</span>" in html


def test_a_missing_task_page_is_an_html_404(browser: Client) -> None:
    response = browser.get("/tasks/999999/")

    assert response.status_code == 404
    assert response["Content-Type"].startswith("text/html")
    assert b"Nothing here" in response.content


def test_a_task_id_too_long_for_the_database_is_a_404_too(browser: Client) -> None:
    assert browser.get("/tasks/" + "9" * 30 + "/").status_code == 404


def test_an_unknown_page_is_an_html_404_even_when_not_logged_in(client: Client) -> None:
    response = client.get("/no/such/page/")

    assert response.status_code == 404
    assert response["Content-Type"].startswith("text/html")


@pytest.mark.parametrize("path", ["/api/v1/tasks/999999/", "/api/v1/no-such-thing/", "/api/nope"])
def test_the_api_keeps_its_json_404(browser: Client, path: str) -> None:
    response = browser.get(path)

    assert response.status_code == 404
    assert response["Content-Type"] == "application/json"
    assert response.json()["error"] == "not_found"


def test_healthz_below_is_a_json_404(client: Client) -> None:
    response = client.get("/healthz/extra")

    assert response.status_code == 404
    assert response.json()["error"] == "not_found"


def test_the_pages_load_their_stylesheet_and_script_from_static_files(browser: Client) -> None:
    html = browser.get("/").content.decode()

    assert '<link rel="stylesheet" href="/static/board/board.css">' in html
    assert '<script src="/static/board/board.js" defer></script>' in html
    assert "<style>" not in html
