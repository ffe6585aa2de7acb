"""Deliveries made by a live server's dispatcher (board.notifications.deliveries) to real
receivers: an HTTP server that fails, times out and recovers, and an SMTP server."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest

from board import transitions
from board.models import Delivery, Webhook
from board.notifications import deliveries
from tests.live import LiveServer, free_port, live_server
from tests.processes import eventually
from tests.receivers import WebhookReceiver, smtp_receiver

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

SECRET = "a-receivers-shared-secret-0123456789"


@pytest.fixture(autouse=True)
def local_receivers(settings: Any) -> Any:
    """The receivers here listen on 127.0.0.1, which webhooks may reach only so."""
    settings.TASKBOARD_WEBHOOK_ALLOW_PRIVATE = True
    return settings


@pytest.fixture
def quick(settings: Any) -> Any:
    """Deliveries time out after 1 s and are retried within a second."""
    settings.TASKBOARD_WEBHOOK_TIMEOUT_SECONDS = 1
    settings.TASKBOARD_DELIVERY_BACKOFF_SECONDS = 1
    settings.TASKBOARD_DELIVERY_MAX_BACKOFF_SECONDS = 1
    settings.TASKBOARD_PUBLIC_URL = "https://board.example.com"
    return settings


@pytest.fixture
def board(quick: Any) -> Iterator[LiveServer]:
    with live_server() as server:
        yield server


def escalate(make_task: Callable[..., Any], agent: Any, queue: str = "default") -> Any:
    task = make_task(queue=queue, title=f"resize in {queue}")
    [held] = transitions.claim(actor=agent, queues=[queue])
    transitions.fail(task_id=task.pk, actor=agent, lease_token=held.lease_token, error="disk full")
    [held] = transitions.claim(actor=agent, queues=[queue])
    return transitions.escalate(
        task_id=task.pk, actor=agent, lease_token=held.lease_token, reason="needs a human"
    )


def settled(*webhooks: Webhook) -> bool:
    return not Delivery.objects.filter(webhook__in=webhooks, status="pending").exists()


def test_every_matching_event_arrives_signed_through_failures_and_timeouts(
    board: LiveServer, make_task: Callable[..., Any], agent: Any, staff: Any
) -> None:
    with WebhookReceiver(500, ("slow", 2.5), 503) as receiver:
        hook = deliveries.create_webhook(
            actor=staff, url=receiver.url, events=["escalated"], queues=None, secret=SECRET
        )
        tasks = [escalate(make_task, agent) for _ in range(4)]
        transitions.comment(task_id=tasks[0].pk, actor=agent, body="not sent: not escalated")
        eventually(lambda: settled(hook), timeout=30, what="every delivery settled")

        events = {t.events.get(type="escalated").pk: t for t in tasks}
        accepted = receiver.accepted()
        # At least once, and once only: nothing crashed.
        assert Counter(r.event_id for r in accepted) == Counter(list(events))
        assert all(r.signature_verifies(SECRET) for r in receiver.received)
        assert not any(r.signature_verifies("another secret") for r in receiver.received)
        assert len(receiver.received) == len(events) + 3  # the 500, the slow one, the 503
        for r in accepted:
            body = r.json
            assert r.headers["Content-Type"] == "application/json"
            assert body["event"]["id"] == r.event_id and body["event"]["type"] == "escalated"
            task = events[r.event_id]
            assert body["task"]["id"] == task.pk and body["task"]["status"] == "escalated"
            assert body["task"]["last_error"] == "needs a human"
            assert "lease_token" not in body["task"]
        assert set(Delivery.objects.values_list("status", flat=True)) == {"delivered"}
        retried = Delivery.objects.filter(attempts__gt=1)
        assert retried.count() >= 2  # the deliveries that met the 500, the timeout, the 503
        assert all(d.last_status_code == 200 for d in Delivery.objects.all())


def test_a_slack_webhook_gets_text_with_a_link_to_the_tasks_admin_page(
    board: LiveServer, make_task: Callable[..., Any], agent: Any, staff: Any
) -> None:
    with WebhookReceiver() as receiver:
        hook = deliveries.create_webhook(
            actor=staff,
            url=receiver.url,
            events=["escalated"],
            queues=["images"],
            secret=SECRET,
            format="slack",
        )
        escalate(make_task, agent, queue="audio")  # another queue: not sent
        task = escalate(make_task, agent, queue="images")
        eventually(lambda: settled(hook) and receiver.accepted(), timeout=20, what="delivery")
        [received] = receiver.received
        link = f"https://board.example.com/admin/escalations/escalatedtask/{task.pk}/change/"
        assert received.json == {
            "text": f"Task #{task.pk} escalated in queue images: <{link}|Open in the admin>\n"
            "> resize in images\n> needs a human"
        }


def test_a_delivery_to_an_address_that_is_not_public_is_refused_and_tells_no_port_apart(
    board: LiveServer, make_task: Callable[..., Any], agent: Any, staff: Any, settings: Any
) -> None:
    """Webhooks added when private addresses were allowed (or whose name resolves to one
    now) are refused at delivery, before any connection: the receiver gets nothing, and an
    open port and a closed one are recorded alike."""
    settings.TASKBOARD_WEBHOOK_ALLOW_PRIVATE = False
    with WebhookReceiver() as receiver:
        closed = free_port()
        urls = [
            receiver.url,  # open
            f"http://2130706433:{receiver.port}/hook",  # open, 127.0.0.1 spelt otherwise
            f"http://127.0.0.1:{closed}/hook",  # closed
        ]
        hooks = [
            deliveries.create_webhook(
                actor=staff, url=url, events=["escalated"], queues=None, secret=SECRET
            )
            for url in urls
        ]
        escalate(make_task, agent)
        eventually(
            lambda: not Delivery.objects.filter(status="pending", last_error=None).exists(),
            timeout=20,
            what="an attempt of every delivery recorded",
        )

        assert receiver.received == []
        recorded = {
            (d.status, d.last_status_code, d.last_error)
            for d in Delivery.objects.filter(webhook__in=hooks)
        }
        assert recorded == {("pending", None, "refused: address 127.0.0.1 is not public")}


def test_a_delivery_past_its_horizon_fails_and_a_staff_retry_rearms_it(
    quick: Any, make_task: Callable[..., Any], agent: Any, staff: Any
) -> None:
    quick.TASKBOARD_DELIVERY_HORIZON_SECONDS = 2
    with WebhookReceiver(then=500) as receiver, live_server():
        hook = deliveries.create_webhook(
            actor=staff, url=receiver.url, events=["escalated"], queues=None, secret=SECRET
        )
        escalate(make_task, agent)
        eventually(lambda: settled(hook), timeout=20, what="the delivery gave up")
        [delivery] = Delivery.objects.all()
        assert delivery.status == "failed"
        assert (delivery.last_status_code, delivery.last_error) == (500, "answered 500")
        assert delivery.attempts == len(receiver.received) >= 2
        assert delivery.next_attempt_at is None

        receiver.then = 200
        assert deliveries.retry_deliveries(delivery_ids=[delivery.pk], actor=staff) == 1
        eventually(lambda: settled(hook), timeout=10, what="the retry was delivered")
        delivery.refresh_from_db()
        assert (delivery.status, delivery.attempts, delivery.last_status_code) == (
            "delivered",
            1,
            200,
        )
        assert delivery.delivered_at is not None
        assert deliveries.retry_deliveries(delivery_ids=[delivery.pk], actor=staff) == 0


def fail_attempt(delivery: Delivery, *, retry_in: float, horizon_seconds: float) -> str | None:
    """Record that the attempt made under ``delivery``'s lease failed with a 500."""
    assert delivery.lease_token is not None
    return deliveries.record_delivery(
        delivery_id=delivery.pk,
        lease_token=delivery.lease_token,
        delivered=False,
        status_code=500,
        error="answered 500",
        retry_in=retry_in,
        horizon_seconds=horizon_seconds,
    )


def test_a_retry_that_would_land_past_the_horizon_is_made_at_the_horizon(
    make_task: Callable[..., Any], agent: Any, staff: Any
) -> None:
    deliveries.create_webhook(
        actor=staff, url="http://127.0.0.1:9/hook", events=["escalated"], queues=None, secret=SECRET
    )
    escalate(make_task, agent)
    [first] = deliveries.claim_deliveries(limit=1, lease_seconds=30)

    assert fail_attempt(first, retry_in=60, horizon_seconds=1) == "pending"
    first.refresh_from_db()
    assert first.next_attempt_at == first.armed_at + timedelta(seconds=1)

    # The last attempt, at the horizon: when it fails, the delivery has failed for good.
    [last] = eventually(
        lambda: deliveries.claim_deliveries(limit=1, lease_seconds=30), what="due at the horizon"
    )
    assert fail_attempt(last, retry_in=60, horizon_seconds=1) == "failed"
    last.refresh_from_db()
    assert (last.status, last.attempts, last.next_attempt_at) == ("failed", 2, None)


def test_a_receiver_that_keeps_failing_is_tried_at_the_horizon_before_the_delivery_fails(
    quick: Any,
    make_task: Callable[..., Any],
    agent: Any,
    staff: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every backoff lands past the horizon (as a long jittered one near its end does):
    the attempt at +0 s is followed by one at the horizon, not by giving up."""
    quick.TASKBOARD_DELIVERY_HORIZON_SECONDS = 3
    monkeypatch.setattr(deliveries, "backoff_seconds", lambda attempts, rng=None: 60.0)
    with WebhookReceiver(then=500) as receiver, live_server():
        hook = deliveries.create_webhook(
            actor=staff, url=receiver.url, events=["escalated"], queues=None, secret=SECRET
        )
        escalate(make_task, agent)
        eventually(lambda: settled(hook), timeout=20, what="the delivery gave up")
    [delivery] = Delivery.objects.all()
    assert (delivery.status, delivery.attempts) == ("failed", 2)
    first, last = receiver.received
    assert 2.5 <= last.at - first.at < 5


def test_the_backoff_ceiling_doubles_with_each_attempt_up_to_its_cap(settings: Any) -> None:
    settings.TASKBOARD_DELIVERY_BACKOFF_SECONDS = 10
    settings.TASKBOARD_DELIVERY_MAX_BACKOFF_SECONDS = 3600
    rng = random.Random(12)
    for attempts, ceiling in [(1, 10), (2, 20), (3, 40), (6, 320), (12, 3600), (60, 3600)]:
        delays = [deliveries.backoff_seconds(attempts, rng) for _ in range(500)]
        assert min(delays) >= 0 and max(delays) <= ceiling
        assert max(delays) > 0.9 * ceiling  # full jitter spreads over the whole range
        assert min(delays) < 0.1 * ceiling


def test_an_escalation_is_emailed_with_its_last_error_and_a_link(
    quick: Any, make_task: Callable[..., Any], agent: Any, staff: Any
) -> None:
    with smtp_receiver() as (port, inbox):
        quick.EMAIL_URL = f"smtp://127.0.0.1:{port}"
        quick.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
        quick.EMAIL_HOST, quick.EMAIL_PORT = "127.0.0.1", port
        quick.TASKBOARD_ESCALATION_EMAILS = ["oncall@example.com", "lead@example.com"]
        with live_server():
            email = eventually(
                lambda: Webhook.objects.filter(kind="email", active=True).first(),
                what="the server turned the emails on",
            )
            task = escalate(make_task, agent)
            eventually(lambda: inbox, timeout=20, what="an email")
            eventually(lambda: settled(email), timeout=5, what="the delivery recorded")
        [message] = inbox
        assert message["Subject"] == f"[Taskboard] Task #{task.pk} escalated: resize in default"
        assert message["X-Envelope-To"] == "oncall@example.com, lead@example.com"
        payload = message.get_payload(decode=True)
        assert isinstance(payload, bytes)
        text = payload.decode().replace("\r\n", "\n")
        assert "\nLast error:\n> needs a human\n" in text
        assert "\nReason:\n> needs a human\n" in text
        assert (
            f"https://board.example.com/admin/escalations/escalatedtask/{task.pk}/change/" in text
        )
        assert Delivery.objects.get(webhook=email).status == "delivered"

    # Without EMAIL_URL, the next server turns them off again.
    quick.EMAIL_URL = ""
    with live_server():
        eventually(
            lambda: not Webhook.objects.filter(kind="email", active=True).exists(),
            what="the emails turned off",
        )


def test_an_smtp_server_too_slow_for_the_timeout_gets_no_email_it_would_get_again(
    settings: Any,
) -> None:
    """Each of its answers comes within the timeout, the whole session does not: the
    attempt fails, and the email is not sent after all (the retry sends it). It was: the
    thread went on with the session after the attempt had given up on it, and a slow
    server got one copy per retry. The deadline runs from the attempt, not from when its
    thread starts."""
    import concurrent.futures

    import httpx

    settings.TASKBOARD_WEBHOOK_TIMEOUT_SECONDS = 2
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    out = deliveries.Outgoing(
        1, uuid.uuid4(), 0, kind="email", subject="s", body=b"b", recipients=["a@example.com"]
    )

    async def attempt(busy_for: float = 0) -> tuple[bool, int | None, str | None]:
        # With busy_for, the thread that would send waits that long for the only worker.
        loop = asyncio.get_running_loop()
        loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=1))
        if busy_for:
            loop.run_in_executor(None, time.sleep, busy_for)
        async with httpx.AsyncClient() as client:
            return await deliveries.attempt(out, client)

    for delay, busy_for in ((1.2, 0), (0.3, 2.5)):
        with smtp_receiver(delay=delay) as (port, inbox):
            settings.EMAIL_HOST, settings.EMAIL_PORT = "127.0.0.1", port
            started = time.monotonic()
            delivered, _, error = asyncio.run(attempt(busy_for))
            took = time.monotonic() - started
            time.sleep(2.5)  # long enough for a session that went on to finish
            assert inbox == [], (delay, busy_for)
            assert not delivered and "time" in str(error).lower(), error
            assert took < 3.5, took

    with smtp_receiver(delay=0.1) as (port, inbox):  # slow, but within the timeout
        settings.EMAIL_HOST, settings.EMAIL_PORT = "127.0.0.1", port
        assert asyncio.run(attempt())[0]
        assert len(inbox) == 1


def test_emails_queued_while_email_was_on_fail_when_it_is_turned_off(
    make_task: Callable[..., Any], agent: Any, staff: Any
) -> None:
    """With EMAIL_URL unset ("no email"), an email queued before is not sent (it was,
    through Django's default, localhost:25) nor kept for weeks: it fails, and staff may
    retry it; retried while email is off, it waits for email to be on."""
    email = deliveries.set_email_channel(active=True)
    escalate(make_task, agent)
    [queued] = Delivery.objects.filter(webhook=email)
    deliveries.set_email_channel(active=False)

    queued.refresh_from_db()
    assert (queued.status, queued.last_error) == ("failed", "not sent: EMAIL_URL was unset")
    assert deliveries.retry_deliveries(delivery_ids=[queued.pk], actor=staff) == 1
    assert deliveries.claim_deliveries(limit=10, lease_seconds=30) == []
    assert deliveries.next_due() is None

    deliveries.set_email_channel(active=True)
    assert deliveries.next_due() == 0.0
    [claimed] = deliveries.claim_deliveries(limit=10, lease_seconds=30)
    assert claimed.pk == queued.pk


def test_escalation_emails_go_to_active_staff_with_an_email_by_default(
    quick: Any, make_task: Callable[..., Any], agent: Any
) -> None:
    from tests.factories import StaffFactory, UserFactory

    StaffFactory.create(username="ann", email="ann@example.com")
    StaffFactory.create(username="bob", email="bob@example.com", is_active=False)
    StaffFactory.create(username="cyd", email="")
    UserFactory.create(username="dee", email="dee@example.com")
    with smtp_receiver() as (port, inbox):
        quick.EMAIL_URL = f"smtp://127.0.0.1:{port}"
        quick.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
        quick.EMAIL_HOST, quick.EMAIL_PORT = "127.0.0.1", port
        with live_server():
            eventually(lambda: Webhook.objects.filter(kind="email", active=True).exists())
            escalate(make_task, agent)
            eventually(lambda: inbox, timeout=20, what="an email")
        assert [m["X-Envelope-To"] for m in inbox] == ["ann@example.com"]


def test_a_delivery_made_while_the_relay_was_cut_off_is_sent_when_it_reconnects(
    board: LiveServer, make_task: Callable[..., Any], agent: Any, staff: Any
) -> None:
    from django.db import connection

    from board.live import relay as relay_module

    [relay] = [r for loop, r in relay_module._relays.items() if not loop.is_closed()]
    with WebhookReceiver() as receiver:
        hook = deliveries.create_webhook(
            actor=staff, url=receiver.url, events=["escalated"], queues=None, secret=SECRET
        )
        eventually(lambda: relay.connected.is_set(), what="the relay listening")
        reconnects = relay.reconnects
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [relay.backend_pid])
        # Its NOTIFY comes while nobody listens: the reconnect must look for it.
        escalate(make_task, agent)
        eventually(lambda: relay.reconnects > reconnects, what="the relay reconnected")
        eventually(lambda: settled(hook) and receiver.accepted(), timeout=10, what="delivery")
