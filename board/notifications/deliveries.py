"""Telling humans: each server process sends the board's webhooks and escalation emails.

Deliveries are rows (``webhook_deliveries``), made with their event in the same
transaction (the trigger of ``board/sql/schema/deliveries.sql``). Every server process runs
one :class:`Dispatcher` on its event loop, started and stopped with the ASGI lifespan
beside the relay; no other process is needed. The dispatcher:

- wakes when the relay hears that deliveries were made or re-armed (NOTIFY
  webhook_deliveries, at commit), and at the time the next one falls due (a timer set to
  ``min(next_attempt_at)`` of the pending rows, read from a partial index): no polling;
- claims due deliveries with ``FOR UPDATE SKIP LOCKED`` and a lease (:func:`claim_deliveries`),
  so N processes deliver each one once; a process killed mid-delivery leaves a lease that
  runs out, and another (or the restarted one) tries again: at least once;
- POSTs ``{"event": Event, "task": Task}`` as the API renders them, signed, with httpx
  (or a Slack ``{"text": ...}``), or sends the escalation email, or a password reset
  email, through Django's email framework; 2xx within TASKBOARD_WEBHOOK_TIMEOUT_SECONDS
  is success, and for an email, its SMTP session's end within that time;
- records the outcome under the lease token: delivered, or due again after a backoff with
  full jitter (at TASKBOARD_DELIVERY_HORIZON_SECONDS when that would land past it), or
  failed when an attempt at or after the horizon fails.

Database work runs on one thread of the dispatcher's own (Django's connection is per
thread), which closes its connection whenever the dispatcher goes idle.

This module is the only writer of ``webhooks`` and ``webhook_deliveries`` besides the
trigger that makes a delivery with its event: the API, the admin and the pages add and
remove webhooks, queue a password reset and retry deliveries through the functions below,
whose statements are in ``deliveries.sql`` next to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import json
import logging
import random
import smtplib
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.forms import PasswordResetForm
from django.core.mail import EmailMessage, get_connection
from django.core.mail.backends import smtp
from django.db import Error as DatabaseError
from django.db import connection
from django.db.models import Q
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils import timezone

from board import conf, sql
from board.models import (
    Delivery,
    DeliveryResult,
    DeliveryStatus,
    Task,
    TaskEvent,
    TaskStatus,
    Webhook,
    WebhookFormat,
    WebhookKind,
)
from board.notifications import webhook_addresses
from board.notifications.webhook_addresses import AddressRefused
from board.transitions import Actor, actor_name

logger = logging.getLogger(__name__)
T = TypeVar("T")

QUERIES = sql.load(Path(__file__).with_name("deliveries.sql"))

SIGNATURE_HEADER = "Taskboard-Signature"
EVENT_ID_HEADER = "Taskboard-Event-Id"
# A lease covers the attempt (at most the timeout) and recording its outcome.
LEASE_MARGIN_SECONDS = 5
# Deliveries one process has in flight at once.
MAX_IN_FLIGHT = 20
# After a database error, look again this much later.
DATABASE_RETRY_SECONDS = 2.0


def timeout_seconds() -> float:
    return conf.webhook_timeout_seconds()


def lease_seconds() -> float:
    return 2 * timeout_seconds() + LEASE_MARGIN_SECONDS


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """Return the ``Taskboard-Signature`` of ``body`` sent at ``timestamp`` (unix seconds)."""
    digest = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={digest}"


def backoff_seconds(attempts: int, rng: random.Random | None = None) -> float:
    """Return the delay before the next attempt after ``attempts`` failed ones: full jitter,
    uniform in [0, min(MAX_BACKOFF, BACKOFF * 2^(attempts-1))], so that receivers that come
    back are not met by every sender at once."""
    base = conf.delivery_backoff_seconds()
    cap = conf.delivery_max_backoff_seconds()
    ceiling = min(cap, base * 2 ** min(max(attempts, 1) - 1, 40))
    return (rng or random).uniform(0, ceiling)


def admin_url(task: Task) -> str:
    """Return the absolute address of the task's page in the admin: the escalation queue's
    page, which lets someone requeue, resolve or cancel it, while it is escalated."""
    if task.status == TaskStatus.ESCALATED:
        path = reverse("admin:escalations_escalatedtask_change", args=[task.pk])
    else:
        path = reverse("admin:board_task_change", args=[task.pk])
    return f"{conf.public_url()}{path}"


def delivery_counts() -> dict[str, int]:
    """Return webhook and email deliveries by result, for the metrics endpoint.

    ``delivered``, ``retried`` (an attempt that failed and will be tried again) and
    ``failed`` (given up after the horizon) count attempts since the table was made (they
    only grow: Prometheus counters); ``pending`` is how many wait now (a gauge). Reads a
    three-row table and the partial index of pending deliveries: cheap at any size.
    """
    counts = {row.result: row.count for row in DeliveryResult.objects.all()}
    counts["pending"] = Delivery.objects.filter(status=DeliveryStatus.PENDING).count()
    return counts


@dataclass
class Outgoing:
    """A claimed delivery, ready to send (built on the database thread)."""

    delivery_id: int
    lease_token: uuid.UUID
    attempts: int
    kind: str = WebhookKind.WEBHOOK
    url: str = ""
    secret: str = ""
    event_id: int = 0
    body: bytes = b""
    subject: str = ""
    recipients: list[str] = field(default_factory=list)
    # A password reset: its emails (none when the address has no account that may reset).
    reset: bool = False
    emails: list[EmailMessage] = field(default_factory=list)
    # Set when it cannot be sent at all (its event was archived, say): recorded as a failure.
    problem: str | None = None


def quoted(text: str) -> str:
    """Return ``text`` as a quotation in plain text: every line (by any line break a mail
    reader may honour) prefixed with "> ", so that what a task's creator or agent wrote
    cannot pass for the board's own words."""
    return "\n".join(f"> {line}".rstrip() for line in (text.splitlines() or [""]))


def _slack_text(event: TaskEvent, task: Task) -> str:
    def escape(text: str) -> str:  # Slack's mrkdwn: only these three are special
        return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")

    # The board's own words and link first; then what the task's creator and agent wrote,
    # as a quotation, so that it cannot pass for the board's (a link of its own, say).
    lines = [
        f"Task #{task.pk} {event.type} in queue {task.queue}: <{admin_url(task)}|Open in the admin>"
    ]
    written = [task.title]
    if event.type == "escalated" and task.last_error:
        written.append(task.last_error)
    lines.extend(quoted(escape(text)) for text in written)
    return "\n".join(lines)


def _recipients(queue: str) -> list[str]:
    """Who is emailed an escalation in ``queue``: TASKBOARD_ESCALATION_EMAILS, or every
    active staff user with an email who may see that queue (board.access)."""
    if conf.escalation_emails():
        return list(conf.escalation_emails())
    staff = (
        get_user_model()
        .objects.filter(is_active=True, is_staff=True)
        .exclude(email="")
        .filter(Q(queue_limit__isnull=True) | Q(queue_limit__queues__contains=[queue]))
    )
    return sorted(staff.values_list("email", flat=True))


def escalation_email(event: TaskEvent, task: Task) -> tuple[str, str]:
    """Return the subject and plain-text body of the email for escalation ``event``: the
    board's link first, then what the task's creator and agent wrote, quoted."""
    reason = (event.payload or {}).get("reason")
    context = {
        "task": task,
        "event": event,
        "link": admin_url(task),
        # Written by the task's creator and its agent: quoted, after the board's words.
        "title": quoted(task.title),
        "reason": quoted(str(reason)) if reason else None,
        "last_error": None if task.last_error is None else quoted(task.last_error),
    }
    subject = " ".join(render_to_string("board/email/escalated_subject.txt", context).split())
    return subject, render_to_string("board/email/escalated.txt", context)


class PasswordResetEmails(PasswordResetForm):
    """Django's password reset form, whose emails are kept in ``emails`` for the caller to
    send rather than sent one by one (where Django's logs and drops a failure)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.emails: list[EmailMessage] = []

    def send_mail(
        self,
        subject_template_name: str,
        email_template_name: str,
        context: dict[str, Any],
        from_email: str | None,
        to_email: str,
        html_email_template_name: str | None = None,
    ) -> None:
        subject = "".join(render_to_string(subject_template_name, context).splitlines())
        body = render_to_string(email_template_name, context)
        self.emails.append(EmailMessage(subject, body, from_email, [to_email]))


def password_reset_emails(address: str) -> list[EmailMessage]:
    """Return the password reset emails for ``address``: one per active account with that
    email and a usable password, each with a link made now (valid for
    PASSWORD_RESET_TIMEOUT), to the board at TASKBOARD_PUBLIC_URL."""
    form = PasswordResetEmails({"email": address})
    if not form.is_valid():  # checked when it was queued: a row written by hand
        return []
    public = urlsplit(conf.public_url())
    form.save(
        domain_override=public.netloc,
        use_https=public.scheme == "https",
        extra_email_context={"site_name": "Taskboard"},
    )
    return form.emails


def prepare(delivery: Delivery) -> Outgoing:
    """Build what to send for ``delivery``: the event and task as the API renders them now,
    or a password reset's emails."""
    from board.api.serializers import EventSerializer, TaskSerializer, render

    assert delivery.lease_token is not None
    out = Outgoing(
        delivery.pk, delivery.lease_token, delivery.attempts, event_id=delivery.event_id or 0
    )
    if delivery.recipient is not None:
        out.kind, out.reset = WebhookKind.EMAIL, True
        out.emails = password_reset_emails(delivery.recipient)
        return out
    # Not a reset: an event's (the table's check constraint).
    assert delivery.event_id is not None and delivery.task_id is not None
    webhook = Webhook.objects.get(pk=delivery.webhook_id)
    event = TaskEvent.objects.filter(pk=delivery.event_id).first()
    task = Task.objects.filter(pk=delivery.task_id).first()
    out.kind, out.url, out.secret = webhook.kind, webhook.url, webhook.secret
    if event is None or task is None:
        out.problem = f"event {delivery.event_id} is no longer in the log"
        return out
    if webhook.kind == WebhookKind.EMAIL:
        out.subject, body = escalation_email(event, task)
        out.body = body.encode()
        out.recipients = _recipients(task.queue)
        if not out.recipients:
            out.problem = "no recipient: set TASKBOARD_ESCALATION_EMAILS or a staff user's email"
        return out
    if webhook.format == WebhookFormat.SLACK:
        payload: dict[str, Any] = {"text": _slack_text(event, task)}
    else:
        payload = {"event": render(EventSerializer, event), "task": render(TaskSerializer, task)}
    out.body = json.dumps(payload, separators=(",", ":")).encode()
    return out


def claim_and_prepare(limit: int) -> list[Outgoing]:
    """Claim up to ``limit`` due deliveries and build each one's message."""
    prepared = []
    for delivery in claim_deliveries(limit=limit, lease_seconds=lease_seconds()):
        try:
            prepared.append(prepare(delivery))
        except Exception as exc:  # recorded as a failed attempt, retried like any other
            logger.exception("deliveries: could not prepare delivery %s", delivery.pk)
            assert delivery.lease_token is not None
            prepared.append(
                Outgoing(delivery.pk, delivery.lease_token, delivery.attempts, problem=repr(exc))
            )
    return prepared


def next_due() -> float | None:
    """Return the seconds until the next pending delivery falls due, or None if none waits."""
    with connection.cursor() as cursor:
        cursor.execute(QUERIES["next_delivery_due"])
        row = cursor.fetchone()
    if row is None or row[0] is None:
        return None
    return max(0.0, float((row[0] - timezone.now()).total_seconds()))


class _Bounded:
    """One deadline for a whole SMTP session, for ``smtplib.SMTP`` (mixed in before it).

    smtplib's timeout bounds each read and write, so a server that answers every command
    just in time keeps the session going for many timeouts; and a thread cannot be
    stopped from outside, so the attempt that gave up waiting for it would still send the
    email afterwards, and its retry would send it again. Every command and reply goes
    through ``send`` and ``getreply``: each gets what is left of the deadline, and none is
    made past it (the socket is closed, and the attempt fails before the message is
    handed over, when it has not been yet).
    """

    sock: socket.socket | None

    def __init__(self, *args: Any, deadline: float, **kwargs: Any) -> None:
        self.deadline = deadline
        super().__init__(*args, **kwargs)

    def _within_deadline(self) -> None:
        if self.sock is None:  # not connected: smtplib raises SMTPServerDisconnected
            return
        left = self.deadline - time.monotonic()
        if left <= 0:
            self.close()  # type: ignore[attr-defined]
            raise TimeoutError("the SMTP server did not take the email in time")
        self.sock.settimeout(left)

    def send(self, s: Any) -> None:
        self._within_deadline()
        super().send(s)  # type: ignore[misc]

    def getreply(self) -> tuple[int, bytes]:
        self._within_deadline()
        return super().getreply()  # type: ignore[misc,no-any-return]


class _BoundedSMTP(_Bounded, smtplib.SMTP):
    pass


class _BoundedSMTPSSL(_Bounded, smtplib.SMTP_SSL):
    pass


class BoundedEmailBackend(smtp.EmailBackend):
    """Django's SMTP backend, with the whole session (connect to QUIT) done by ``deadline``
    (``time.monotonic()``; :class:`_Bounded`)."""

    def __init__(self, *, deadline: float, **kwargs: Any) -> None:
        super().__init__(timeout=max(deadline - time.monotonic(), 0.001), **kwargs)
        self.deadline = deadline

    @property
    def connection_class(self) -> Any:
        bounded = _BoundedSMTPSSL if self.use_ssl else _BoundedSMTP
        return functools.partial(bounded, deadline=self.deadline)


def send_email(out: Outgoing, deadline: float) -> None:
    """Send the escalation email, or a password reset's emails, through Django's email
    framework (EMAIL_URL), in one session done by ``deadline`` (``time.monotonic()``),
    which the attempt set before this thread started: a thread that started late has less
    time, not more."""
    if out.reset:
        mails = out.emails
    else:
        mails = [EmailMessage(subject=out.subject, body=out.body.decode(), to=out.recipients)]
    if not mails:
        return  # a reset for an address with no account: nothing to send
    if settings.EMAIL_BACKEND == "django.core.mail.backends.smtp.EmailBackend":
        backend: Any = BoundedEmailBackend(deadline=deadline)
    else:  # another backend that settings name (tests: Django's in-memory one)
        backend = get_connection(timeout=timeout_seconds())
    backend.send_messages(mails)


async def attempt(out: Outgoing, client: httpx.AsyncClient) -> tuple[bool, int | None, str | None]:
    """Send one delivery; return (delivered, HTTP status or None, error or None)."""
    if out.problem:
        return False, None, out.problem
    if out.kind == WebhookKind.EMAIL:
        try:
            # The session ends by its own deadline (BoundedEmailBackend): this only bounds
            # another backend, or a thread that could not start in time.
            deadline = time.monotonic() + timeout_seconds()
            await asyncio.wait_for(
                asyncio.to_thread(send_email, out, deadline), timeout_seconds() + 1
            )
        except Exception as exc:  # any refusal by the SMTP server, or none at all
            return False, None, f"email not sent: {exc!r}"[:2000]
        return True, None, None
    timestamp = int(time.time())
    headers = {
        "Content-Type": "application/json",
        EVENT_ID_HEADER: str(out.event_id),
        SIGNATURE_HEADER: sign(out.secret, timestamp, out.body),
        "User-Agent": "Taskboard-Webhooks",
    }
    try:
        # wait_for bounds the whole exchange: httpx's timeout applies to each read.
        response = await asyncio.wait_for(
            client.post(out.url, content=out.body, headers=headers, timeout=timeout_seconds()),
            timeout_seconds(),
        )
    except AddressRefused as refused:
        # Refused before any connection: nothing learnt from the address is recorded.
        return False, None, str(refused)
    except (TimeoutError, httpx.TimeoutException):
        return False, None, f"no answer within {timeout_seconds():g} s"
    except Exception as exc:  # refused, reset, an address httpx cannot use: retried
        return False, None, f"{type(exc).__name__}: {exc}"[:2000]
    if 200 <= response.status_code < 300:
        return True, response.status_code, None
    return False, response.status_code, f"answered {response.status_code}"


class Dispatcher:
    """This process's sender of deliveries (one per event loop)."""

    def __init__(self) -> None:
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="taskboard-deliveries")
        self._in_flight: set[asyncio.Task[None]] = set()
        # Only to public addresses, checked as each connection is made (unless
        # TASKBOARD_WEBHOOK_ALLOW_PRIVATE).
        self._client = webhook_addresses.client()
        self._task: asyncio.Task[None] | None = None
        self._unlisten: Callable[[], None] | None = None

    def wake(self) -> None:
        self._wake.set()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="taskboard-deliveries")

    async def stop(self) -> None:
        """Stop sending. Deliveries in flight are abandoned: their leases run out and a
        process tries them again (at least once)."""
        if self._unlisten is not None:
            self._unlisten()
        tasks = [t for t in [self._task, *self._in_flight] if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self._client.aclose()
        with contextlib.suppress(Exception):
            await self._db(_close_connection)
        self._executor.shutdown(wait=False)

    async def _db(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        def call() -> T:
            connection.close_if_unusable_or_obsolete()
            return function(*args, **kwargs)

        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, call)

    async def _listen(self) -> None:
        """Have the relay wake this dispatcher (it starts the relay, retrying while the
        database is away)."""
        from board.live.relay import get_relay

        while True:
            try:
                relay = await get_relay()
            except Exception as exc:  # psycopg's or Django's errors, or a timeout
                logger.warning("deliveries: no relay yet (%s); trying again", exc)
                await asyncio.sleep(DATABASE_RETRY_SECONDS)
                continue
            relay.delivery_listeners.add(self.wake)
            self._unlisten = functools.partial(relay.delivery_listeners.discard, self.wake)
            return

    async def _run(self) -> None:
        while True:
            try:
                await self._db(_sync_email_channel)
                break
            except DatabaseError as exc:
                logger.warning("deliveries: database unavailable (%s)", exc)
                await asyncio.sleep(DATABASE_RETRY_SECONDS)
        await self._listen()
        while True:
            self._wake.clear()
            delay: float | None
            try:
                room = MAX_IN_FLIGHT - len(self._in_flight)
                claimed = await self._db(claim_and_prepare, room) if room > 0 else []
                for out in claimed:
                    task = asyncio.create_task(self._deliver(out))
                    self._in_flight.add(task)
                    task.add_done_callback(self._done)
                if room > 0 and len(claimed) == room:
                    continue  # more may be due
                # Full: an attempt that ends wakes the loop. Otherwise sleep until the next
                # delivery falls due (a retry, or another process's lease running out).
                delay = None if room <= 0 else await self._db(next_due)
                if delay is not None and not claimed:
                    # Due but not claimed: another process's claim holds it (SKIP LOCKED)
                    # until it commits. Look again shortly, not at once.
                    delay = max(delay, 0.1)
                if not self._in_flight:
                    await self._db(_close_connection)  # idle: hold no connection
            except DatabaseError as exc:
                logger.warning("deliveries: database unavailable (%s)", exc)
                delay = DATABASE_RETRY_SECONDS
            except Exception:  # a bug must not stop this process's deliveries for good
                logger.exception("deliveries: a round of claims failed")
                delay = DATABASE_RETRY_SECONDS
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), None if delay is None else delay + 0.01)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._in_flight.discard(task)
        self.wake()

    async def _deliver(self, out: Outgoing) -> None:
        delivered, status_code, error = await attempt(out, self._client)
        try:
            status = await self._db(
                record_delivery,
                delivery_id=out.delivery_id,
                lease_token=out.lease_token,
                delivered=delivered,
                status_code=status_code,
                error=error,
                retry_in=0 if delivered else backoff_seconds(out.attempts),
                horizon_seconds=conf.delivery_horizon_seconds(),
            )
        except DatabaseError:
            # Not recorded: the lease runs out and the delivery is made again.
            logger.warning("deliveries: could not record delivery %s", out.delivery_id)
            return
        if status is None:
            logger.info("deliveries: the lease on delivery %s was lost", out.delivery_id)
        elif status != DeliveryStatus.DELIVERED:
            logger.warning(
                "deliveries: delivery %s (event %s) %s: %s",
                out.delivery_id,
                out.event_id,
                "failed for good" if status == DeliveryStatus.FAILED else "will be retried",
                error,
            )


def _close_connection() -> None:
    connection.close()  # this thread's: looked up here, on the dispatcher's thread


def _sync_email_channel() -> None:
    """Turn the escalation emails on when EMAIL_URL is set, and off when it is not."""
    wanted = bool(conf.email_url())
    if wanted or Webhook.objects.filter(kind=WebhookKind.EMAIL, active=True).exists():
        set_email_channel(active=wanted)


_dispatchers: dict[asyncio.AbstractEventLoop, Dispatcher] = {}


async def start_dispatcher() -> Dispatcher:
    """Start this event loop's dispatcher (ASGI lifespan startup); it waits in the
    background for the database if it is not there yet."""
    loop = asyncio.get_running_loop()
    dispatcher = _dispatchers.get(loop)
    if dispatcher is None:
        dispatcher = _dispatchers[loop] = Dispatcher()
        await dispatcher.start()
    return dispatcher


async def stop_dispatcher() -> None:
    """Stop this event loop's dispatcher (ASGI lifespan shutdown)."""
    dispatcher = _dispatchers.pop(asyncio.get_running_loop(), None)
    if dispatcher is not None:
        await dispatcher.stop()


# --- the statements: webhooks and their deliveries ----------------------------------------


def _rows(name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    return sql.run(QUERIES[name], params)


def create_webhook(
    *,
    actor: Actor,
    url: str,
    events: Sequence[str],
    queues: Sequence[str] | None,
    secret: str,
    format: str = "json",
) -> Webhook:
    """Add a webhook: every later event of ``events`` in ``queues`` (None: all) is sent."""
    rows = _rows(
        "create_webhook",
        {
            "actor": actor_name(actor),
            "url": url,
            "events": list(events),
            "queues": None if queues is None else list(queues),
            "secret": secret,
            "format": format,
        },
    )
    return sql.instance(Webhook, rows[0])


def delete_webhook(*, webhook_id: int, actor: Actor) -> bool:
    """Remove a webhook and its deliveries; return whether there was one."""
    actor_name(actor)
    return bool(_rows("delete_webhook", {"webhook_id": webhook_id}))


def set_email_channel(*, active: bool) -> Webhook:
    """Turn the escalation emails (EMAIL_URL) on or off."""
    return sql.instance(Webhook, _rows("set_email_channel", {"active": active})[0])


def queue_password_reset(*, address: str) -> None:
    """Queue a password reset email to ``address`` (sent to each account of that address,
    if any), and turn the email channel on first if no server process has yet (the form is
    served only when EMAIL_URL is set)."""
    if not _rows("queue_password_reset", {"address": address}):
        set_email_channel(active=True)
        _rows("queue_password_reset", {"address": address})


def claim_deliveries(*, limit: int, lease_seconds: float) -> list[Delivery]:
    """Lease up to ``limit`` due deliveries to the caller (SKIP LOCKED), counting an attempt."""
    rows = _rows("claim_deliveries", {"limit": limit, "lease_seconds": lease_seconds})
    return [sql.instance(Delivery, row) for row in rows]


def record_delivery(
    *,
    delivery_id: int,
    lease_token: uuid.UUID,
    delivered: bool,
    status_code: int | None = None,
    error: str | None = None,
    retry_in: float = 0,
    horizon_seconds: float = 0,
) -> str | None:
    """Record the outcome of an attempt made under ``lease_token``.

    Return the delivery's status afterwards (delivered; pending for a retry in ``retry_in``
    seconds, or at the horizon when that would pass it; or failed when this attempt was at
    or after the horizon), or None when the lease was no
    longer the caller's (it ran out and another process took the delivery, or the webhook
    was deleted): then nothing is recorded.
    """
    params = {"delivery_id": delivery_id, "lease_token": lease_token, "status_code": status_code}
    if delivered:
        return "delivered" if _rows("delivery_succeeded", params) else None
    rows = _rows(
        "delivery_attempt_failed",
        {**params, "error": error, "retry_in": retry_in, "horizon_seconds": horizon_seconds},
    )
    return str(rows[0]["status"]) if rows else None


def retry_deliveries(*, delivery_ids: Sequence[int], actor: Actor) -> int:
    """Re-arm failed deliveries (staff): due now, for a new horizon. Return how many."""
    actor_name(actor)
    return len(_rows("retry_deliveries", {"delivery_ids": list(delivery_ids)}))
