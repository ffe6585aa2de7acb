"""The board's HTML pages (board.pages.views): the board with its queues and agents panels, a
task's page with its work graph and comment form, pausing a queue, the login and the 404s.

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
from board.access import limit_queues
from board.live.relay import head_below_horizon, run_on_django
from board.models import QueuePause, QueueState, Task, TaskEvent
from tests.factories import StaffFactory, UserFactory, grant

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
    return UserFactory.create(username="pat")


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
    monkeypatch.setattr("board.pages.views.FINISHED_LIMIT", 2)
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
    client.force_login(UserFactory.create(username="pat"))
    assert state_of(client.get("/").content.decode())["resume_id"] == 0, "an empty log"
    transitions.create(actor=agent, title="one")
    latest = transitions.create(actor=agent, title="two")

    state = state_of(client.get("/").content.decode())

    assert state["resume_id"] == TaskEvent.objects.get(task=latest).id
    assert state["skip"] == []
    assert run_on_django(head_below_horizon())[1].id == state["resume_id"]


@pytest.mark.django_db(transaction=True)
def test_events_the_page_shows_but_the_stream_will_send_again_are_listed_to_skip(
    fast_password_hashing: None, agent: Any
) -> None:
    """An open transaction holds the stream's stable prefix back: an event committed after
    it began is on the page, and the stream (resumed before it) will deliver it again."""
    client = Client()
    client.force_login(UserFactory.create(username="pat"))
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


def test_the_task_page_shows_consecutive_heartbeats_of_one_holder_as_one_entry(
    browser: Client, make_task: Callable[..., Task], agent: Any, other_agent: Any
) -> None:
    task = make_task(title="long job")
    [claim] = transitions.claim(actor=agent)
    for n in range(12):
        transitions.heartbeat(
            task_id=task.id, actor=agent, lease_token=claim.lease_token, progress={"done": n}
        )
    transitions.comment(task_id=task.id, actor=agent, body="slow going")
    transitions.heartbeat(task_id=task.id, actor=agent, lease_token=claim.lease_token)
    transitions.release(task_id=task.id, actor=agent, lease_token=claim.lease_token)
    [claim] = transitions.claim(actor=other_agent)
    for _ in range(2):
        transitions.heartbeat(task_id=task.id, actor=other_agent, lease_token=claim.lease_token)

    html = browser.get(f"/tasks/{task.id}/").content.decode()

    types = re.findall(r'<span class="event-type">([^<]+)</span>', html)
    assert types == [
        "created", "claimed", "12 heartbeats", "commented", "heartbeat", "released", "claimed",
        "2 heartbeats",
    ]  # fmt: skip
    heartbeats = TaskEvent.objects.filter(task=task, type="heartbeat").order_by("id")
    beats = [str(id_) for id_ in heartbeats.values_list("id", flat=True)]
    run = (
        f'data-event-id="{beats[11]}" data-actor="agent-smith" '
        f'data-event-ids="{" ".join(beats[:12])}"'
    )
    assert run in html, "the run is the last heartbeat's entry, and names every event in it"
    assert "{&quot;done&quot;: 11}" in html, "with the last heartbeat's progress"
    assert "{&quot;done&quot;: 10}" not in html
    count = re.search(r'data-field="event-count">(\d+)<', html)
    assert count and int(count.group(1)) == TaskEvent.objects.filter(task=task).count() == 20


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


# -- Blocked tasks on the board ---------------------------------------------------------


def card_html(html: str, task_id: int) -> str:
    """Return the markup of the board's card for ``task_id``."""
    match = re.search(rf'<article class="[^"]*" data-task-id="{task_id}">.*?</article>', html, re.S)
    assert match, f"a card for #{task_id}"
    return match.group(0)


def test_a_blocked_task_says_it_is_blocked_and_links_what_it_waits_for_with_its_status(
    browser: Client, make_task: Callable[..., Task], agent: Any
) -> None:
    first = make_task(title="fetch")
    second = make_task(title="parse")
    after_both = make_task(title="report", depends_on=[first.id, second.id])
    transitions.claim(actor=agent)  # takes "fetch"

    html = browser.get("/").content.decode()

    blocked = card_html(html, after_both.id)
    assert "chip-blocked" in blocked
    assert f'<a class="blocker" href="/tasks/{first.id}/">#{first.id}</a>' in blocked
    assert '<span class="badge badge-in_progress">in progress</span>' in blocked
    assert f'href="/tasks/{second.id}/"' in blocked
    assert "chip-blocked" not in card_html(html, second.id)
    state = state_of(html)
    card = next(task for task in state["tasks"] if task["id"] == after_both.id)
    assert (card["blocked"], card["depends_on"]) == (True, [first.id, second.id])
    assert state["dependencies"][str(first.id)]["status"] == "in_progress"
    assert state["dependencies"][str(second.id)]["status"] == "pending"


def test_a_dependency_that_is_done_no_longer_shows_among_what_a_task_waits_for(
    browser: Client, make_task: Callable[..., Task], agent: Any
) -> None:
    first, second = make_task(title="fetch"), make_task(title="parse")
    last = make_task(title="report", depends_on=[first.id, second.id])
    [claim] = transitions.claim(actor=agent)
    transitions.complete(task_id=first.id, actor=agent, lease_token=claim.lease_token)

    blocked = card_html(browser.get("/").content.decode(), last.id)

    assert f'href="/tasks/{second.id}/"' in blocked
    assert f'href="/tasks/{first.id}/"' not in blocked


@pytest.mark.parametrize("outcome", ["cancelled", "escalated"])
def test_the_dependents_of_a_cancelled_or_escalated_task_stay_blocked_and_say_by_what(
    browser: Client, make_task: Callable[..., Task], agent: Any, staff: Any, outcome: str
) -> None:
    first = make_task(title="fetch", max_failures=1)
    dependent = make_task(title="parse", depends_on=[first.id])
    if outcome == "cancelled":
        transitions.cancel(task_id=first.id, actor=staff)
    else:
        [claim] = transitions.claim(actor=agent)
        transitions.fail(task_id=first.id, actor=agent, lease_token=claim.lease_token, error="x")

    blocked = card_html(browser.get("/").content.decode(), dependent.id)

    assert "chip-blocked" in blocked
    assert f'href="/tasks/{first.id}/"' in blocked
    assert f'<span class="badge badge-{outcome}">{outcome}</span>' in blocked


# -- The queues and agents panels -------------------------------------------------------


def queue_row(html: str, name: str) -> str:
    match = re.search(rf'<tr data-queue="{name}"[^>]*>.*?</tr>', html, re.S)
    assert match, f"a row for queue {name}"
    return match.group(0)


def numbers(row: str) -> dict[str, int]:
    return {key: int(n) for key, n in re.findall(r'data-n="(\w+)">(\d+)<', row)}


@pytest.fixture
def pauser(db: None) -> Any:
    """Staff, who may pause and resume queues."""
    return StaffFactory.create(username="ops-pat")


def logged_in(user: Any) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_the_queues_panel_shows_each_queues_counts_and_whether_it_is_paused(
    browser: Client, make_task: Callable[..., Task], agent: Any, pauser: Any
) -> None:
    first = make_task(queue="mail")
    make_task(queue="mail", depends_on=[first.id])
    make_task(queue="mail")
    make_task(queue="images")
    transitions.claim(actor=agent, queues=["images"])
    transitions.pause_queue(queue="images", actor=pauser, note="disk full")

    html = browser.get("/").content.decode()

    assert numbers(queue_row(html, "mail")) == {
        "pending": 2,
        "blocked": 1,
        "in_progress": 0,
        "escalated": 0,
        "done": 0,
        "cancelled": 0,
    }
    images = queue_row(html, "images")
    assert numbers(images)["in_progress"] == 1
    assert "badge-paused" in images
    assert "badge-paused" not in queue_row(html, "mail")
    state = state_of(html)
    assert [queue["name"] for queue in state["queues"]] == ["images", "mail"]
    assert state["can_pause"] is False
    assert "pause-form" not in html, "no buttons for someone who may not pause"


def test_staff_get_a_pause_button_per_running_queue_and_resume_per_paused(
    make_task: Callable[..., Task], pauser: Any
) -> None:
    make_task(queue="mail")
    make_task(queue="images")
    transitions.pause_queue(queue="images", actor=pauser)

    html = logged_in(pauser).get("/?queue=mail").content.decode()

    mail, images = queue_row(html, "mail"), queue_row(html, "images")
    assert 'action="/queues/mail/pause/"' in mail and 'aria-label="Pause mail">Pause<' in mail
    assert 'action="/queues/images/resume/"' in images
    assert 'aria-label="Resume images">Resume<' in images
    assert 'name="csrfmiddlewaretoken"' in mail
    assert '<input type="hidden" name="next" value="/?queue=mail">' in mail
    assert state_of(html)["can_pause"] is True


def test_pausing_a_queue_on_the_board_records_who_and_why_and_goes_back(
    make_task: Callable[..., Task], pauser: Any, agent: Any
) -> None:
    make_task(queue="mail")
    client = logged_in(pauser)

    response = client.post(
        "/queues/mail/pause/", {"note": "the SMTP relay is down", "next": "/?queue=mail"}
    )

    assert response.status_code == 302
    assert response["Location"] == "/?queue=mail"
    state = QueueState.objects.get(name="mail")
    assert (state.paused, state.changed_by, state.note) == (
        True,
        "ops-pat",
        "the SMTP relay is down",
    )
    assert list(QueuePause.objects.values_list("queue", "paused", "actor", "note")) == [
        ("mail", True, "ops-pat", "the SMTP relay is down")
    ]
    assert transitions.claim(actor=agent, queues=["mail"]) == [], "a paused queue hands out nothing"
    page = client.get("/?queue=mail").content.decode()
    assert "Paused mail" in page, "the page says what happened"

    resumed = client.post("/queues/mail/resume/", {"note": ""})

    assert resumed.status_code == 302
    assert resumed["Location"] == "/"
    assert QueueState.objects.get(name="mail").paused is False
    assert QueuePause.objects.order_by("id").last().note == ""  # type: ignore[union-attr]
    assert len(transitions.claim(actor=agent, queues=["mail"])) == 1


def test_the_pause_form_never_sends_a_person_to_another_site(
    make_task: Callable[..., Task], pauser: Any
) -> None:
    make_task(queue="mail")

    response = logged_in(pauser).post("/queues/mail/pause/", {"next": "https://evil.example/"})

    assert response["Location"] == "/"


@pytest.mark.parametrize("verb", ["pause", "resume"])
def test_only_staff_pause_or_resume_a_queue(
    make_task: Callable[..., Task], pauser: Any, verb: str
) -> None:
    make_task(queue="mail")
    if verb == "resume":
        transitions.pause_queue(queue="mail", actor=pauser)
    before = list(QueuePause.objects.values_list("id", flat=True))
    user = UserFactory.create(username="pat")

    response = logged_in(user).post(f"/queues/mail/{verb}/", {"note": "let me"})

    assert response.status_code == 403
    assert list(QueuePause.objects.values_list("id", flat=True)) == before
    assert QueueState.objects.filter(name="mail", paused=True).exists() == (verb == "resume")


def test_pausing_is_a_post(pauser: Any, make_task: Callable[..., Task]) -> None:
    make_task(queue="mail")

    assert logged_in(pauser).get("/queues/mail/pause/").status_code == 405
    assert not QueueState.objects.exists()


def test_pausing_needs_the_csrf_token(pauser: Any, make_task: Callable[..., Task]) -> None:
    make_task(queue="mail")
    client = Client(enforce_csrf_checks=True)
    client.force_login(pauser)

    assert client.post("/queues/mail/pause/").status_code == 403
    assert not QueueState.objects.exists()


def test_staff_limited_to_queues_see_and_pause_only_their_queues(
    make_task: Callable[..., Task], pauser: Any, agent: Any, other_agent: Any
) -> None:
    theirs = make_task(queue="theirs")
    make_task(queue="ours")
    transitions.claim(actor=agent, queues=["ours"])
    transitions.claim(actor=other_agent, queues=["theirs"])
    limit_queues(pauser, ["ours"])
    client = logged_in(pauser)

    html = client.get("/").content.decode()
    refused = client.post("/queues/theirs/pause/")

    state = state_of(html)
    assert [queue["name"] for queue in state["queues"]] == ["ours"]
    assert 'data-queue="theirs"' not in html
    # A user limited to queues sees only itself among the agents (board.queues.agent_list).
    assert state["agents"] == []
    assert f"#{theirs.id}" not in html
    assert refused.status_code == 403
    assert not QueueState.objects.filter(name="theirs").exists()


def test_the_agents_panel_shows_what_each_agent_holds_and_when_it_was_last_seen(
    browser: Client, make_task: Callable[..., Task], agent: Any, other_agent: Any
) -> None:
    held = make_task(title="busy", queue="a")
    finished = make_task(title="quick", queue="b")
    transitions.claim(actor=agent, queues=["a"])
    [claim] = transitions.claim(actor=other_agent, queues=["b"])
    transitions.complete(task_id=finished.id, actor=other_agent, lease_token=claim.lease_token)

    html = browser.get("/").content.decode()

    rows = re.findall(r'<tr data-agent="([^"]+)">(.*?)</tr>', html, re.S)
    assert [name for name, _ in rows] == ["agent-smith", "agent-jones"], "holders first"
    smith, jones = (row for _, row in rows)
    assert f'<a href="/tasks/{held.id}/">#{held.id}</a>' in smith
    assert re.search(r'<time class="ago" datetime="[^"]+">', smith), "last seen, for the script"
    assert "nothing" in jones
    assert "1 · 0 · 0" in jones, "completed, failed, expired in 24 hours"


# -- A task's work graph, progress and deadline -----------------------------------------


def related_ids(html: str, relation: str) -> list[int]:
    match = re.search(rf'data-relation="{relation}">(.*?)</(ul|dd)>', html, re.S)
    assert match, f"the {relation} list"
    return [int(n) for n in re.findall(r'data-related-id="(\d+)"', match.group(1))]


def test_the_task_page_shows_the_parent_children_with_progress_dependencies_and_dependents(
    browser: Client, make_task: Callable[..., Task], agent: Any
) -> None:
    before = make_task(title="download")
    plan = make_task(title="plan", depends_on=[before.id])
    after = make_task(title="publish", depends_on=[plan.id])
    [claim] = transitions.claim(actor=agent)  # "download"
    transitions.complete(task_id=before.id, actor=agent, lease_token=claim.lease_token)
    [claim] = transitions.claim(actor=agent)  # "plan"
    child = transitions.create(actor=agent, title="part one", parent_id=plan.id)
    other_child = transitions.create(actor=agent, title="part two", parent_id=plan.id)
    [child_claim] = transitions.claim(actor=UserFactory.create(username="agent-kim"))
    assert child_claim.task.pk == child.pk
    transitions.heartbeat(
        task_id=child.pk,
        actor="agent-kim",
        lease_token=child_claim.lease_token,
        progress={"pages": 3, "of": 10},
    )

    html = browser.get(f"/tasks/{plan.id}/").content.decode()

    assert related_ids(html, "dependencies") == [before.id]
    assert related_ids(html, "dependents") == [after.id]
    assert related_ids(html, "children") == [child.pk, other_child.pk]
    children = re.search(r'data-relation="children">(.*?)</ul>', html, re.S)
    assert children is not None
    assert "badge-in_progress" in children.group(1) and "badge-pending" in children.group(1)
    assert "{&quot;of&quot;: 10, &quot;pages&quot;: 3}" in children.group(1), "a child's progress"
    dependents = re.search(r'data-relation="dependents">(.*?)</ul>', html, re.S)
    assert dependents is not None and "badge-blocked" in dependents.group(1)
    relations = state_of(html)["relations"]
    assert relations["children"][0]["progress"] == {"pages": 3, "of": 10}
    assert relations["dependents"][0]["blocked"] is True

    board = browser.get("/").content.decode()
    assert f'<a class="chip chip-parent" href="/tasks/{plan.id}/"' in card_html(board, child.pk)
    assert "chip-parent" not in card_html(board, after.id)
    child_page = browser.get(f"/tasks/{child.pk}/").content.decode()
    assert re.search(r'data-relation="parent">.*?data-related-id="(\d+)"', child_page, re.S)[
        1
    ] == str(plan.id)  # type: ignore[index]


def test_the_task_page_shows_the_progress_json_and_the_attempt_deadline_beside_the_lease(
    browser: Client, make_task: Callable[..., Task], agent: Any
) -> None:
    task = make_task(title="crawl", max_attempt_seconds=600)
    [claim] = transitions.claim(actor=agent, lease_seconds=60)
    transitions.heartbeat(
        task_id=task.id, actor=agent, lease_token=claim.lease_token, progress={"done": 7}
    )
    held = Task.objects.get(pk=task.id)
    assert held.attempt_deadline is not None

    html = browser.get(f"/tasks/{task.id}/").content.decode()

    assert re.search(
        r'<pre class="json" data-field="progress">\{\n  &quot;done&quot;: 7\n\}</pre>', html
    )
    lease = re.search(r'<div class="holder-line">(.*?)</div>', html, re.S)
    assert lease is not None
    assert f'data-deadline="{held.attempt_deadline.isoformat()}"' in lease.group(1)
    assert "600 s per attempt" in html
    assert state_of(html)["task"]["max_attempt_seconds"] == 600


def test_the_task_page_without_progress_or_deadline_says_so(
    browser: Client, make_task: Callable[..., Task]
) -> None:
    html = browser.get(f"/tasks/{make_task().id}/").content.decode()

    assert '<p class="muted" data-field="no-progress">No progress reported.</p>' in html
    assert re.search(r'data-field="deadline"[^>]* hidden>', html), "no deadline to show"
    assert re.search(r'data-field="blocked"[^>]* hidden>', html), "not blocked"


def test_a_dependency_in_a_queue_the_user_cannot_see_is_shown_by_id_only(
    make_task: Callable[..., Task],
) -> None:
    secret = make_task(title="secret thing", queue="theirs")
    ours = make_task(title="ours", queue="ours", depends_on=[secret.id])
    user = UserFactory.create(username="pat")
    limit_queues(user, ["ours"])

    html = logged_in(user).get(f"/tasks/{ours.id}/").content.decode()

    assert related_ids(html, "dependencies") == [secret.id]
    assert "secret thing" not in html
    assert "a queue you cannot see" in html


# -- Comments ---------------------------------------------------------------------------


def test_a_person_comments_on_a_task_and_the_comment_is_in_its_timeline(
    browser: Client, make_task: Callable[..., Task], agent: Any
) -> None:
    task = make_task(title="review")
    transitions.claim(actor=agent)

    response = browser.post(f"/tasks/{task.id}/comments/", {"body": "Looks <b>good</b>, ship it"})

    event = TaskEvent.objects.filter(task=task).latest("id")
    assert (event.type, event.actor, event.status, event.payload) == (
        "commented",
        "pat",
        "in_progress",
        {"body": "Looks <b>good</b>, ship it"},
    )
    assert response.status_code == 302
    assert response["Location"] == f"/tasks/{task.id}/#event-{event.id}"
    html = browser.get(f"/tasks/{task.id}/").content.decode()
    assert re.findall(r'<span class="event-type">(\w+)</span>', html) == [
        "created",
        "claimed",
        "commented",
    ]
    assert f'id="event-{event.id}"' in html
    assert '<p class="comment-body">Looks &lt;b&gt;good&lt;/b&gt;, ship it</p>' in html
    assert Task.objects.get(pk=task.id).status == "in_progress", "a comment changes nothing else"


@pytest.mark.parametrize("body", ["", "   \n  "])
def test_a_blank_comment_is_refused_with_a_clear_error_and_records_nothing(
    browser: Client, make_task: Callable[..., Task], body: str
) -> None:
    task = make_task()

    response = browser.post(f"/tasks/{task.id}/comments/", {"body": body})

    assert response.status_code == 400
    html = response.content.decode()
    assert "The comment is empty: write something to post." in html
    assert 'aria-invalid="true"' in html
    assert "<h1>" in html, "the task's page again, with the error"
    assert list(TaskEvent.objects.filter(task=task).values_list("type", flat=True)) == ["created"]


def test_a_comment_too_long_is_refused_and_kept_in_the_form(
    browser: Client, make_task: Callable[..., Task]
) -> None:
    task = make_task()

    response = browser.post(f"/tasks/{task.id}/comments/", {"body": "x" * 10001})

    assert response.status_code == 400
    assert "at most 10000 characters" in response.content.decode()
    assert TaskEvent.objects.filter(task=task, type="commented").count() == 0


def test_commenting_needs_the_csrf_token_and_a_login(make_task: Callable[..., Task]) -> None:
    task = make_task()
    guarded = Client(enforce_csrf_checks=True)
    guarded.force_login(UserFactory.create(username="pat"))

    assert guarded.post(f"/tasks/{task.id}/comments/", {"body": "hi"}).status_code == 403
    anonymous = Client().post(f"/tasks/{task.id}/comments/", {"body": "hi"})
    assert anonymous.status_code == 302
    assert anonymous["Location"].startswith("/accounts/login/")
    assert TaskEvent.objects.filter(task=task, type="commented").count() == 0


def test_a_user_cannot_comment_on_a_task_of_a_queue_it_may_not_see(
    make_task: Callable[..., Task],
) -> None:
    theirs = make_task(queue="theirs")
    user = UserFactory.create(username="pat")
    limit_queues(user, ["ours"])

    response = logged_in(user).post(f"/tasks/{theirs.id}/comments/", {"body": "hi"})

    assert response.status_code == 404
    assert TaskEvent.objects.filter(task=theirs, type="commented").count() == 0


def test_commenting_on_a_missing_task_is_a_404_and_a_get_is_refused(
    browser: Client, make_task: Callable[..., Task]
) -> None:
    assert browser.post("/tasks/999999/comments/", {"body": "hi"}).status_code == 404
    assert browser.get(f"/tasks/{make_task().id}/comments/").status_code == 405


# -- Triage of an escalated task ------------------------------------------------------------


@pytest.fixture
def escalated_task(make_task: Callable[..., Task], agent: Any) -> Task:
    task = make_task(title="stuck import", queue="imports", max_failures=1)
    [claim] = transitions.claim(actor=agent, queues=["imports"])
    return transitions.fail(
        task_id=task.id, actor=agent, lease_token=claim.lease_token, error="bad file"
    )


@pytest.fixture
def triager(db: None) -> Any:
    return grant(StaffFactory.create(username="ops-alice"), "escalations.triage_task")


def triage_panel(html: str) -> str:
    match = re.search(r'<section class="panel triage-panel".*?</section>', html, re.S)
    return match.group(0) if match else ""


def test_a_triager_sees_requeue_resolve_cancel_and_the_queue_link_on_an_escalated_task(
    triager: Any, escalated_task: Task
) -> None:
    html = logged_in(triager).get(f"/tasks/{escalated_task.id}/").content.decode()

    panel = triage_panel(html)
    assert panel, "the page offers triage"
    assert " hidden" not in panel.split(">", 1)[0]
    for name in ("requeue", "resolve", "cancel"):
        assert f'formaction="/tasks/{escalated_task.id}/{name}/"' in panel
    assert 'href="/admin/escalations/escalatedtask/"' in panel


@pytest.mark.parametrize(
    ("name", "fields", "status", "event"),
    [
        ("requeue", {"note": "the file is fixed"}, "pending", "requeued"),
        ("resolve", {"note": "fixed by hand", "result": '{"rows": 3}'}, "done", "resolved"),
        ("cancel", {"note": "not needed"}, "cancelled", "cancelled"),
    ],
)
def test_a_triager_requeues_resolves_or_cancels_an_escalated_task_from_its_page(
    triager: Any,
    escalated_task: Task,
    name: str,
    fields: dict[str, str],
    status: str,
    event: str,
) -> None:
    client = logged_in(triager)

    response = client.post(f"/tasks/{escalated_task.id}/{name}/", fields)

    assert response.status_code == 302
    assert response["Location"] == f"/tasks/{escalated_task.id}/"
    task = Task.objects.get(pk=escalated_task.id)
    assert task.status == status
    last = TaskEvent.objects.filter(task=task).latest("id")
    assert (last.type, last.actor, last.payload["note"]) == (event, "ops-alice", fields["note"])
    if name == "resolve":
        assert task.result == {"rows": 3}
    page = client.get(response["Location"]).content.decode()
    assert "triage-panel" in page
    assert " hidden" in triage_panel(page).split(">", 1)[0], "no longer escalated"


def test_a_resolve_without_a_note_is_refused_on_the_page_and_changes_nothing(
    triager: Any, escalated_task: Task
) -> None:
    response = logged_in(triager).post(f"/tasks/{escalated_task.id}/resolve/", {"note": ""})

    assert response.status_code == 400
    assert 'role="alert"' in triage_panel(response.content.decode())
    assert Task.objects.get(pk=escalated_task.id).status == "escalated"


def test_triage_of_a_task_no_longer_escalated_says_so_and_changes_nothing(
    triager: Any, escalated_task: Task, staff: Any
) -> None:
    transitions.resolve(task_id=escalated_task.id, actor=staff, note="done elsewhere")
    client = logged_in(triager)

    response = client.post(f"/tasks/{escalated_task.id}/requeue/", {"note": ""}, follow=True)

    assert Task.objects.get(pk=escalated_task.id).status == "done"
    assert f"Cannot requeue task {escalated_task.id}: it is done" in response.content.decode()
    assert TaskEvent.objects.filter(task_id=escalated_task.id).latest("id").type == "resolved"


@pytest.mark.parametrize("who", ["staff", "agent"])
def test_who_may_not_triage_sees_no_triage_and_is_refused_a_post(
    who: str, escalated_task: Task, staff: Any, agent: Any
) -> None:
    client = logged_in({"staff": staff, "agent": agent}[who])

    html = client.get(f"/tasks/{escalated_task.id}/").content.decode()

    assert "triage-panel" not in html
    assert "/admin/escalations/" not in html
    for name in ("requeue", "resolve", "cancel"):
        response = client.post(f"/tasks/{escalated_task.id}/{name}/", {"note": "x"})
        assert response.status_code == 403
    assert Task.objects.get(pk=escalated_task.id).status == "escalated"


def test_a_triager_limited_to_other_queues_cannot_triage_the_task(
    triager: Any, escalated_task: Task
) -> None:
    limit_queues(triager, ["ours"])

    response = logged_in(triager).post(f"/tasks/{escalated_task.id}/requeue/", {"note": ""})

    assert response.status_code == 404
    assert Task.objects.get(pk=escalated_task.id).status == "escalated"


# -- What a card shows: progress and comments -------------------------------------------


def test_an_in_progress_card_shows_the_latest_progress_as_text_and_cards_count_comments(
    browser: Client, make_task: Callable[..., Task], agent: Any
) -> None:
    busy = make_task(title="busy", priority=2)
    talked_about = make_task(title="waiting")
    [claim] = transitions.claim(actor=agent)
    progress = {"step": 2, "of": 5, "note": "x" * 500}
    transitions.heartbeat(
        task_id=busy.id, actor=agent, lease_token=claim.lease_token, progress=progress
    )
    for body in ("why is this waiting?", "because"):
        transitions.comment(task_id=talked_about.id, actor=agent, body=body)
    transitions.comment(task_id=busy.id, actor=agent, body="on it")

    html = browser.get("/").content.decode()

    busy_card = card_html(html, busy.id)
    shown = re.search(r'<p class="card-progress"[^>]*>(.*?)</p>', busy_card)
    assert shown, "the in-progress card shows its progress"
    assert shown.group(1).startswith("{&quot;note&quot;:&quot;xxx")
    assert len(shown.group(1).replace("&quot;", '"')) == 120, "only its start"
    assert "1 comment<" in busy_card
    assert "2 comments<" in card_html(html, talked_about.id)
    cards = {task["id"]: task for task in state_of(html)["tasks"]}
    assert cards[busy.id]["progress_text"].startswith('{"note":"xxx')
    assert "progress" not in cards[busy.id], "not the progress itself"
    assert (cards[busy.id]["comments"], cards[talked_about.id]["comments"]) == (1, 2)


def test_a_card_without_progress_or_comments_shows_neither(
    browser: Client, make_task: Callable[..., Task], agent: Any
) -> None:
    task = make_task(title="fresh")
    transitions.claim(actor=agent)

    card = card_html(browser.get("/").content.decode(), task.id)

    assert "card-progress" not in card
    assert "chip-comments" not in card


# -- Bounded pages: however many queues, comments and events -----------------------------


@pytest.mark.slow
@pytest.mark.once
def test_the_board_shows_at_most_50_queues_and_stays_small_with_2000(
    browser: Client, make_task: Callable[..., Task], agent: Any, staff: Any
) -> None:
    for n in range(2000):
        make_task(title=f"t{n}", queue=f"queue-{n:04d}")
    busiest = [make_task(queue="queue-1999") for _ in range(3)]
    transitions.pause_queue(queue="queue-0007", actor=staff)

    response = browser.get("/")

    html = response.content.decode()
    # The 200 pending cards it shows take most of it; each queue row took about 1.2 KB.
    assert len(response.content) < 300_000, f"{len(response.content)} bytes"
    rows = re.findall(r'<tr data-queue="([^"]+)"', html)
    assert len(rows) == 50
    assert rows[:2] == ["queue-0007", "queue-1999"], "paused first, then the busiest"
    assert "Showing 50 of 2000 queues" in html
    assert len(re.findall(r"<option value=", html)) == 51, "All queues, and the panel's"
    assert len(state_of(html)["queues"]) == 50
    assert state_of(html)["queues_in_all"] == 2000
    filtered = browser.get("/?queue=queue-1234").content.decode()
    assert '<option value="queue-1234" selected>' in filtered
    assert len(busiest) == 3

    panels = browser.get("/panels/")
    assert len(panels.content) < 40_000, f"{len(panels.content)} bytes"
    data = panels.json()
    assert (len(data["queues"]), data["queues_in_all"]) == (50, 2000)
    assert data["queues"][1] == {**data["queues"][1], "name": "queue-1999"}
    assert data["counts"] == {
        "pending": 2003,
        "in_progress": 0,
        "escalated": 0,
        "done": 0,
        "cancelled": 0,
    }
    one = browser.get("/panels/?queue=queue-1999").json()
    assert one["counts"]["pending"] == 4


def test_the_panels_answer_the_board_reads_again_is_for_people_logged_in(
    client: Client, browser: Client, make_task: Callable[..., Task], agent: Any
) -> None:
    make_task(queue="mail")
    limited = UserFactory.create(username="limited")
    limit_queues(limited, ["images"])
    make_task(queue="images")

    assert client.get("/panels/").status_code == 401
    assert [queue["name"] for queue in browser.get("/panels/").json()["queues"]] == [
        "images",
        "mail",
    ]
    theirs = logged_in(limited).get("/panels/").json()
    assert [queue["name"] for queue in theirs["queues"]] == ["images"]
    assert theirs["counts"]["pending"] == 1


def comments_on(task: Task, author: Any, count: int, size: int) -> None:
    for n in range(count):
        transitions.comment(task_id=task.id, actor=author, body=f"{n:04d} " + "x" * (size - 5))


def event_ids_on(html: str) -> list[int]:
    return [int(n) for n in re.findall(r'<li class="event [^"]*" id="event-(\d+)"', html)]


@pytest.mark.slow
@pytest.mark.once
def test_the_task_page_shows_50_events_at_a_time_and_pages_back_to_the_oldest(
    browser: Client, make_task: Callable[..., Task], agent: Any
) -> None:
    task = make_task(title="much discussed")
    comments_on(task, agent, 1000, 10_000)
    every = list(TaskEvent.objects.filter(task=task).order_by("id").values_list("id", flat=True))

    response = browser.get(f"/tasks/{task.id}/")

    html = response.content.decode()
    assert len(response.content) < 150_000, f"{len(response.content)} bytes"
    assert event_ids_on(html) == every[-50:], "the newest 50, oldest first"
    assert re.search(r'data-field="event-count">1001<', html)
    assert state_of(html)["timeline_live"] is True
    assert "Show all of this event" in html, "a 10 KB comment is cut short"
    assert "x" * 1001 not in html
    seen, pages = event_ids_on(html), 1
    while match := re.search(r'href="\?before=(\d+)#timeline"', html):
        response = browser.get(f"/tasks/{task.id}/?before={match.group(1)}")
        html = response.content.decode()
        assert len(response.content) < 150_000
        assert state_of(html)["timeline_live"] is False
        seen = event_ids_on(html) + seen
        pages += 1
    assert seen == every, "every event once, down to the created one"
    assert pages == 21
    newer = re.search(r'href="\?after=(\d+)#timeline"', html)
    assert newer
    following = browser.get(f"/tasks/{task.id}/?after={newer.group(1)}").content.decode()
    assert event_ids_on(following) == every[1:51]
    oldest = browser.get(f"/tasks/{task.id}/?after=0").content.decode()
    assert event_ids_on(oldest) == every[:50]

    full = browser.get(f"/tasks/{task.id}/events/{every[-1]}/").content.decode()
    assert "0999 " + "x" * 9995 in full


def test_an_events_own_page_is_for_those_who_may_see_its_task(
    make_task: Callable[..., Task], agent: Any
) -> None:
    task = make_task(queue="theirs")
    comments_on(task, agent, 1, 20)
    event = TaskEvent.objects.filter(task=task).latest("id")
    limited = UserFactory.create(username="limited")
    limit_queues(limited, ["ours"])
    other = make_task(queue="ours")

    assert logged_in(limited).get(f"/tasks/{task.id}/events/{event.id}/").status_code == 404
    assert logged_in(limited).get(f"/tasks/{other.id}/events/{event.id}/").status_code == 404
    assert logged_in(agent).get(f"/tasks/{task.id}/events/{event.id}/").status_code == 200


def test_a_heartbeats_large_progress_is_cut_short_in_the_timeline(
    browser: Client, make_task: Callable[..., Task], agent: Any
) -> None:
    task = make_task()
    [claim] = transitions.claim(actor=agent)
    transitions.heartbeat(
        task_id=task.id, actor=agent, lease_token=claim.lease_token, progress={"log": "y" * 50_000}
    )

    html = browser.get(f"/tasks/{task.id}/").content.decode()

    timeline = html.split("data-timeline>", 1)[1].split("</ol>", 1)[0]
    assert len(timeline) < 5_000
    assert "Show all of this event" in timeline
