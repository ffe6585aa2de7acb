"""The admin: the escalation queue (escalations.admin), the read-only task and event lists,
and the queues' pause state and log (board.admin).

Escalated tasks are made as in production: created, claimed and failed (or escalated) through
board.transitions. The admin itself must only ever call the transitions.
"""

from __future__ import annotations

import html
import itertools
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import pytest
from django.contrib.auth.models import Permission
from django.contrib.messages import get_messages
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from board import transitions
from board.access import limit_queues
from board.exceptions import InvalidTransition
from board.models import EventType, QueuePause, QueueState, Task, TaskEvent, TaskStatus
from board.notifications import deliveries
from tests import factories
from tests.factories import StaffFactory, UserFactory

pytestmark = pytest.mark.django_db

QUEUE_URL = reverse("admin:escalations_escalatedtask_changelist")

_queue_names = itertools.count()


def change_url(task_id: int) -> str:
    return reverse("admin:escalations_escalatedtask_change", args=[task_id])


def button_url(task_id: int, name: str) -> str:
    return reverse(f"admin:escalations_escalatedtask_{name}", args=[task_id])


def messages_of(response: Any) -> list[str]:
    return [str(message) for message in get_messages(response.wsgi_request)]


def history(task_id: int) -> list[tuple[str, str, str]]:
    """Return the task's events as (type, status, actor), oldest first."""
    return list(
        TaskEvent.objects.filter(task_id=task_id)
        .order_by("id")
        .values_list("type", "status", "actor")
    )


def last_event(task_id: int) -> TaskEvent:
    return TaskEvent.objects.filter(task_id=task_id).latest("id")


def state_of(task_id: int) -> dict[str, Any]:
    return dict(
        Task.objects.values("status", "failure_count", "result", "updated_at").get(pk=task_id)
    )


def grant(user: Any, *codenames: str) -> Any:
    user.user_permissions.add(
        *Permission.objects.filter(content_type__app_label="escalations", codename__in=codenames)
    )
    return user


def logged_in(user: Any) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def escalated(make_task: Callable[..., Task], agent: Any) -> Callable[..., Task]:
    """Return a function that makes an escalated task: created, claimed, then failed.

    With ``reason``, the holder escalates it by hand instead of failing it.
    """

    def make(*, error: str = "boom", reason: str | None = None, **kwargs: Any) -> Task:
        # Alone in its queue when claimed, so the claim gets exactly this task.
        kwargs.setdefault("queue", f"q-{next(_queue_names)}")
        task = make_task(max_failures=1, **kwargs)
        [claim] = transitions.claim(actor=agent, queues=[task.queue])
        assert claim.task.pk == task.pk
        if reason is None:
            task = transitions.fail(
                task_id=task.pk, actor=agent, lease_token=claim.lease_token, error=error
            )
        else:
            task = transitions.escalate(
                task_id=task.pk, actor=agent, lease_token=claim.lease_token, reason=reason
            )
        assert task.status == TaskStatus.ESCALATED
        return task

    return make


@pytest.fixture
def triager(staff: Any) -> Any:
    """A staff member who may view the queue and requeue, resolve and cancel its tasks."""
    return grant(staff, "view_escalatedtask", "triage_task")


@pytest.fixture
def triager_client(triager: Any) -> Client:
    return logged_in(triager)


@pytest.fixture
def watcher(db: None) -> Any:
    """A staff member who may view the queue but not triage it."""
    return grant(StaffFactory.create(username="ops-bob"), "view_escalatedtask")


# -- The queue --------------------------------------------------------------------------


def test_the_queue_lists_only_escalated_tasks_with_when_and_why_they_escalated(
    triager_client: Client, escalated: Callable[..., Task], make_task: Callable[..., Task]
) -> None:
    failed = escalated(title="flaky import", error="ConnectionResetError: peer went away")
    handed_over = escalated(title="needs judgement", reason="the invoice total is negative")
    make_task(title="still pending")

    response = triager_client.get(QUEUE_URL)

    assert response.status_code == 200
    rows = list(response.context["cl"].result_list)
    assert [task.pk for task in rows] == [failed.pk, handed_over.pk]
    escalations = {e.task_id: e for e in TaskEvent.objects.filter(type=EventType.ESCALATED)}
    assert [(task.escalated_at, task.escalation_reason) for task in rows] == [
        (escalations[failed.pk].created_at, "failed 1 of 1 times"),
        (escalations[handed_over.pk].created_at, "the invoice total is negative"),
    ]
    page = response.content.decode()
    assert "flaky import" in page
    assert "ConnectionResetError: peer went away" in page
    assert "failed 1 of 1 times" in page
    assert "1/1" in page
    assert "the invoice total is negative" in page
    assert "still pending" not in page


@pytest.mark.django_db(transaction=True)
def test_the_queue_lists_the_oldest_escalation_first(
    make_task: Callable[..., Task], agent: Any, triager: Any
) -> None:
    # Each transition commits on its own here, so each escalation gets its own now().
    first, second, third = (make_task(title=name, queue=name, max_failures=1) for name in "abc")
    for task in (third, first, second):
        [claim] = transitions.claim(actor=agent, queues=[task.queue])
        transitions.escalate(
            task_id=task.pk, actor=agent, lease_token=claim.lease_token, reason="stuck"
        )

    response = logged_in(triager).get(QUEUE_URL)

    rows = list(response.context["cl"].result_list)
    assert [task.pk for task in rows] == [third.pk, first.pk, second.pk]
    assert rows[0].escalated_at < rows[1].escalated_at < rows[2].escalated_at


def test_the_queue_page_costs_the_same_queries_for_one_task_or_many(
    triager_client: Client, escalated: Callable[..., Task]
) -> None:
    escalated()
    with CaptureQueriesContext(connection) as one:
        assert triager_client.get(QUEUE_URL).status_code == 200
    for _ in range(4):
        escalated()
    with CaptureQueriesContext(connection) as five:
        response = triager_client.get(QUEUE_URL)

    assert len(response.context["cl"].result_list) == 5
    assert len(five) == len(one)


def test_the_queue_can_be_sorted_by_escalation_time(
    triager_client: Client, escalated: Callable[..., Task]
) -> None:
    tasks = [escalated() for _ in range(3)]
    column = triager_client.get(QUEUE_URL).context["cl"].list_display.index("escalated_at")

    newest_first = triager_client.get(QUEUE_URL, {"o": f"-{column}"})

    assert newest_first.status_code == 200
    # Within one test transaction the times tie, and the tie breaks on -pk.
    assert [task.pk for task in newest_first.context["cl"].result_list] == [
        task.pk for task in reversed(tasks)
    ]


def test_the_queue_filters_by_queue_and_searches_title_description_and_last_error(
    triager_client: Client, escalated: Callable[..., Task]
) -> None:
    billing = escalated(queue="billing", title="charge card", error="card declined")
    mail = escalated(queue="mail", title="send digest", description="weekly newsletter")

    def listed(**params: str) -> list[int]:
        response = triager_client.get(QUEUE_URL, params)
        assert response.status_code == 200
        return [task.pk for task in response.context["cl"].result_list]

    assert listed(queue="billing") == [billing.pk]
    assert listed(q="declined") == [billing.pk]
    assert listed(q="newsletter") == [mail.pk]
    assert listed(q="digest") == [mail.pk]


# -- The list's actions -----------------------------------------------------------------


def test_view_on_site_opens_the_tasks_page_on_the_board(
    triager_client: Client, escalated: Callable[..., Task]
) -> None:
    task = escalated(title="look at me")
    page = triager_client.get(change_url(task.pk)).content.decode()
    [link] = re.findall(r'href="([^"]+)"[^>]*class="viewsitelink"', page)

    shown = triager_client.get(html.unescape(link), follow=True)

    assert urlsplit(shown.redirect_chain[-1][0]).path == f"/tasks/{task.pk}/"  # not the API
    assert shown.status_code == 200 and shown["Content-Type"].startswith("text/html")


@pytest.mark.parametrize(
    ("changelist", "action"),
    [
        ("escalations_escalatedtask", "cancel"),
        ("board_delivery", "retry"),
        ("access_apitoken", "delete_selected"),
        ("auth_user", "delete_selected"),
    ],
)
@pytest.mark.parametrize("selected", ["abc", "1.5", ""])
def test_an_action_on_a_selection_that_is_not_of_keys_is_refused_with_a_message(
    escalated: Callable[..., Task], changelist: str, action: str, selected: str
) -> None:
    task = escalated()
    url = reverse(f"admin:{changelist}_changelist")
    admin_client = logged_in(factories.StaffFactory.create(username="root", is_superuser=True))

    response = admin_client.post(
        url, {"action": action, "_selected_action": [selected], "confirm": "1", "post": "yes"}
    )

    assert response.status_code == 302
    assert messages_of(response) in (
        ["The selection is not a list of items."],
        ["Items must be selected in order to perform actions on them. No items have been changed."],
    )
    assert Task.objects.get(pk=task.pk).status == TaskStatus.ESCALATED


def test_requeue_puts_the_escalated_tasks_back_and_reports_the_one_that_was_not(
    triager_client: Client, escalated: Callable[..., Task], staff: Any
) -> None:
    first, second, settled = escalated(), escalated(), escalated()
    transitions.resolve(task_id=settled.pk, actor=staff, note="done elsewhere")
    settled_before = state_of(settled.pk)

    response = triager_client.post(
        QUEUE_URL,
        {
            "action": "requeue",
            "index": 0,
            "_selected_action": [first.pk, second.pk, settled.pk],
        },
    )

    assert response.status_code == 302
    assert messages_of(response) == ["Requeued 2 tasks; skipped 1 that was no longer escalated."]
    for task in (first, second):
        assert state_of(task.pk)["status"] == TaskStatus.PENDING
        assert state_of(task.pk)["failure_count"] == 0
        event = last_event(task.pk)
        assert (event.type, event.status, event.actor) == ("requeued", "pending", "ops-alice")
    assert state_of(settled.pk) == settled_before
    assert last_event(settled.pk).type == EventType.RESOLVED


def test_requeue_across_the_whole_filtered_queue_requeues_every_task_in_it(
    triager_client: Client, escalated: Callable[..., Task]
) -> None:
    billing = [escalated(queue="billing"), escalated(queue="billing")]
    other = escalated(queue="mail")

    response = triager_client.post(
        f"{QUEUE_URL}?queue=billing",
        {
            "action": "requeue",
            "index": 0,
            "select_across": 1,
            "_selected_action": [billing[0].pk],
        },
    )

    assert response.status_code == 302
    assert messages_of(response) == ["Requeued 2 tasks."]
    assert [state_of(task.pk)["status"] for task in billing] == ["pending", "pending"]
    assert state_of(other.pk)["status"] == TaskStatus.ESCALATED


def test_resolve_asks_for_a_note_and_a_result_before_it_settles_the_tasks(
    triager_client: Client, escalated: Callable[..., Task]
) -> None:
    first, second = escalated(), escalated()
    selection = {"action": "resolve", "_selected_action": [first.pk, second.pk]}

    form_page = triager_client.post(QUEUE_URL, {**selection, "index": 0})

    assert form_page.status_code == 200
    assert form_page.templates[0].name == "admin/escalations/triage_form.html"
    page = form_page.content.decode()
    assert 'name="note"' in page
    assert 'name="result"' in page
    assert str(first) in page
    assert state_of(first.pk)["status"] == TaskStatus.ESCALATED

    response = triager_client.post(
        QUEUE_URL,
        {**selection, "confirm": "yes", "note": "fixed by hand", "result": '{"rows": 12}'},
    )

    assert response.status_code == 302
    assert messages_of(response) == ["Resolved 2 tasks."]
    for task in (first, second):
        assert state_of(task.pk)["status"] == TaskStatus.DONE
        assert state_of(task.pk)["result"] == {"rows": 12}
        event = last_event(task.pk)
        assert (event.type, event.status, event.actor) == ("resolved", "done", "ops-alice")
        assert event.payload == {"note": "fixed by hand", "result": {"rows": 12}}


def test_resolve_without_a_result_stores_none(
    triager_client: Client, escalated: Callable[..., Task]
) -> None:
    task = escalated()

    response = triager_client.post(
        QUEUE_URL,
        {
            "action": "resolve",
            "_selected_action": [task.pk],
            "confirm": "yes",
            "note": "not needed any more",
            "result": "",
        },
    )

    assert response.status_code == 302
    assert state_of(task.pk)["status"] == TaskStatus.DONE
    assert state_of(task.pk)["result"] is None
    assert last_event(task.pk).payload == {"note": "not needed any more", "result": None}


@pytest.mark.parametrize(
    ("note", "result", "field"),
    [
        ("fixed", "{not json", "result"),
        ("", '{"ok": true}', "note"),
        ("fixed", '{"a": "\\u0000"}', "result"),
        ("fixed", '{"\\u0000": 1}', "result"),
    ],
    ids=["invalid-json", "no-note", "nul-in-a-string", "nul-in-a-key"],
)
def test_resolve_shows_the_form_again_with_the_error_and_changes_nothing(
    triager_client: Client, escalated: Callable[..., Task], note: str, result: str, field: str
) -> None:
    task = escalated()
    before, events_before = state_of(task.pk), history(task.pk)

    response = triager_client.post(
        QUEUE_URL,
        {
            "action": "resolve",
            "_selected_action": [task.pk],
            "confirm": "yes",
            "note": note,
            "result": result,
        },
    )

    assert response.status_code == 200
    assert list(response.context["form"].errors) == [field]
    assert state_of(task.pk) == before
    assert history(task.pk) == events_before


def test_cancel_withdraws_the_tasks_with_a_cancelled_event_and_the_note(
    triager_client: Client, escalated: Callable[..., Task]
) -> None:
    task = escalated()

    response = triager_client.post(
        QUEUE_URL,
        {
            "action": "cancel",
            "_selected_action": [task.pk],
            "confirm": "yes",
            "note": "the customer withdrew the order",
        },
    )

    assert response.status_code == 302
    assert messages_of(response) == ["Cancelled 1 task."]
    assert state_of(task.pk)["status"] == TaskStatus.CANCELLED
    event = last_event(task.pk)
    assert (event.type, event.status, event.actor) == ("cancelled", "cancelled", "ops-alice")
    assert event.payload == {
        "note": "the customer withdrew the order",
        "previous_status": "escalated",
    }


def test_cancel_without_a_note_records_none(
    triager_client: Client, escalated: Callable[..., Task]
) -> None:
    task = escalated()

    triager_client.post(
        QUEUE_URL,
        {"action": "cancel", "_selected_action": [task.pk], "confirm": "yes", "note": ""},
    )

    assert last_event(task.pk).payload == {"previous_status": "escalated"}


def test_the_confirmation_page_says_which_selected_tasks_will_be_skipped(
    triager_client: Client, escalated: Callable[..., Task], staff: Any
) -> None:
    task, gone = escalated(), escalated()
    transitions.cancel(task_id=gone.pk, actor=staff)

    response = triager_client.post(
        QUEUE_URL, {"action": "cancel", "index": 0, "_selected_action": [task.pk, gone.pk]}
    )

    assert response.status_code == 200
    assert response.context["tasks"] == [task]
    assert "1 of the selected tasks is no longer escalated" in response.content.decode()
    # The confirmation carries the whole selection on, so the report counts the skip.
    confirmed = triager_client.post(
        QUEUE_URL,
        {
            "action": "cancel",
            "_selected_action": [task.pk, gone.pk],
            "confirm": "yes",
            "note": "",
        },
    )
    assert messages_of(confirmed) == ["Cancelled 1 task; skipped 1 that was no longer escalated."]


# -- The task page ----------------------------------------------------------------------


def test_the_task_page_shows_payload_last_error_and_event_history(
    triager_client: Client, escalated: Callable[..., Task]
) -> None:
    task = escalated(
        title="resize images",
        description="all of them",
        payload={"bucket": "in", "sizes": [64, 128]},
        error="Traceback: <MemoryError>",
    )

    response = triager_client.get(change_url(task.pk))

    assert response.status_code == 200
    page = response.content.decode()
    assert "resize images" in page
    assert "all of them" in page
    # Pretty JSON, escaped, in a <pre> (jsonb keeps its own key order).
    assert "<pre>{\n  &quot;sizes&quot;: [\n    64,\n    128\n  ],\n" in page
    assert "\n  &quot;bucket&quot;: &quot;in&quot;\n}</pre>" in page
    assert "Traceback: &lt;MemoryError&gt;" in page
    assert "failed 1 of 1 times" in page
    events = response.context["timeline_page"].events
    assert [(e.type, e.actor) for e in events] == [
        ("created", "agent-smith"),
        ("claimed", "agent-smith"),
        ("failed", "agent-smith"),
        ("escalated", "agent-smith"),
    ]
    assert "event history" in page.lower()
    # A read-only page: no save buttons, but the triage buttons.
    assert 'name="_save"' not in page
    assert 'name="_continue"' not in page
    assert button_url(task.pk, "requeue") in page
    assert button_url(task.pk, "resolve") in page
    assert button_url(task.pk, "cancel") in page


def test_the_requeue_button_requeues_the_task_and_returns_to_the_queue(
    triager_client: Client, escalated: Callable[..., Task]
) -> None:
    task = escalated(queue="billing")
    filters = "_changelist_filters=queue%3Dbilling"

    response = triager_client.post(f"{button_url(task.pk, 'requeue')}?{filters}")

    assert response.status_code == 302
    assert response["Location"] == f"{QUEUE_URL}?queue=billing"
    assert messages_of(response) == [f"Requeued #{task.pk} {task.title}."]
    assert state_of(task.pk)["status"] == TaskStatus.PENDING
    assert history(task.pk)[-1] == ("requeued", "pending", "ops-alice")


def test_the_requeue_button_does_nothing_on_a_get(
    triager_client: Client, escalated: Callable[..., Task]
) -> None:
    task = escalated()

    response = triager_client.get(button_url(task.pk, "requeue"))

    assert response.status_code == 405
    assert state_of(task.pk)["status"] == TaskStatus.ESCALATED


def test_the_resolve_button_asks_for_a_note_then_resolves_the_task(
    triager_client: Client, escalated: Callable[..., Task]
) -> None:
    task = escalated()

    form_page = triager_client.get(button_url(task.pk, "resolve"))
    assert form_page.status_code == 200
    assert 'name="note"' in form_page.content.decode()

    invalid = triager_client.post(
        button_url(task.pk, "resolve"), {"note": "done", "result": "[1, 2"}
    )
    assert invalid.status_code == 200
    assert "result" in invalid.context["form"].errors
    assert state_of(task.pk)["status"] == TaskStatus.ESCALATED

    response = triager_client.post(
        button_url(task.pk, "resolve"), {"note": "done by hand", "result": "[1, 2]"}
    )

    assert response.status_code == 302
    assert response["Location"] == QUEUE_URL
    assert state_of(task.pk)["status"] == TaskStatus.DONE
    assert state_of(task.pk)["result"] == [1, 2]
    event = last_event(task.pk)
    assert (event.type, event.actor, event.payload["note"]) == (
        "resolved",
        "ops-alice",
        "done by hand",
    )


def test_the_cancel_button_cancels_the_task(
    triager_client: Client, escalated: Callable[..., Task]
) -> None:
    task = escalated()

    response = triager_client.post(button_url(task.pk, "cancel"), {"note": "obsolete"})

    assert response.status_code == 302
    assert state_of(task.pk)["status"] == TaskStatus.CANCELLED
    assert last_event(task.pk).payload == {"note": "obsolete", "previous_status": "escalated"}


def test_a_button_on_a_task_that_left_the_queue_changes_nothing_and_says_so(
    triager_client: Client, escalated: Callable[..., Task], staff: Any
) -> None:
    task = escalated()
    transitions.requeue(task_id=task.pk, actor=staff)
    before, events_before = state_of(task.pk), history(task.pk)

    response = triager_client.post(button_url(task.pk, "cancel"), {"note": "too late"})

    assert response.status_code == 302
    assert messages_of(response) == [f"Task {task.pk} is no longer escalated."]
    assert state_of(task.pk) == before
    assert history(task.pk) == events_before


# -- Nothing is ever edited -------------------------------------------------------------


@pytest.mark.parametrize("admin_name", ["escalations_escalatedtask", "board_task"])
def test_posting_the_change_form_does_not_modify_the_task(
    admin_client: Client, escalated: Callable[..., Task], admin_name: str
) -> None:
    task = escalated(title="original")
    before = state_of(task.pk)

    response = admin_client.post(
        reverse(f"admin:{admin_name}_change", args=[task.pk]),
        {"title": "edited", "status": "done", "failure_count": 0, "_save": "Save"},
    )

    assert response.status_code == 403
    assert Task.objects.get(pk=task.pk).title == "original"
    assert state_of(task.pk) == before


@pytest.mark.parametrize(
    "admin_name", ["escalations_escalatedtask", "board_task", "board_taskevent"]
)
def test_no_one_can_add_delete_or_bulk_delete_tasks_or_events(
    admin_client: Client, escalated: Callable[..., Task], admin_name: str
) -> None:
    task = escalated()
    object_id = last_event(task.pk).pk if admin_name == "board_taskevent" else task.pk
    changelist = reverse(f"admin:{admin_name}_changelist")

    assert admin_client.get(reverse(f"admin:{admin_name}_add")).status_code == 403
    delete_url = reverse(f"admin:{admin_name}_delete", args=[object_id])
    assert admin_client.post(delete_url, {"post": "yes"}).status_code == 403
    page = admin_client.get(changelist)
    assert page.status_code == 200
    assert "delete_selected" not in page.content.decode()
    admin_client.post(
        changelist, {"action": "delete_selected", "_selected_action": [object_id], "post": "yes"}
    )
    assert Task.objects.filter(pk=task.pk).exists()
    assert TaskEvent.objects.filter(task_id=task.pk).count() == 4


# -- Who may do what --------------------------------------------------------------------


def test_a_user_who_is_not_staff_is_sent_to_the_admin_login(
    agent: Any, escalated: Callable[..., Task]
) -> None:
    task = escalated()
    client = logged_in(agent)

    for response in (
        client.get(QUEUE_URL),
        client.get(change_url(task.pk)),
        client.post(button_url(task.pk, "requeue")),
        client.post(QUEUE_URL, {"action": "requeue", "index": 0, "_selected_action": [task.pk]}),
    ):
        assert response.status_code == 302
        assert response["Location"].startswith(reverse("admin:login"))
    assert state_of(task.pk)["status"] == TaskStatus.ESCALATED


def test_staff_without_the_triage_permission_see_the_queue_but_not_the_actions(
    watcher: Any, escalated: Callable[..., Task]
) -> None:
    task = escalated(title="look but do not touch")
    client = logged_in(watcher)

    queue = client.get(QUEUE_URL)
    task_page = client.get(change_url(task.pk))

    assert queue.status_code == 200
    assert "look but do not touch" in queue.content.decode()
    assert queue.context["action_form"] is None
    assert "Requeue selected" not in queue.content.decode()
    assert task_page.status_code == 200
    assert button_url(task.pk, "requeue") not in task_page.content.decode()
    assert button_url(task.pk, "resolve") not in task_page.content.decode()


def test_a_forged_action_or_button_from_staff_without_the_triage_permission_does_nothing(
    watcher: Any, escalated: Callable[..., Task]
) -> None:
    task = escalated()
    before, events_before = state_of(task.pk), history(task.pk)
    client = logged_in(watcher)

    client.post(QUEUE_URL, {"action": "requeue", "index": 0, "_selected_action": [task.pk]})
    client.post(
        QUEUE_URL,
        {"action": "cancel", "_selected_action": [task.pk], "confirm": "yes", "note": "x"},
    )
    for name in ("requeue", "resolve", "cancel"):
        response = client.post(button_url(task.pk, name), {"note": "x"})
        assert response.status_code == 403

    assert state_of(task.pk) == before
    assert history(task.pk) == events_before


def test_staff_without_any_permission_cannot_see_the_queue(db: None) -> None:
    client = logged_in(StaffFactory.create(username="ops-carol"))

    assert client.get(QUEUE_URL).status_code == 403


def test_a_superuser_may_triage(admin_client: Client, escalated: Callable[..., Task]) -> None:
    task = escalated()

    queue = admin_client.get(QUEUE_URL)
    response = admin_client.post(button_url(task.pk, "requeue"))

    assert [name for name, _ in queue.context["action_form"].fields["action"].choices] == [
        "",
        "requeue",
        "resolve",
        "cancel",
    ]
    assert response.status_code == 302
    assert history(task.pk)[-1] == ("requeued", "pending", "admin")


# -- The task and event lists -----------------------------------------------------------


def test_the_task_list_shows_every_task_and_its_page_never_the_lease_token(
    admin_client: Client, make_task: Callable[..., Task], agent: Any
) -> None:
    make_task(title="waiting", queue="held-q")
    [claim] = transitions.claim(actor=agent, queues=["held-q"])

    listing = admin_client.get(reverse("admin:board_task_changelist"), {"status": "in_progress"})
    page = admin_client.get(reverse("admin:board_task_change", args=[claim.task.pk]))

    assert [task.pk for task in listing.context["cl"].result_list] == [claim.task.pk]
    assert "agent-smith" in listing.content.decode()
    assert page.status_code == 200
    assert claim.lease_token not in page.content.decode()
    assert 'name="_save"' not in page.content.decode()
    events = page.context["timeline_page"].events
    assert [e.type for e in events] == ["created", "claimed"]


def test_the_event_list_filters_by_type_and_searches_the_actor(
    admin_client: Client, escalated: Callable[..., Task]
) -> None:
    task = escalated()
    UserFactory.create(username="someone-else")

    by_type = admin_client.get(reverse("admin:board_taskevent_changelist"), {"type": "failed"})
    by_actor = admin_client.get(reverse("admin:board_taskevent_changelist"), {"q": "smith"})

    assert [(e.task_id, e.type) for e in by_type.context["cl"].result_list] == [(task.pk, "failed")]
    assert len(by_actor.context["cl"].result_list) == 4
    event_page = admin_client.get(
        reverse("admin:board_taskevent_change", args=[last_event(task.pk).pk])
    )
    assert event_page.status_code == 200
    assert "failed 1 of 1 times" in event_page.content.decode()


def test_the_admin_is_titled_taskboard(admin_client: Client) -> None:
    page = admin_client.get(reverse("admin:index")).content.decode()

    assert "Taskboard administration" in page
    assert "<title>Taskboard | Taskboard admin</title>" in page


# -- Staff limited to queues (board.access) ---------------------------------------------


def test_staff_limited_to_queues_triage_only_their_queues_in_the_admin(
    escalated: Callable[..., Task], triager: Any
) -> None:
    """The admin applies a queue limit as the API does: another queue's escalated tasks are
    neither listed, nor opened, nor requeued, resolved or cancelled, one or many."""
    from board.access import limit_queues

    ours, theirs = escalated(queue="ours"), escalated(queue="theirs")
    limit_queues(triager, ["ours"])
    client = logged_in(triager)
    before = history(theirs.pk)

    listed = client.get(QUEUE_URL)
    opened = client.get(change_url(theirs.pk))
    one = client.post(button_url(theirs.pk, "requeue"))
    many = client.post(
        QUEUE_URL,
        {"action": "cancel", "_selected_action": [theirs.pk, ours.pk], "confirm": "1"},
    )

    assert [task.pk for task in listed.context["cl"].result_list] == [ours.pk]
    assert opened.status_code == 302  # Django's answer for an object the user cannot see
    assert one.status_code == 302
    assert messages_of(one)[-1] == f"Task {theirs.pk} is not escalated in one of your queues."
    assert history(theirs.pk) == before
    assert Task.objects.get(pk=theirs.pk).status == TaskStatus.ESCALATED
    assert Task.objects.get(pk=ours.pk).status == TaskStatus.CANCELLED, messages_of(many)


def test_staff_limited_to_queues_see_only_their_queues_in_the_task_and_event_lists(
    escalated: Callable[..., Task], staff: Any
) -> None:
    from board.access import limit_queues

    ours, theirs = escalated(queue="ours"), escalated(queue="theirs")
    staff.user_permissions.add(
        *Permission.objects.filter(codename__in=["view_task", "view_taskevent"])
    )
    limit_queues(staff, ["ours"])
    client = logged_in(staff)

    tasks = client.get(reverse("admin:board_task_changelist"))
    events = client.get(reverse("admin:board_taskevent_changelist"))
    their_event = TaskEvent.objects.filter(task=theirs).first()
    assert their_event is not None

    assert [task.pk for task in tasks.context["cl"].result_list] == [ours.pk]
    assert {event.task_id for event in events.context["cl"].result_list} == {ours.pk}
    assert client.get(reverse("admin:board_task_change", args=[theirs.pk])).status_code == 302
    assert (
        client.get(reverse("admin:board_taskevent_change", args=[their_event.pk])).status_code
        == 302
    )


def test_staff_limited_to_queues_see_and_retry_only_their_queues_webhooks_and_deliveries(
    escalated: Callable[..., Task], staff: Any
) -> None:
    """As in the API (webhooks/): a webhook of every queue, or of another, is not theirs,
    nor is a delivery of another queue's task."""
    from board.models import Delivery, Webhook

    def hook(queues: list[str] | None) -> Webhook:
        return deliveries.create_webhook(
            actor=staff,
            url="https://example.com/hook",
            events=["escalated"],
            queues=queues,
            secret="s" * 32,
        )

    every, ours_hook, theirs_hook = hook(None), hook(["ours"]), hook(["theirs"])
    ours, theirs = escalated(queue="ours"), escalated(queue="theirs")
    Delivery.objects.update(status="failed", next_attempt_at=None)
    staff.user_permissions.add(
        *Permission.objects.filter(codename__in=["view_webhook", "view_delivery"])
    )
    limit_queues(staff, ["ours"])
    client = logged_in(staff)

    webhooks = client.get(reverse("admin:board_webhook_changelist"))
    assert [w.pk for w in webhooks.context["cl"].result_list] == [ours_hook.pk]
    for hidden in (every, theirs_hook):
        page = client.get(reverse("admin:board_webhook_change", args=[hidden.pk]))
        assert page.status_code == 302
    listed = client.get(reverse("admin:board_delivery_changelist"))
    assert {d.task_id for d in listed.context["cl"].result_list} == {ours.pk}
    their_deliveries = list(Delivery.objects.filter(task_id=theirs.pk).values_list("pk", flat=True))
    response = client.post(
        reverse("admin:board_delivery_changelist"),
        {"action": "retry", "index": 0, "_selected_action": their_deliveries},
    )
    assert response.status_code in (200, 302)
    assert set(Delivery.objects.filter(task_id=theirs.pk).values_list("status", flat=True)) == {
        "failed"
    }


def test_staff_limited_to_queues_never_see_the_url_of_a_webhook_that_is_not_theirs(
    escalated: Callable[..., Task], staff: Any
) -> None:
    """A Slack incoming-webhook URL is a secret. The deliveries of a webhook of every queue
    (or of another) to a task of theirs are not theirs either: not in the list, its filter
    or a delivery's page, as the webhook itself is not."""
    from board.models import Delivery

    def hook(queues: list[str] | None, url: str) -> Any:
        return deliveries.create_webhook(
            actor=staff, url=url, events=["escalated"], queues=queues, secret="s" * 32
        )

    every = hook(None, "https://hooks.slack.com/services/T0/B0/every-queue-secret")
    hook(["theirs"], "https://hooks.slack.com/services/T0/B0/their-queue-secret")
    ours_hook = hook(["ours"], "https://hooks.example.com/ours")
    ours = escalated(queue="ours")
    escalated(queue="theirs")
    staff.user_permissions.add(
        *Permission.objects.filter(codename__in=["view_webhook", "view_delivery"])
    )
    limit_queues(staff, ["ours"])
    client = logged_in(staff)
    [every_to_ours] = Delivery.objects.filter(webhook=every, task_id=ours.pk)

    listed = client.get(reverse("admin:board_delivery_changelist"))
    pages = [
        listed,
        client.get(reverse("admin:board_delivery_changelist"), {"webhook__id__exact": every.pk}),
        client.get(reverse("admin:board_delivery_change", args=[every_to_ours.pk]), follow=True),
    ]

    assert {d.webhook_id for d in listed.context["cl"].result_list} == {ours_hook.pk}
    assert "https://hooks.example.com/ours" in listed.content.decode()
    for page in pages:
        assert page.status_code == 200
        assert "queue-secret" not in page.content.decode()


# -- The escalated task's work graph, progress and comments -----------------------------


def comment_url(task_id: int) -> str:
    return reverse("admin:escalations_escalatedtask_comment", args=[task_id])


def test_the_escalated_task_page_shows_its_dependencies_dependents_and_progress(
    triager_client: Client, make_task: Callable[..., Task], agent: Any
) -> None:
    fetched = make_task(title="fetch prices", queue="prices")
    task = make_task(title="import prices", queue="prices", depends_on=[fetched.id], max_failures=1)
    waiting = make_task(title="publish prices", queue="prices", depends_on=[task.id])
    [claim] = transitions.claim(actor=agent, queues=["prices"])
    transitions.complete(task_id=fetched.id, actor=agent, lease_token=claim.lease_token)
    [claim] = transitions.claim(actor=agent, queues=["prices"])
    assert claim.task.pk == task.pk
    transitions.heartbeat(
        task_id=task.id, actor=agent, lease_token=claim.lease_token, progress={"rows": 120}
    )
    transitions.fail(task_id=task.id, actor=agent, lease_token=claim.lease_token, error="bad")

    response = triager_client.get(change_url(task.pk))

    assert response.status_code == 200
    page = response.content.decode()
    assert "Work graph" in page
    assert f'<a href="/tasks/{fetched.id}/">#{fetched.id} fetch prices</a> (done)' in page
    assert (
        f'<a href="/tasks/{waiting.id}/">#{waiting.id} publish prices</a> (pending, blocked)'
        in page
    )
    assert "<pre>{\n  &quot;rows&quot;: 120\n}</pre>" in page, (
        "the progress, kept after the failure"
    )
    relations = response.context["relations"]
    assert [item["id"] for item in relations["dependencies"]] == [fetched.id]
    assert [item["id"] for item in relations["dependents"]] == [waiting.id]


def test_anyone_who_may_see_an_escalated_task_comments_on_it_from_its_page(
    watcher: Any, escalated: Callable[..., Task]
) -> None:
    task = escalated(queue="billing")
    client = logged_in(watcher)
    page = client.get(change_url(task.pk)).content.decode()
    assert f'action="{comment_url(task.pk)}"' in page
    assert 'name="body"' in page

    response = client.post(
        f"{comment_url(task.pk)}?_changelist_filters=queue%3Dbilling",
        {"body": "Asked the supplier for a new file."},
    )

    assert response.status_code == 302
    assert response["Location"] == (
        f"{change_url(task.pk)}?_changelist_filters=queue%3Dbilling#comment"
    )
    assert messages_of(response) == [f"Commented on task {task.pk}."]
    event = last_event(task.pk)
    assert (event.type, event.status, event.actor, event.payload) == (
        "commented",
        "escalated",
        "ops-bob",
        {"body": "Asked the supplier for a new file."},
    )
    assert state_of(task.pk)["status"] == TaskStatus.ESCALATED, "a comment changes nothing else"
    history_page = client.get(change_url(task.pk)).content.decode()
    assert "Asked the supplier for a new file." in history_page


@pytest.mark.parametrize("body", ["", "  \n "])
def test_a_blank_comment_in_the_admin_records_nothing_and_says_why(
    triager_client: Client, escalated: Callable[..., Task], body: str
) -> None:
    task = escalated()
    before = history(task.pk)

    response = triager_client.post(comment_url(task.pk), {"body": body})

    assert response.status_code == 302
    assert response["Location"] == f"{change_url(task.pk)}#comment"
    assert messages_of(response) == ["The comment is empty: write something to post."]
    assert history(task.pk) == before


def test_a_comment_on_a_task_that_left_the_queue_is_kept_and_leads_back_to_the_queue(
    triager_client: Client, escalated: Callable[..., Task], staff: Any
) -> None:
    task = escalated()
    transitions.requeue(task_id=task.pk, actor=staff)

    response = triager_client.post(comment_url(task.pk), {"body": "requeued it, watch it"})

    assert response["Location"] == QUEUE_URL
    assert last_event(task.pk).type == "commented"


def test_commenting_in_the_admin_is_a_post_for_staff_who_may_see_the_task(
    agent: Any, escalated: Callable[..., Task], triager_client: Client
) -> None:
    task = escalated(queue="ours")
    before = history(task.pk)

    assert triager_client.get(comment_url(task.pk)).status_code == 405
    not_staff = logged_in(agent).post(comment_url(task.pk), {"body": "hi"})
    assert not_staff.status_code == 302
    assert not_staff["Location"].startswith(reverse("admin:login"))
    no_view = logged_in(StaffFactory.create(username="ops-carol")).post(
        comment_url(task.pk), {"body": "x"}
    )
    assert no_view.status_code == 403
    limited = grant(StaffFactory.create(username="ops-dan"), "view_escalatedtask")
    limit_queues(limited, ["theirs"])
    elsewhere = logged_in(limited).post(comment_url(task.pk), {"body": "hi"})
    assert elsewhere.status_code == 302
    assert messages_of(elsewhere) == [f"There is no task {task.pk}."]
    assert history(task.pk) == before


# -- Queues: state and the log of pauses ------------------------------------------------

STATES_URL = reverse("admin:board_queuestate_changelist")
PAUSES_URL = reverse("admin:board_queuepause_changelist")


@pytest.fixture
def queue_triager(triager: Any) -> Any:
    return factories.grant(triager, "board.view_queuestate", "board.view_queuepause")


def test_pauses_and_resumes_are_listed_with_actor_and_note(queue_triager: Any, staff: Any) -> None:
    transitions.pause_queue(queue="mail", actor=staff, note="relay down")
    transitions.resume_queue(queue="mail", actor=staff)
    transitions.pause_queue(queue="images", actor=staff)
    client = logged_in(queue_triager)

    states = client.get(STATES_URL)
    log = client.get(PAUSES_URL)

    assert [(s.name, s.paused) for s in states.context["cl"].result_list] == [
        ("images", True),
        ("mail", False),
    ]
    rows = [(p.queue, p.paused, p.actor, p.note) for p in log.context["cl"].result_list]
    assert rows == [
        ("images", True, "ops-alice", ""),
        ("mail", False, "ops-alice", ""),
        ("mail", True, "ops-alice", "relay down"),
    ]
    assert "relay down" in log.content.decode()
    assert "resumed" in log.content.decode()


def test_the_pause_action_asks_for_a_note_then_pauses_through_the_transition(
    queue_triager: Any, staff: Any, make_task: Callable[..., Task], agent: Any
) -> None:
    make_task(queue="mail")
    transitions.resume_queue(queue="mail", actor=staff)  # a row to select
    transitions.pause_queue(queue="images", actor=staff)
    client = logged_in(queue_triager)
    selection = {"action": "pause", "_selected_action": ["mail", "images"]}

    asked = client.post(STATES_URL, selection)
    assert asked.status_code == 200
    assert asked.context["queues"] == ["mail"]
    assert "1 of the selected queues is already paused" in asked.content.decode()
    assert QueueState.objects.get(name="mail").paused is False

    done = client.post(STATES_URL, {**selection, "confirm": "yes", "note": "maintenance"})

    assert done.status_code == 302
    assert messages_of(done) == ["Paused 1 queue; skipped 1 already paused."]
    mail = QueueState.objects.get(name="mail")
    assert (mail.paused, mail.changed_by, mail.note) == (True, "ops-alice", "maintenance")
    assert QueuePause.objects.filter(queue="mail", paused=True, actor="ops-alice").count() == 1
    assert transitions.claim(actor=agent, queues=["mail"]) == []

    resumed = client.post(
        STATES_URL,
        {"action": "resume", "_selected_action": ["mail"], "confirm": "yes", "note": ""},
    )
    assert messages_of(resumed)[-1] == "Resumed 1 queue."
    assert QueueState.objects.get(name="mail").paused is False
    assert len(transitions.claim(actor=agent, queues=["mail"])) == 1


def test_staff_without_the_triage_permission_pause_queues_as_in_the_api(
    staff: Any, db: None
) -> None:
    transitions.resume_queue(queue="mail", actor=staff)
    viewer = factories.grant(
        StaffFactory.create(username="ops-bob"), "board.view_queuestate", "board.view_queuepause"
    )
    client = logged_in(viewer)

    listing = client.get(STATES_URL)
    client.post(
        STATES_URL,
        {"action": "pause", "_selected_action": ["mail"], "confirm": "yes", "note": "x"},
    )

    assert listing.status_code == 200
    assert listing.context["action_form"] is not None
    assert QueueState.objects.get(name="mail").paused is True
    assert QueuePause.objects.filter(actor="ops-bob", paused=True, note="x").exists()


@pytest.mark.parametrize("admin_name", ["board_queuestate", "board_queuepause"])
def test_no_one_adds_edits_or_deletes_queue_states_or_pauses(
    admin_client: Client, staff: Any, admin_name: str
) -> None:
    transitions.pause_queue(queue="mail", actor=staff, note="original")
    object_id = "mail" if admin_name == "board_queuestate" else QueuePause.objects.get().pk

    assert admin_client.get(reverse(f"admin:{admin_name}_add")).status_code == 403
    delete_url = reverse(f"admin:{admin_name}_delete", args=[object_id])
    assert admin_client.post(delete_url, {"post": "yes"}).status_code == 403
    change = reverse(f"admin:{admin_name}_change", args=[object_id])
    assert admin_client.post(change, {"note": "edited", "paused": ""}).status_code == 403
    assert QueueState.objects.get(name="mail").note == "original"
    assert QueuePause.objects.get().note == "original"


def test_staff_limited_to_queues_see_and_pause_only_their_queues_in_the_admin(
    queue_triager: Any, staff: Any
) -> None:
    for name in ("ours", "theirs"):
        transitions.resume_queue(queue=name, actor=staff)
    limit_queues(queue_triager, ["ours"])
    client = logged_in(queue_triager)

    states = client.get(STATES_URL)
    log = client.get(PAUSES_URL)
    client.post(
        STATES_URL,
        {"action": "pause", "_selected_action": ["ours", "theirs"], "confirm": "yes"},
    )

    assert [s.name for s in states.context["cl"].result_list] == ["ours"]
    assert {p.queue for p in log.context["cl"].result_list} == {"ours"}
    assert QueueState.objects.get(name="ours").paused is True
    assert QueueState.objects.get(name="theirs").paused is False


# -- The admin as a place people work: history, the event table, favicon ------------------


def history_url(task_id: int) -> str:
    return reverse("admin:escalations_escalatedtask_history", args=[task_id])


def heartbeating(make_task: Callable[..., Task], agent: Any, beats: int) -> Task:
    """A task whose holder heartbeat ``beats`` times, commented, beat twice, then failed
    it for good (escalated)."""
    task = make_task(title="resize images", queue=f"q-{next(_queue_names)}", max_failures=1)
    [claim] = transitions.claim(actor=agent, queues=[task.queue])
    for n in range(beats):
        transitions.heartbeat(
            task_id=task.pk, actor=agent, lease_token=claim.lease_token, progress={"done": n}
        )
    transitions.comment(task_id=task.pk, actor=agent, body="half way")
    for _ in range(2):
        transitions.heartbeat(task_id=task.pk, actor=agent, lease_token=claim.lease_token)
    return transitions.fail(task_id=task.pk, actor=agent, lease_token=claim.lease_token, error="x")


def rows_of(page: str) -> list[str]:
    """The event table's rows, as the words a reader sees in each."""
    table = page.split('<table class="event-history">', 1)[1].split("</table>", 1)[0]
    rows = re.findall(r"<tr class=\"event-[^\"]*\"[^>]*>(.*?)</tr>", table, re.S)
    return [" ".join(html.unescape(re.sub(r"<[^>]+>", " ", row)).split()) for row in rows]


def test_the_history_button_leads_to_the_tasks_event_history(
    triager_client: Client, make_task: Callable[..., Task], agent: Any
) -> None:
    task = heartbeating(make_task, agent, beats=3)

    page = triager_client.get(change_url(task.pk)).content.decode()
    response = triager_client.get(history_url(task.pk))

    assert f'href="{history_url(task.pk)}"' in page
    assert response.status_code == 200
    history_page = response.content.decode()
    assert "have a change history" not in history_page
    assert f"Event history: #{task.pk} resize images" in history_page
    assert [row.split()[1] for row in rows_of(history_page)] == [
        "created", "claimed", "3", "commented", "2", "failed", "escalated",
    ]  # fmt: skip


def test_the_history_of_a_task_the_user_may_not_see_is_not_shown(
    staff: Any, escalated: Callable[..., Task]
) -> None:
    task = escalated(queue="billing")
    grant(staff, "view_escalatedtask")
    limit_queues(staff, ["support"])

    response = logged_in(staff).get(history_url(task.pk))

    assert response.status_code == 302
    assert "resize" not in response.content.decode()


def test_consecutive_heartbeats_are_one_row_of_the_event_table_while_the_api_keeps_each(
    triager_client: Client, make_task: Callable[..., Task], agent: Any, api: Any
) -> None:
    task = heartbeating(make_task, agent, beats=12)

    page = triager_client.get(change_url(task.pk)).content.decode()
    rows = rows_of(page)
    events = api(agent).get(f"/api/v1/tasks/{task.pk}/events/").json()["results"]

    first, last = (
        TaskEvent.objects.filter(task=task, type="heartbeat").order_by("id")[i] for i in (0, 11)
    )
    assert rows[2].startswith(f"{first.pk}\u2013{last.pk} 12 heartbeats in progress agent-smith")
    assert 'progress {"done": 11}' in rows[2], "the run shows its last heartbeat's data"
    assert rows[4].startswith(f"{last.pk + 2}\u2013{last.pk + 3} 2 heartbeats")
    assert len(rows) == 7
    assert [event["type"] for event in events].count("heartbeat") == 14


def test_the_event_table_has_no_caption_on_every_row(
    triager_client: Client, escalated: Callable[..., Task]
) -> None:
    task = escalated()

    page = triager_client.get(change_url(task.pk)).content.decode()

    for event in TaskEvent.objects.filter(task=task):
        assert str(event) not in page
    assert len(rows_of(page)) == 4


def test_triage_and_the_comment_form_sit_side_by_side_before_the_history(
    triager_client: Client, escalated: Callable[..., Task]
) -> None:
    task = escalated()

    page = triager_client.get(change_url(task.pk)).content.decode()

    panel = page.split('<div class="task-work"', 1)[1].split('<table class="event-history">')[0]
    assert 'class="module triage-module"' in panel
    assert 'class="module comment-module"' in panel
    assert 'form="requeue-form"' in panel and 'form="comment-form"' in panel
    assert f'<form id="requeue-form" method="post" action="{button_url(task.pk, "requeue")}"' in (
        page
    )
    assert f'<form id="comment-form" method="post" action="{comment_url(task.pk)}"' in page


def test_every_admin_page_and_the_old_favicon_address_lead_to_the_boards_icon(
    triager_client: Client, escalated: Callable[..., Task]
) -> None:
    task = escalated()
    icon = '<link rel="icon" href="/static/board/favicon.svg" type="image/svg+xml">'

    for url in (QUEUE_URL, change_url(task.pk), history_url(task.pk)):
        assert icon in triager_client.get(url).content.decode(), url
    assert icon in Client().get("/admin/login/").content.decode()
    legacy = Client().get("/favicon.ico")
    served = Client().get(legacy["Location"])

    assert legacy.status_code == 301
    assert served.status_code == 200
    assert served["Content-Type"].startswith("image/svg+xml")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("first", "second"), [("resolve", "requeue"), ("cancel", "requeue"), ("requeue", "cancel")]
)
def test_a_queue_action_that_waited_for_another_humans_does_not_undo_it(
    first: str, second: str, triager: Any, staff: Any, escalated: Callable[..., Task]
) -> None:
    """Two humans on one escalated task at once: one resolves, cancels or requeues it while
    the other's queue action waits for the task's row. The second then finds it no longer
    escalated, as the escalation queue offers it, rather than reopening a settled task or
    cancelling one just sent back to work."""
    import threading

    from django.db import transaction

    from escalations.triage import CANCEL, REQUEUE

    task = escalated()
    triage = {"requeue": REQUEUE, "cancel": CANCEL}[second]
    outcome: list[Any] = []

    def second_human() -> None:
        try:
            outcome.append(triage.transition(task_id=task.pk, actor=triager))
        except Exception as exc:  # the refusal is what the test looks at
            outcome.append(exc)
        finally:
            connection.close()

    with transaction.atomic():
        getattr(transitions, first)(task_id=task.pk, actor=staff, note="first")
        waiting = threading.Thread(target=second_human)
        waiting.start()
        waiting.join(timeout=1)
        assert waiting.is_alive(), "it did not wait for the first human's lock"
    waiting.join(timeout=10)

    [refused] = outcome
    assert isinstance(refused, InvalidTransition), refused
    expected = {"resolve": "resolved", "cancel": "cancelled", "requeue": "requeued"}[first]
    assert [kind for kind, _, _ in history(task.pk)][-1] == expected


def test_a_nul_character_in_an_admin_url_or_filter_is_a_400_not_a_500(
    triager_client: Client,
) -> None:
    for url in (
        f"{QUEUE_URL}?queue=%00",
        reverse("admin:board_task_changelist") + "?queue=a%00b",
        "/admin/board/queuestate/a%00b/change/",
    ):
        assert triager_client.get(url).status_code == 400, url
    assert triager_client.get(f"{QUEUE_URL}?queue=ok").status_code == 200


@pytest.mark.slow
@pytest.mark.once
def test_a_task_page_with_a_thousand_long_comments_stays_small_and_links_the_rest(
    admin_client: Client, triager_client: Client, escalated: Callable[..., Task], agent: Any
) -> None:
    task = escalated(title="much discussed")
    for n in range(1000):
        transitions.comment(task_id=task.pk, actor=agent, body=f"{n:04d} " + "x" * 9995)
    every = list(TaskEvent.objects.filter(task=task).order_by("id").values_list("id", flat=True))

    for client, url in (
        (admin_client, reverse("admin:board_task_change", args=[task.pk])),
        (triager_client, change_url(task.pk)),
    ):
        response = client.get(url)
        page = response.content.decode()
        assert response.status_code == 200
        assert len(response.content) < 150_000, f"{url}: {len(response.content)} bytes"
        assert [event.pk for event in response.context["timeline_page"].events] == every[-50:]
        assert len(rows_of(page)) == 50
        assert "The newest 50 of 1004 events." in page
        assert f"?before={every[-50]}" in page, "the older ones are a link away"
        assert f"?task__id__exact={task.pk}" in page
        assert reverse("admin:board_taskevent_change", args=[every[-1]]) in page
        assert "x" * 1001 not in page

    seen: list[int] = []
    url = f"{history_url(task.pk)}?before={every[-50]}"
    while url:
        response = triager_client.get(url)
        assert len(response.content) < 150_000
        seen = [event.pk for event in response.context["timeline_page"].events] + seen
        match = re.search(r'href="(\?before=\d+)"', response.content.decode())
        url = f"{history_url(task.pk)}{match.group(1)}" if match else ""
    assert seen + every[-50:] == every
