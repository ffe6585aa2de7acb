"""Failed authentication, throttled per client address, across every server process.

After TASKBOARD_AUTH_FAILURE_LIMIT failures (401 answers of the API and the stream to a
request that presented credentials, failed logins at /admin/login/ and /accounts/login/,
and every request for a password reset email, which is another way to try addresses and
to send mail to them) from one address within a window of
TASKBOARD_AUTH_FAILURE_WINDOW_SECONDS, every request from that address that would
authenticate answers ``429 {"error": "throttled"}`` (a page at the login forms) with
``Retry-After`` until the window ends, even one carrying a valid token: otherwise a
guesser would learn from the status which guess was right. Successful requests count
nothing, so a client that only ever authenticates successfully is never throttled; nor
does a request that presents no credentials (no ``Authorization`` header: anonymous, or a
session that ended), which guesses nothing: a board left open after its user logged out
asks again and again, and must not lock out everyone behind the same address.

The counts live in PostgreSQL (the UNLOGGED ``auth_failures`` table, one upsert per
failure), not in process memory, so that N processes on one database enforce one limit.
Why not a library: django-axes throttles only Django's logins (by username and address,
with its own lockout rules), and django-ratelimit counts through Django's cache, whose
``incr`` on the database cache is a read followed by a write, which loses counts between
processes; one upsert does not.

An address with no failure in the current window or the one before reads the same on
every call until it fails, so each server process remembers such addresses
(:class:`CleanAddresses`) and skips the read for them: the API's valid calls make one
statement fewer each. An address's first failure of a window is announced with NOTIFY
(``auth_failures``), which every process's event relay hears (board.live.relay), and makes every
process forget it; a process whose relay is not listening remembers nothing.

The client address is ``REMOTE_ADDR``, as uvicorn sets it: the TCP peer, or what
``X-Forwarded-For`` says when the peer is a proxy in FORWARDED_ALLOW_IPS (none by default;
``serve --pushpin`` adds its own Pushpin's 127.0.0.1).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import NoReverseMatch, reverse

from board import conf
from board.http.errors import error_response
from board.http.middleware import database_unavailable, is_database_outage
from board.sql import load

logger = logging.getLogger(__name__)

QUERIES = load(Path(__file__).with_name("throttle.sql"))

API_PREFIX = "/api/"
# What the API serves to anyone, with no authentication at all.
PUBLIC_API_PREFIXES = ("/api/v1/schema/", "/api/v1/docs/")
METRICS_PATH = "/metrics"  # board.ops.metrics: staff tokens are tried there too


def limit() -> int:
    """Return the failures an address may make in a window (0: no throttle)."""
    return conf.auth_failure_limit()


def window() -> int:
    """Return the window's length in seconds."""
    return max(1, conf.auth_failure_window_seconds())


class CleanAddresses:
    """The client addresses that had no failed authentication in the current window or
    the one before, as read since this process last heard of their failure.

    Trusted only while this process's event relay listens: it hears each address's first
    failure of a window (``record_failure`` announces it) and forgets the address then, and
    on each (re)connect forgets all, since announcements may have been missed meanwhile.
    A read made before an announcement is heard but remembered after would be stale, so an
    address is only remembered if nothing was forgotten while it was being read (the epoch).
    """

    MAX_SIZE = 10_000

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._addresses: set[str] = set()
        self.epoch = 0

    def __contains__(self, address: str) -> bool:
        return address in self._addresses and _listening()

    def remember(self, address: str, epoch: int) -> None:
        with self._lock:
            if epoch != self.epoch or not _listening():
                return
            if len(self._addresses) >= self.MAX_SIZE:
                self._addresses.clear()
            self._addresses.add(address)

    def forget(self, address: str | None) -> None:
        """Forget ``address`` (None: every address)."""
        with self._lock:
            self.epoch += 1
            if address is None:
                self._addresses.clear()
            else:
                self._addresses.discard(address)


clean_addresses = CleanAddresses()


def _nothing_listens() -> bool:
    return False


# Whether an event relay of this process listens for the failures' announcements. Live
# delivery tells it (access.apps registers the relay's test) rather than the throttle
# importing live delivery, which authenticates through the throttle; until then, none does.
_listening: Callable[[], bool] = _nothing_listens


def listened_while(listening: Callable[[], bool]) -> None:
    """Have the throttle trust its clean addresses only while ``listening()`` is true: an
    event relay of this process hears every announced failure."""
    global _listening
    _listening = listening


def failure_announced(address: str | None) -> None:
    """Event relay listener: ``address`` failed to authenticate (None: any may have)."""
    clean_addresses.forget(address)


def retry_after(address: str) -> int | None:
    """Return the seconds until ``address`` may authenticate again, or None if it may now.

    The failures of the last ``window()`` seconds are estimated as the current window's
    count plus the previous window's, weighted by the share of it that still lies within
    the last ``window()`` seconds (the sliding-window estimate). A fixed window alone would
    let up to twice the limit through across its boundary. The estimate takes the previous
    window's failures as spread evenly over it; bunched at its end, they weigh less than
    they should, and up to about twice the limit can still get through
    (docs/how-to/tokens.md).
    """
    allowed = limit()
    if allowed <= 0:
        return None
    if address in clean_addresses:
        return None
    epoch = clean_addresses.epoch
    length = window()
    with connection.cursor() as cursor:
        cursor.execute(QUERIES["failures"], {"address": address, "window": length})
        current, previous, left = cursor.fetchone()
    if current == previous == 0:
        clean_addresses.remember(address, epoch)
    if current + previous * left / length < allowed:
        return None
    if current >= allowed:
        # Past this window's end the current count is the previous one, fading out.
        wait = left + length * (1 - allowed / current)
    else:
        wait = left - length * (allowed - current) / previous
    return max(1, math.ceil(float(wait)))


def record_failure(address: str) -> None:
    """Count one failed authentication from ``address``."""
    if limit() <= 0:
        return
    with connection.cursor() as cursor:
        cursor.execute(QUERIES["record_failure"], {"address": address, "window": window()})
        failures, _, _ = cursor.fetchone()
        clean_addresses.forget(address)  # (and every process, on the statement's NOTIFY)
        if failures == 1:
            cursor.execute(QUERIES["forget_ended_windows"], {"window": window()})
        elif failures == limit():
            logger.warning("throttling authentication from %s: %d failures", address, failures)


def throttled(seconds: int) -> JsonResponse:
    """Return the 429 answer, with ``Retry-After``."""
    response = error_response(
        429,
        "throttled",
        f"Too many failed authentications from this address. Try again in {seconds} seconds.",
    )
    response["Retry-After"] = str(seconds)
    return response


def page(seconds: int) -> HttpResponse:
    """Return the 429 answer for a person at a login form: a page, with ``Retry-After``."""
    response = HttpResponse(
        "<!doctype html><title>Too many failed logins · Taskboard</title>"
        "<h1>Too many failed logins</h1>"
        "<p>Too many failed logins or password resets came from your address. "
        f"Try again in {seconds} seconds.</p>",
        status=429,
    )
    response["Retry-After"] = str(seconds)
    return response


def presented_credentials(authorization: str) -> bool:
    """Whether a request with this ``Authorization`` header tried to authenticate with
    something a guesser could guess (a token, a password). A session cookie is no such
    thing: its key is random, and a stale one is a session that ended."""
    return bool(authorization.strip())


def address_of(request: HttpRequest) -> str:
    return str(request.META.get("REMOTE_ADDR") or "")


@cache
def login_paths() -> frozenset[str]:
    return frozenset({reverse("admin:login"), reverse("login")})


@cache
def password_change_paths() -> frozenset[str]:
    """The forms that ask for the current password: a way to guess it, for anyone who
    holds a session (Django's form sends no ``user_login_failed``)."""
    return frozenset({reverse("admin:password_change"), reverse("password_change")})


def asks_for_a_password_reset(request: HttpRequest) -> bool:
    """Tell whether ``request`` posts the password reset form (routed only when EMAIL_URL
    is set: taskboard.urls)."""
    if request.method != "POST":
        return False
    try:
        return request.path == reverse("password_reset")
    except NoReverseMatch:
        return False


def authenticates(request: HttpRequest) -> bool:
    """Tell whether ``request`` is one the throttle guards: an API call that authenticates,
    a login, a password change (which checks the current password), or a password reset."""
    path = request.path
    if path == METRICS_PATH:  # a token guesser could try tokens there as well
        return True
    if path.startswith(API_PREFIX):
        return not path.startswith(PUBLIC_API_PREFIXES)
    if request.method != "POST":
        return False
    return path in login_paths() | password_change_paths() or asks_for_a_password_reset(request)


def guessed_a_password_wrong(request: HttpRequest, response: HttpResponse) -> bool:
    """Tell whether ``response`` refuses a password change for a wrong current password."""
    if request.path not in password_change_paths():
        return False
    form = (getattr(response, "context_data", None) or {}).get("form")
    return form is not None and "old_password" in form.errors


class FailedAuthenticationThrottle:
    """Django middleware: refuse throttled addresses with 429 before any authentication,
    and count the API's 401 answers, wrong current passwords and password reset requests.
    Failed logins are counted by :func:`on_login_failed`.
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if not authenticates(request):
            return self.get_response(request)
        address = address_of(request)
        try:
            seconds = retry_after(address)
        except Exception as exc:
            if not is_database_outage(exc):
                raise
            logger.warning("database unavailable: %s", exc)
            return database_unavailable()
        if seconds is not None:
            return throttled(seconds) if request.path.startswith(API_PREFIX) else page(seconds)
        response = self.get_response(request)
        failed = response.status_code == 401 and presented_credentials(
            request.META.get("HTTP_AUTHORIZATION", "")
        )
        if (
            failed
            or guessed_a_password_wrong(request, response)
            or asks_for_a_password_reset(request)
        ):
            try:
                record_failure(address)
            except Exception as exc:
                if not is_database_outage(exc):
                    raise
                logger.warning("could not count a failed authentication: %s", exc)
        return response


def on_login_failed(
    sender: Any, credentials: Any, request: HttpRequest | None = None, **kwargs: Any
) -> None:
    """``user_login_failed`` receiver: count a failed login from the request's address."""
    if request is not None:
        record_failure(address_of(request))
