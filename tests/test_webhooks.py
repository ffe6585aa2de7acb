"""Webhooks: the staff API, and deliveries written with their events (board.transitions,
migration 0012)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from django.db import transaction
from django.test import Client
from rest_framework.test import APIClient

from board import transitions
from board.models import Delivery, Webhook
from board.notifications import deliveries
from tests.factories import UserFactory, grant
from tests.test_api import assert_error, get, post

pytestmark = pytest.mark.django_db
API = "/api/v1"


@pytest.fixture
def staff_api(api: Callable[[Any], APIClient], staff: Any) -> APIClient:
    return api(staff)


def add_webhook(client: APIClient, **body: Any) -> dict[str, Any]:
    response = post(client, "webhooks/", {"url": "https://example.com/hook", **body})
    assert response.status_code == 201, response.content
    return dict(response.json())


def escalate(make_task: Callable[..., Any], agent: Any, queue: str = "default") -> Any:
    task = make_task(queue=queue)
    [held] = transitions.claim(actor=agent, queues=[queue])
    return transitions.escalate(
        task_id=task.pk, actor=agent, lease_token=held.lease_token, reason="need a human"
    )


# -- The API -----------------------------------------------------------------------------


def test_a_new_webhook_gets_a_generated_secret_shown_once(staff_api: APIClient) -> None:
    created = add_webhook(staff_api)
    assert created["events"] == ["escalated"]
    assert created["queues"] is None
    assert created["active"] is True
    assert created["format"] == "json"
    assert len(created["secret"]) == 64  # 256 random bits, in hex
    listed = get(staff_api, "webhooks/").json()
    assert [w["id"] for w in listed["results"]] == [created["id"]]
    assert "secret" not in listed["results"][0]
    assert listed["next"] is None


def test_repeated_events_and_queues_are_kept_once(staff_api: APIClient) -> None:
    created = add_webhook(staff_api, events=["failed", "failed"], queues=["q1", "q2", "q1"])
    assert (created["events"], created["queues"]) == (["failed"], ["q1", "q2"])
    assert Webhook.objects.get(pk=created["id"]).queues == ["q1", "q2"]


def test_a_given_secret_events_queues_and_format_are_kept(staff_api: APIClient) -> None:
    created = add_webhook(
        staff_api,
        events=["failed", "escalated"],
        queues=["images"],
        secret="s" * 32,
        format="slack",
    )
    assert (created["events"], created["queues"], created["secret"], created["format"]) == (
        ["failed", "escalated"],
        ["images"],
        "s" * 32,
        "slack",
    )


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"url": "ftp://example.com/x"}, "url"),
        ({"url": "not a url"}, "url"),
        ({"url": "http://"}, "url"),
        ({"url": "http://example.com/a b"}, "url"),
        ({"url": "http://example.com\n"}, "url"),
        ({"url": "http://example.com:0/"}, "url"),
        ({"url": "http://example.com:65536/"}, "url"),
        ({"url": "http://example.com:99999"}, "url"),
        ({"url": "http://example.com:08080"}, "url"),
        ({}, "url"),
        ({"url": "https://example.com", "events": ["exploded"]}, "events"),
        ({"url": "https://example.com", "events": []}, "events"),
        ({"url": "https://example.com", "events": "escalated"}, "events"),
        ({"url": "https://example.com", "queues": ["Not A Queue"]}, "queues"),
        ({"url": "https://example.com", "secret": ""}, "secret"),
        ({"url": "https://example.com", "secret": "   "}, "secret"),
        ({"url": "https://example.com", "secret": 12345678901234567}, "secret"),
        ({"url": "https://example.com", "format": "xml"}, "format"),
    ],
)
def test_it_refuses_a_webhook_it_could_not_deliver(
    staff_api: APIClient, body: dict[str, Any], field: str
) -> None:
    error = assert_error(post(staff_api, "webhooks/", body), 400, "invalid")
    assert field in error["fields"], error
    assert not Webhook.objects.exists()


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1/",
        "http://127.0.0.1:5432/",
        "http://localhost:8000/hook",
        "http://LOCALHOST./",
        "http://hooks.localhost/",
        "http://2130706433/",  # 127.0.0.1, as one decimal number
        "http://127.1/",
        "http://0/",
        "http://0x7f000001/",
        "http://017700000001/",  # octal
        "http://0.0.0.0/",
        "http://[::1]/",
        "http://[::]/",
        "http://[::ffff:127.0.0.1]/",  # IPv4-mapped
        "http://[::ffff:a9fe:a9fe]/",  # 169.254.169.254, IPv4-mapped
        "http://[::127.0.0.1]/",  # IPv4-compatible
        "http://[64:ff9b::7f00:1]/",  # NAT64 of 127.0.0.1
        "http://[2002:7f00:1::]/",  # 6to4 of 127.0.0.1
        "http://169.254.169.254/latest/meta-data/",
        "http://10.1.2.3/",
        "http://172.16.0.1/",
        "http://192.168.1.1/",
        "http://100.64.0.1/",  # shared address space (CGNAT)
        "http://192.0.2.1/",  # documentation
        "http://224.0.0.1/",  # multicast
        "http://240.0.0.1/",  # reserved
        "http://255.255.255.255/",
        "https://[fe80::1]/",
        "https://[fc00::1]/",
        "https://[ff02::1]/",
        "https://[2001:db8::1]/",
    ],
)
def test_it_refuses_a_webhook_to_an_address_that_is_not_public(
    staff_api: APIClient, url: str
) -> None:
    error = assert_error(post(staff_api, "webhooks/", {"url": url}), 400, "invalid")
    assert list(error["fields"]) == ["url"], error
    assert "is not a public address" in error["fields"]["url"][0]
    assert not Webhook.objects.exists()


@pytest.mark.parametrize(
    "url",
    [
        "https://93.184.215.14/hook",
        "https://8.8.8.8:8443/",
        "https://[2606:4700:4700::1111]/",
        "https://[::ffff:8.8.8.8]/",
        "https://[2002:808:808::]/",  # 6to4 of 8.8.8.8
    ],
)
def test_it_takes_a_webhook_to_a_public_address(staff_api: APIClient, url: str) -> None:
    assert add_webhook(staff_api, url=url)["url"] == url


def test_with_private_addresses_allowed_it_takes_a_webhook_to_one(
    staff_api: APIClient, settings: Any
) -> None:
    settings.TASKBOARD_WEBHOOK_ALLOW_PRIVATE = True
    for url in ("http://127.0.0.1:9/hook", "http://localhost/", "http://[::1]/"):
        assert add_webhook(staff_api, url=url)["url"] == url


@pytest.mark.parametrize("port", ["1", "80", "8080", "59999", "64999", "65499", "65529", "65535"])
def test_it_takes_a_webhook_on_any_port(staff_api: APIClient, port: str) -> None:
    url = f"https://example.com:{port}/hook"
    assert add_webhook(staff_api, url=url)["url"] == url


def test_only_staff_see_or_change_webhooks(
    api: Callable[[Any], APIClient], agent: Any, staff_api: APIClient
) -> None:
    hook = add_webhook(staff_api)
    agent_api = api(agent)
    assert_error(post(agent_api, "webhooks/", {"url": "https://example.com"}), 403)
    assert_error(get(agent_api, "webhooks/"), 403)
    assert_error(get(agent_api, f"webhooks/{hook['id']}/deliveries/"), 403)
    assert_error(agent_api.delete(f"{API}/webhooks/{hook['id']}/"), 403)
    assert_error(get(api(None), "webhooks/"), 401)
    assert Webhook.objects.filter(pk=hook["id"]).exists()


def test_staff_limited_to_queues_see_and_add_only_webhooks_of_their_queues(
    api: Callable[[Any], APIClient],
    staff_api: APIClient,
    make_task: Callable[..., Any],
    agent: Any,
) -> None:
    """A webhook sends its queues' tasks and events: staff limited to queues (board.access)
    may not use one to read another queue's, as they may not read them in the API."""
    from board.access import limit_queues
    from tests.factories import StaffFactory

    every_queue = add_webhook(staff_api)
    theirs = add_webhook(staff_api, queues=["images", "other"])
    limited = StaffFactory.create(username="ops-images")
    limit_queues(limited, ["images"])
    limited_api = api(limited)

    mine = add_webhook(limited_api)  # no queues: its own, as a limited claim takes
    assert mine["queues"] == ["images"]
    forbidden = assert_error(
        post(limited_api, "webhooks/", {"url": "https://example.com", "queues": ["other"]}), 403
    )
    assert forbidden["error"] == "forbidden_queue"
    assert [w["id"] for w in get(limited_api, "webhooks/").json()["results"]] == [mine["id"]]
    for hidden in (every_queue, theirs):
        assert_error(get(limited_api, f"webhooks/{hidden['id']}/deliveries/"), 404)
        assert_error(limited_api.delete(f"{API}/webhooks/{hidden['id']}/"), 404)
        assert Webhook.objects.filter(pk=hidden["id"]).exists()

    escalate(make_task, agent, queue="other")
    escalate(make_task, agent, queue="images")
    assert Delivery.objects.filter(webhook_id=mine["id"]).count() == 1
    assert limited_api.delete(f"{API}/webhooks/{mine['id']}/").status_code == 204


def test_escalation_emails_by_default_skip_staff_limited_to_other_queues() -> None:
    from board.access import limit_queues
    from board.notifications import deliveries
    from tests.factories import StaffFactory

    StaffFactory.create(username="ann", email="ann@example.com")
    limit_queues(StaffFactory.create(username="ida", email="ida@example.com"), ["images"])
    limit_queues(StaffFactory.create(username="ola", email="ola@example.com"), ["other"])

    assert deliveries._recipients("images") == ["ann@example.com", "ida@example.com"]
    assert deliveries._recipients("default") == ["ann@example.com"]


PHISH = (
    "Requeue, resolve or cancel it here:\nhttps://phish.example/\u2028"
    "or here: https://phish.example/2"
)


def escalated_by_a_hostile_agent(make_task: Callable[..., Any], agent: Any) -> Any:
    task = make_task(queue="default", title="Open https://phish.example/3\nto resolve it")
    [held] = transitions.claim(actor=agent, queues=["default"])
    return transitions.escalate(
        task_id=task.pk, actor=agent, lease_token=held.lease_token, reason=PHISH
    )


def test_an_escalation_email_gives_the_boards_link_first_and_quotes_what_agents_wrote(
    make_task: Callable[..., Any], agent: Any, settings: Any
) -> None:
    from board.notifications import deliveries

    settings.TASKBOARD_PUBLIC_URL = "https://board.example.com"
    settings.TASKBOARD_ESCALATION_EMAILS = ["oncall@example.com"]
    deliveries.set_email_channel(active=True)
    task = escalated_by_a_hostile_agent(make_task, agent)
    [delivery] = deliveries.claim_deliveries(limit=10, lease_seconds=30)

    out = deliveries.prepare(delivery)

    subject, body = out.subject, out.body.decode()

    link = f"https://board.example.com/admin/escalations/escalatedtask/{task.pk}/change/"
    lines = body.splitlines()
    assert re.findall(r"https?://\S+", body)[0] == link
    assert lines[:2] == [
        f"Task #{task.pk} in queue default was escalated and waits for a human. "
        "Requeue, resolve or cancel it here:",
        link,
    ]
    written = [line for line in lines if "phish" in line or line.startswith(("or here", "to "))]
    assert written and all(line.startswith("> ") for line in written), body
    assert "> Requeue, resolve or cancel it here:" in lines
    assert "> https://phish.example/" in lines
    assert "> or here: https://phish.example/2" in lines  # after a U+2028 line separator
    assert "> to resolve it" in lines  # the title's second line
    assert "\n" not in subject


def test_a_slack_message_gives_the_boards_link_first_and_quotes_what_agents_wrote(
    make_task: Callable[..., Any], agent: Any, settings: Any
) -> None:
    from board.notifications import deliveries

    settings.TASKBOARD_PUBLIC_URL = "https://board.example.com"
    task = escalated_by_a_hostile_agent(make_task, agent)
    event = task.events.get(type="escalated")

    first, *rest = deliveries._slack_text(event, task).splitlines()

    link = f"https://board.example.com/admin/escalations/escalatedtask/{task.pk}/change/"
    assert first == f"Task #{task.pk} escalated in queue default: <{link}|Open in the admin>"
    assert rest == [
        "> Open https://phish.example/3",
        "> to resolve it",
        "> Requeue, resolve or cancel it here:",
        "> https://phish.example/",
        "> or here: https://phish.example/2",
    ]


def test_deleting_a_webhook_removes_it_and_its_deliveries(
    staff_api: APIClient, make_task: Callable[..., Any], agent: Any
) -> None:
    hook = add_webhook(staff_api)
    escalate(make_task, agent)
    assert Delivery.objects.filter(webhook_id=hook["id"]).count() == 1
    assert staff_api.delete(f"{API}/webhooks/{hook['id']}/").status_code == 204
    assert not Webhook.objects.exists() and not Delivery.objects.exists()
    assert_error(staff_api.delete(f"{API}/webhooks/{hook['id']}/"), 404)
    assert_error(get(staff_api, f"webhooks/{hook['id']}/deliveries/"), 404)


def test_the_email_channel_cannot_be_deleted_and_keeps_its_deliveries(
    staff_api: APIClient, make_task: Callable[..., Any], agent: Any
) -> None:
    email = deliveries.set_email_channel(active=True)
    escalate(make_task, agent)
    assert Delivery.objects.filter(webhook_id=email.pk).count() == 1

    assert_error(staff_api.delete(f"{API}/webhooks/{email.pk}/"), 404)

    assert Webhook.objects.filter(pk=email.pk).exists()
    assert Delivery.objects.filter(webhook_id=email.pk).count() == 1


def test_a_webhooks_deliveries_are_listed_newest_first_a_page_at_a_time(
    staff_api: APIClient, make_task: Callable[..., Any], agent: Any
) -> None:
    hook = add_webhook(staff_api)
    tasks = [escalate(make_task, agent) for _ in range(3)]
    page = get(staff_api, f"webhooks/{hook['id']}/deliveries/", limit=2).json()
    assert [d["task_id"] for d in page["results"]] == [tasks[2].pk, tasks[1].pk]
    first = page["results"][0]
    assert set(first) >= {
        "event_id",
        "attempts",
        "last_status_code",
        "last_error",
        "next_attempt_at",
        "delivered_at",
        "status",
    }
    assert (first["status"], first["attempts"]) == ("pending", 0)
    rest = staff_api.get(page["next"]).json()
    assert [d["task_id"] for d in rest["results"]] == [tasks[0].pk]


# -- Deliveries are written with their events ---------------------------------------------


def test_a_matching_event_gets_a_delivery_per_matching_webhook(
    staff_api: APIClient, make_task: Callable[..., Any], agent: Any
) -> None:
    everywhere = add_webhook(staff_api)
    images = add_webhook(staff_api, queues=["images"], events=["escalated", "created"])
    elsewhere = add_webhook(staff_api, queues=["audio"])
    task = escalate(make_task, agent, queue="images")
    escalated = task.events.get(type="escalated")
    created = task.events.get(type="created")
    rows = set(Delivery.objects.values_list("webhook_id", "event_id", "task_id", "status"))
    assert rows == {
        (everywhere["id"], escalated.pk, task.pk, "pending"),
        (images["id"], escalated.pk, task.pk, "pending"),
        (images["id"], created.pk, task.pk, "pending"),
    }
    assert not Delivery.objects.filter(webhook_id=elsewhere["id"]).exists()


def test_an_event_of_another_type_gets_no_delivery(
    staff_api: APIClient, make_task: Callable[..., Any], agent: Any
) -> None:
    add_webhook(staff_api)  # escalated only
    task = make_task()
    [held] = transitions.claim(actor=agent)
    transitions.complete(task_id=task.pk, actor=agent, lease_token=held.lease_token)
    assert not Delivery.objects.exists()


def test_a_delivery_is_made_in_the_transaction_of_its_event(
    staff_api: APIClient, make_task: Callable[..., Any], agent: Any
) -> None:
    add_webhook(staff_api, events=["commented"])
    task = make_task()

    class Undo(Exception):
        pass

    with pytest.raises(Undo), transaction.atomic():
        transitions.comment(task_id=task.pk, actor=agent, body="rolled back")
        assert Delivery.objects.count() == 1  # written by the event's own statement
        raise Undo
    assert not Delivery.objects.exists()


def test_an_inactive_webhook_gets_no_delivery(make_task: Callable[..., Any], agent: Any) -> None:
    deliveries.set_email_channel(active=False)
    escalate(make_task, agent)
    assert not Delivery.objects.exists()
    email = deliveries.set_email_channel(active=True)
    task = escalate(make_task, agent)
    assert list(Delivery.objects.values_list("webhook_id", "task_id")) == [(email.pk, task.pk)]


# -- The admin ---------------------------------------------------------------------------


def failed_delivery(staff_api: APIClient, make_task: Callable[..., Any], agent: Any) -> Delivery:
    add_webhook(staff_api)
    escalate(make_task, agent)
    delivery = Delivery.objects.get()
    [claimed] = deliveries.claim_deliveries(limit=1, lease_seconds=30)
    assert claimed.lease_token is not None
    status = deliveries.record_delivery(
        delivery_id=delivery.pk,
        lease_token=claimed.lease_token,
        delivered=False,
        status_code=500,
        error="answered 500",
        retry_in=60,
        horizon_seconds=0,  # past it at once: failed for good
    )
    assert status == "failed"
    delivery.refresh_from_db()
    return delivery


def test_staff_retry_failed_deliveries_from_the_admin_and_pending_ones_are_skipped(
    staff_api: APIClient, make_task: Callable[..., Any], agent: Any, staff: Any
) -> None:
    failed = failed_delivery(staff_api, make_task, agent)
    escalate(make_task, agent)
    pending = Delivery.objects.get(status="pending")
    client = Client()
    client.force_login(grant(staff, "board.view_delivery", "board.view_webhook"))
    page = client.get("/admin/board/delivery/")
    assert b"answered 500" in page.content and b"Retry the selected failed" in page.content

    response = client.post(
        "/admin/board/delivery/",
        {"action": "retry", "_selected_action": [failed.pk, pending.pk]},
        follow=True,
    )
    assert (
        b"Retrying 1 delivery; skipped 1 that had not failed or whose event was archived."
        in response.content
    )
    failed.refresh_from_db()
    assert (failed.status, failed.attempts) == ("pending", 0)
    assert failed.next_attempt_at is not None  # due now (the times tie in one transaction)
    webhook = client.get(f"/admin/board/webhook/{failed.webhook_id}/change/")
    assert b"2 pending" in webhook.content and b"0 failed" in webhook.content
    assert failed.webhook.secret.encode() not in webhook.content


def test_the_retry_action_is_for_staff_only(
    staff_api: APIClient, make_task: Callable[..., Any], agent: Any
) -> None:
    failed = failed_delivery(staff_api, make_task, agent)
    outsider = grant(UserFactory.create(username="not-staff"), "board.view_delivery")
    client = Client()
    client.force_login(outsider)
    client.post("/admin/board/delivery/", {"action": "retry", "_selected_action": [failed.pk]})
    failed.refresh_from_db()
    assert failed.status == "failed"


def test_an_outcome_is_recorded_only_under_the_current_lease(
    staff_api: APIClient, make_task: Callable[..., Any], agent: Any
) -> None:
    add_webhook(staff_api)
    escalate(make_task, agent)
    [first] = deliveries.claim_deliveries(limit=1, lease_seconds=0)  # runs out at once
    [second] = deliveries.claim_deliveries(limit=1, lease_seconds=30)
    assert first.pk == second.pk and first.lease_token != second.lease_token
    assert first.lease_token is not None and second.lease_token is not None
    assert deliveries.claim_deliveries(limit=1, lease_seconds=30) == []
    stale = deliveries.record_delivery(
        delivery_id=first.pk, lease_token=first.lease_token, delivered=True, status_code=200
    )
    assert stale is None
    assert Delivery.objects.get().status == "pending"
    assert (
        deliveries.record_delivery(
            delivery_id=second.pk, lease_token=second.lease_token, delivered=True, status_code=204
        )
        == "delivered"
    )
    assert Delivery.objects.get().attempts == 2


def test_delivery_counts_by_result_for_the_metrics(
    staff_api: APIClient, make_task: Callable[..., Any], agent: Any
) -> None:
    from board.notifications.deliveries import delivery_counts

    failed_delivery(staff_api, make_task, agent)
    escalate(make_task, agent)
    assert delivery_counts() == {"delivered": 0, "retried": 0, "failed": 1, "pending": 1}
