"""Deliveries across real server processes: one killed with SIGKILL mid-delivery (its
lease runs out and the restarted server delivers), and two serving at once (each delivery
made once)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest

from board import transitions
from board.models import Delivery
from board.notifications import deliveries
from tests.factories import TaskFactory, UserFactory
from tests.processes import ServeProcess, eventually
from tests.receivers import HOLD, WebhookReceiver

pytestmark = [pytest.mark.slow, pytest.mark.once, pytest.mark.django_db(transaction=True)]

SECRET = "a-receivers-shared-secret-0123456789"
# A delivery's lease is 2 x the timeout + 5 s: 11 s here.
QUICK = {
    "TASKBOARD_WEBHOOK_TIMEOUT_SECONDS": "3",
    "TASKBOARD_DELIVERY_BACKOFF_SECONDS": "1",
    "TASKBOARD_DELIVERY_MAX_BACKOFF_SECONDS": "1",
    # The receiver listens on 127.0.0.1, which webhooks may reach only so.
    "TASKBOARD_WEBHOOK_ALLOW_PRIVATE": "true",
}


def escalate_tasks(count: int) -> list[int]:
    """Escalate ``count`` new tasks; return the ids of their escalated events."""
    agent = UserFactory.create(username="agent-smith")
    for _ in range(count):
        TaskFactory.create(created_by=agent)
    ids = []
    for held in transitions.claim(actor=agent, limit=count):
        task = transitions.escalate(
            task_id=held.task.pk, actor=agent, lease_token=held.lease_token, reason="help"
        )
        ids.append(task.events.get(type="escalated").pk)
    return ids


def test_a_delivery_cut_off_by_a_killed_server_is_made_after_a_restart(
    start_serve: Callable[..., ServeProcess],
) -> None:
    staff = UserFactory.create(username="ops-alice", is_staff=True)
    with WebhookReceiver(HOLD) as receiver:
        deliveries.create_webhook(
            actor=staff, url=receiver.url, events=["escalated"], queues=None, secret=SECRET
        )
        # One process: SIGKILL of `serve --workers N` would kill only the supervisor, and
        # leave its workers (the sender among them) running.
        first = start_serve("--workers", "1", **QUICK)
        [event_id] = escalate_tasks(1)
        eventually(lambda: receiver.received, timeout=20, what="the first attempt")
        first.process.kill()  # SIGKILL while the receiver holds the request open
        first.process.wait(10)
        held = Delivery.objects.get()
        assert (held.status, held.attempts) == ("pending", 1)
        assert held.lease_token is not None  # the lease the killed server left behind
        receiver.released.set()

        start_serve(**QUICK)
        eventually(lambda: receiver.accepted(), timeout=40, what="the delivery after restart")
        # The receiver answered; the server records that an instant later.
        delivered = eventually(
            lambda: Delivery.objects.filter(status="delivered").first(), what="recorded"
        )
        assert (delivered.status, delivered.attempts) == ("delivered", 2)
        assert [r.event_id for r in receiver.received] == [event_id, event_id]
        assert all(r.signature_verifies(SECRET) for r in receiver.received)


def test_two_server_processes_make_each_delivery_once(
    start_serve: Callable[..., ServeProcess],
) -> None:
    staff = UserFactory.create(username="ops-alice", is_staff=True)
    with WebhookReceiver(*[("slow", 0.2)] * 10) as receiver:
        hook = deliveries.create_webhook(
            actor=staff, url=receiver.url, events=["escalated"], queues=None, secret=SECRET
        )
        servers = [start_serve(**QUICK), start_serve(**QUICK)]
        event_ids: list[int] = []
        for _ in range(4):
            event_ids += escalate_tasks(10)

        def settled() -> bool:
            return not Delivery.objects.filter(webhook=hook, status="pending").exists()

        eventually(settled, timeout=60, what="every delivery made")
        assert Counter(r.event_id for r in receiver.received) == Counter(event_ids)
        assert set(Delivery.objects.values_list("status", "attempts")) == {("delivered", 1)}
        assert all(s.process.poll() is None for s in servers)
