"""Request-wide policy: the body size and time limits, the Host check in front of Django
(once per request, taken as checked by Django), and a 503 when the database is down."""

from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import Callable
from typing import Any

from django.core.exceptions import DisallowedHost
from django.core.handlers.asgi import ASGIRequest
from django.core.handlers.wsgi import WSGIRequest
from django.db import InterfaceError, OperationalError
from django.http import HttpRequest, HttpResponse, HttpResponsePermanentRedirect, JsonResponse
from django.middleware import common
from django.utils.http import escape_leading_slashes

from board import conf
from board.http.asgi_tools import read_body, replaying, send_response
from board.http.errors import JSON_PATHS, bad_request, error_response

logger = logging.getLogger(__name__)


def too_large() -> JsonResponse:
    return error_response(
        413, "payload_too_large", f"Request bodies are limited to {conf.MAX_BODY_BYTES} bytes."
    )


def request_timeout() -> JsonResponse:
    response = error_response(
        408,
        "request_timeout",
        f"The request body did not arrive within {conf.body_timeout():g} seconds.",
    )
    response["Connection"] = "close"  # the rest of the body is not read: drop the connection
    return response


def database_unavailable() -> JsonResponse:
    response = error_response(503, "unavailable", "The database is unavailable. Try again shortly.")
    response["Retry-After"] = "5"
    return response


# Where the Host checked in front of Django is kept in a request's ASGI scope.
HOST_KEY = "taskboard.host"


def check_host(scope: dict[str, Any]) -> HttpResponse | None:
    """Check the request's Host against ALLOWED_HOSTS, once for the whole request: return
    the 400 that Django answers for a foreign one, or None after keeping the host in the
    scope (HOST_KEY), where Django's request takes it as checked (:class:`CheckedHostRequest`).

    For every HTTP request, in front of everything (taskboard.asgi): the ASGI endpoints
    beside Django (board.live.stream, board.live.waiting, /mcp/) are never seen by Django's
    own check, and a waiting claim goes through Django once per attempt. It is Django's
    logic (HttpRequest.get_host: X-Forwarded-Host, DEBUG's defaults and all) on an
    ASGIRequest made from the scope, and Django's answer (handler400), logged to the same
    logger.
    """
    request = ASGIRequest(scope, io.BytesIO())
    try:
        scope[HOST_KEY] = request.get_host()
    except DisallowedHost as exc:
        logging.getLogger("django.security.DisallowedHost").error("%s", exc)
        return bad_request(request, exc)
    return None


class CheckedHostRequest(WSGIRequest):
    """Django's WSGI request, whose Host is the one checked in front of Django
    (:func:`check_host`) when there is one, instead of being checked again."""

    def get_host(self) -> str:
        scope = self.environ.get("asgi.scope") or {}
        host = scope.get(HOST_KEY)
        return host if isinstance(host, str) else super().get_host()


def is_database_outage(exc: BaseException) -> bool:
    """Tell a lost or refused database connection from a bug in a query."""
    return isinstance(exc, OperationalError | InterfaceError)


class PermanentRedirectKeepingMethod(HttpResponsePermanentRedirect):
    status_code = 308


class CommonMiddleware(common.CommonMiddleware):
    """Django's (the Host check, and a URL without its trailing slash sent to the one
    with it), redirecting with 308 rather than 301: a client that follows it repeats its
    POST, body and all, where after a 301 it would GET the URL (and Django in DEBUG
    raises an error instead of answering a POST)."""

    response_redirect_class = PermanentRedirectKeepingMethod

    def get_full_path_with_slash(self, request: HttpRequest) -> str:
        return escape_leading_slashes(request.get_full_path(force_append_slash=True))


class NulCharacterMiddleware:
    """Answer 400 to a page whose path or query holds a NUL character.

    PostgreSQL refuses NUL in text, and the admin passes its list filters and object ids on
    to queries as they come (``?queue=%00`` was a 500). The API is left to its own
    validation, which names the refused field.
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if not request.path.startswith(JSON_PATHS) and (
            "\x00" in request.path
            or any("\x00" in key + "".join(values) for key, values in request.GET.lists())
        ):
            return bad_request(request)
        return self.get_response(request)


class BodySizeLimitMiddleware:
    """Refuse a declared body over MAX_BODY_BYTES with 413 before anything parses it.

    Chunked bodies (no declared length) are measured in front of Django, by
    :class:`RequestBodyLimit`, which gives them a length.
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        length = request.META.get("CONTENT_LENGTH")
        try:
            if length and int(length) > conf.MAX_BODY_BYTES:
                return too_large()
        except ValueError:
            return error_response(400, "invalid", "The Content-Length header is not a number.")
        return self.get_response(request)


class DatabaseUnavailableMiddleware:
    """Answer 503 with JSON, not a 500 page, when the database cannot be reached."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exc: Exception) -> HttpResponse | None:
        if is_database_outage(exc):
            logger.warning("database unavailable: %s", exc)
            return database_unavailable()
        return None


class RequestBodyLimit:
    """ASGI middleware: read every request body in full, within a time and a size limit,
    before the request takes one of Django's worker threads or a database connection.

    Django runs on a few worker threads (taskboard/asgi.py), and under WSGI it reads the
    body from inside its thread: a client sending its body a byte a second would hold a
    thread for as long as it likes, and a handful of them would stall every request. Here
    the body is read on the event loop, where waiting costs nothing, and Django is handed
    a body that is already there:

    - a declared Content-Length over MAX_BODY_BYTES is refused with 413 before reading;
    - a body that grows past it (chunked, no declared length) is refused with 413;
    - a body not complete within TASKBOARD_BODY_TIMEOUT seconds is refused with 408 and
      the connection closed;
    - every body reaches Django with a Content-Length (a chunked one, which has none,
      would otherwise reach Django under WSGI empty).

    Hand-written, in front of Django, because it must run before a thread is taken, and
    Django's handler has nothing there. It costs about 9 µs of CPU per request (a 1 KiB
    body, benchmarks/measurements/front_cpu.py), against about 7.4 ms for an API request.
    Without it, four clients sending their bodies a byte at a time (TASKBOARD_THREADS, 4)
    held every worker thread, and every other request, /healthz included, waited for as
    long as they lasted; with it, six such clients hold none (tests/faults/test_slow_bodies.py).
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers", [])
        declared = [value for name, value in headers if name.lower() == b"content-length"]
        if declared and declared[0].isdigit() and int(declared[0]) > conf.MAX_BODY_BYTES:
            await send_response(send, too_large())
            return
        try:
            async with asyncio.timeout(conf.body_timeout()):
                body = await read_body(receive, conf.MAX_BODY_BYTES)
        except TimeoutError:
            await send_response(send, request_timeout())
            return
        if body is None:
            await send_response(send, too_large())  # (or the client left: nobody reads it)
            return
        if not declared:
            scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        await self.app(scope, replaying(body, receive), send)
