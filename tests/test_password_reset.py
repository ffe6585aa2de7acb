"""The password reset: served only when EMAIL_URL is set, throttled as logins are, and
answered without sending anything: its email is queued and delivered as the escalation
emails are (board.pages.views.PasswordResetView, board.notifications.deliveries)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.core import mail
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import clear_url_caches, set_urlconf

from board.models import Delivery
from board.notifications import deliveries
from tests import processes
from tests.factories import UserFactory
from tests.processes import ServeProcess, eventually
from tests.test_tokens import fresh_window

RESET_PAGES = ["/accounts/password_reset/", "/accounts/password_reset/done/"]


def route_accounts() -> None:
    """Build the URLs again from the settings as they are now (taskboard.urls reads
    EMAIL_URL when it is imported, as a server process does once)."""
    import taskboard.urls

    importlib.reload(taskboard.urls)
    clear_url_caches()
    set_urlconf(None)


@pytest.fixture
def email_on(settings: Any) -> Iterator[Any]:
    """EMAIL_URL set (Django's in-memory backend, which nothing should reach in a request),
    and the URLs routed for it."""
    settings.EMAIL_URL = "smtp://127.0.0.1:1"
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    settings.TASKBOARD_PUBLIC_URL = "https://board.example.com"
    route_accounts()
    yield settings
    settings.EMAIL_URL = ""
    route_accounts()


def account(username: str, email: str) -> Any:
    """Return a user with that email and a usable password (one that may reset it)."""
    user = UserFactory.create(username=username, email=email)
    user.set_password("old-password")
    user.save()
    return user


def ask_for_a_reset(client: Client, address: str) -> Any:
    return client.post("/accounts/password_reset/", {"email": address})


@pytest.mark.django_db
def test_without_email_url_there_is_no_password_reset() -> None:
    route_accounts()
    client = Client()
    for page in [*RESET_PAGES, "/accounts/reset/MQ/set-password/", "/accounts/reset/done/"]:
        assert client.get(page).status_code == 404, page
    assert ask_for_a_reset(client, "ann@example.com").status_code == 404
    login = client.get("/accounts/login/")
    assert login.status_code == 200
    assert "password_reset" not in login.content.decode()
    assert Delivery.objects.count() == 0


@pytest.mark.django_db
def test_with_email_url_the_login_page_links_to_the_reset(email_on: Any) -> None:
    login = Client().get("/accounts/login/").content.decode()
    assert 'href="/accounts/password_reset/"' in login


@pytest.mark.django_db
def test_a_reset_queues_its_email_and_does_the_same_work_whatever_the_address(
    email_on: Any,
) -> None:
    account("ann", "ann@example.com")
    client = Client(REMOTE_ADDR="10.0.3.1")
    # Once first: the client's first counted request of a window does more (access.throttle).
    ask_for_a_reset(client, "first@example.com")

    statements = {}
    for address in ("ann@example.com", "nobody@example.com"):
        with CaptureQueriesContext(connection) as queries:
            response = ask_for_a_reset(client, address)
        assert response.status_code == 302
        assert response["Location"] == "/accounts/password_reset/done/"
        # The same statements, whether or not the address has an account; none reads users.
        statements[address] = [
            re.sub(r"'[^']*'|\d+", "?", query["sql"]) for query in queries.captured_queries
        ]
        assert not any("auth_user" in sql for sql in statements[address])
    assert statements["ann@example.com"] == statements["nobody@example.com"]
    assert mail.outbox == [], "nothing is sent in the request"
    queued = Delivery.objects.order_by("id")
    assert [(d.recipient, d.status, d.event_id) for d in queued] == [
        ("first@example.com", "pending", None),
        ("ann@example.com", "pending", None),
        ("nobody@example.com", "pending", None),
    ]


@pytest.mark.django_db
def test_the_dispatcher_sends_a_working_link_to_each_account_of_the_address(
    email_on: Any,
) -> None:
    ann = account("ann", "ann@example.com")
    deliveries.queue_password_reset(address="ANN@example.com")
    deliveries.queue_password_reset(address="nobody@example.com")

    claimed = deliveries.claim_deliveries(limit=10, lease_seconds=30)
    outgoing = [deliveries.prepare(delivery) for delivery in claimed]

    async def send_all() -> list[tuple[bool, int | None, str | None]]:
        async with httpx.AsyncClient() as client:
            return [await deliveries.attempt(out, client) for out in outgoing]

    assert asyncio.run(send_all()) == [(True, None, None), (True, None, None)]
    [email] = mail.outbox  # nobody@example.com has no account: nothing to send
    assert email.to == ["ann@example.com"]
    [link] = re.findall(r"https://board\.example\.com/accounts/reset/\S+", str(email.body))

    client = Client()
    form = client.get(link.removeprefix("https://board.example.com"), follow=True)
    assert form.status_code == 200
    done = client.post(
        form.redirect_chain[-1][0],
        {"new_password1": "a-new-long-password", "new_password2": "a-new-long-password"},
    )
    assert done.status_code == 302
    ann.refresh_from_db()
    assert ann.check_password("a-new-long-password")


@pytest.mark.django_db
def test_reset_requests_are_throttled_as_failed_logins_are(email_on: Any) -> None:
    fresh_window()
    client = Client(REMOTE_ADDR="10.0.3.2")
    for n in range(30):
        assert ask_for_a_reset(client, f"user{n}@example.com").status_code == 302
    refused = ask_for_a_reset(client, "user30@example.com")
    assert refused.status_code == 429
    assert 1 <= int(refused["Retry-After"]) <= 60
    assert Delivery.objects.count() == 30
    # The same address's logins are refused too: one budget for both.
    login = client.post("/accounts/login/", {"username": "ann", "password": "x"})
    assert login.status_code == 429
    # Another address asks as before.
    assert ask_for_a_reset(Client(REMOTE_ADDR="10.0.3.3"), "ann@example.com").status_code == 302


@contextlib.contextmanager
def silent_smtp_server() -> Iterator[int]:
    """Yield the port of an SMTP server that accepts connections and never says a word."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                held.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        for sock in held:
            sock.close()
        listener.close()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_an_smtp_server_that_never_answers_holds_no_reset_request_and_no_server(
    tmp_path: Path,
) -> None:
    """Twelve resets must not hold the server (65 s when each sent its email in the request,
    with no SMTP timeout): each answers at once, /healthz keeps answering, and the
    email's delivery fails within its deadline, to be tried again."""
    account("ann", "ann@example.com")
    with silent_smtp_server() as port:
        server = ServeProcess(
            tmp_path / "serve.log",
            "--workers",
            "1",
            env={
                "DATABASE_URL": processes.tests_database_url(),
                "EMAIL_URL": f"smtp://127.0.0.1:{port}",
                "TASKBOARD_WEBHOOK_TIMEOUT_SECONDS": "2",
            },
        )
        try:
            server.wait_healthy()
            with httpx.Client(base_url=server.url, timeout=5) as browser:
                assert browser.get("/accounts/password_reset/").status_code == 200
                for n in range(12):
                    started = time.monotonic()
                    response = browser.post(
                        "/accounts/password_reset/",
                        data={
                            "email": "ann@example.com" if n % 2 else f"nobody{n}@example.com",
                            "csrfmiddlewaretoken": browser.cookies["csrftoken"],
                        },
                    )
                    took = time.monotonic() - started
                    assert response.status_code == 302, response.text
                    assert took < 1, took
                    health = browser.get("/healthz", timeout=2)
                    assert health.status_code == 200
            first = Delivery.objects.filter(recipient="ann@example.com").order_by("id")[:1]
            attempted = eventually(
                lambda: (
                    Delivery.objects.filter(pk__in=first, attempts__gte=1)
                    .exclude(last_error=None)
                    .first()
                ),
                timeout=20,
                what="a failed attempt",
            )
            assert attempted.status == "pending"  # to be tried again
            assert "time" in (attempted.last_error or "").lower(), attempted.last_error
            assert server.health() == 200
        finally:
            server.stop()
