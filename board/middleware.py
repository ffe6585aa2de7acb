"""Request-wide policy: the body size limit and a 503 when the database is down."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from django.core.exceptions import RequestDataTooBig
from django.db import InterfaceError, OperationalError
from django.http import HttpRequest, HttpResponse, JsonResponse

from board import conf

logger = logging.getLogger(__name__)


def error_response(status: int, code: str, detail: str, **extra: object) -> JsonResponse:
    """Return the contract's error body: ``{"error": code, "detail": sentence, ...}``."""
    return JsonResponse({"error": code, "detail": detail, **extra}, status=status)


def too_large() -> JsonResponse:
    return error_response(
        413, "payload_too_large", f"Request bodies are limited to {conf.MAX_BODY_BYTES} bytes."
    )


def database_unavailable() -> JsonResponse:
    response = error_response(503, "unavailable", "The database is unavailable. Try again shortly.")
    response["Retry-After"] = "5"
    return response


def is_database_outage(exc: BaseException) -> bool:
    """Tell a lost or refused database connection from a bug in a query."""
    return isinstance(exc, OperationalError | InterfaceError)


class BodySizeLimitMiddleware:
    """Refuse bodies over MAX_BODY_BYTES with 413 before anything parses them."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        length = request.META.get("CONTENT_LENGTH")
        try:
            if length and int(length) > conf.MAX_BODY_BYTES:
                return too_large()
        except ValueError:
            return error_response(400, "invalid", "The Content-Length header is not a number.")
        if not length and request.method in {"POST", "PUT", "PATCH"}:
            # A chunked body has no declared length: read it (Django stops past
            # DATA_UPLOAD_MAX_MEMORY_SIZE) so that the limit holds for it too.
            try:
                request.body  # noqa: B018
            except RequestDataTooBig:
                return too_large()
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
    """ASGI middleware: refuse bodies over MAX_BODY_BYTES with 413, and give every body a
    Content-Length.

    Django under WSGI reads exactly Content-Length bytes, so a chunked body (which has no
    length) would reach it empty. Such bodies are read here, up to the limit, and passed on
    with the length they turned out to have; a declared length over the limit is refused
    before anything is read.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers", [])
        declared = [value for name, value in headers if name.lower() == b"content-length"]
        if declared:
            if declared[0].isdigit() and int(declared[0]) > conf.MAX_BODY_BYTES:
                await _send_response(send, too_large())
                return
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > conf.MAX_BODY_BYTES:
                await _send_response(send, too_large())
                return
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _send_response(send: Any, response: HttpResponse) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": response.status_code,
            "headers": [(k.lower().encode(), v.encode()) for k, v in response.items()],
        }
    )
    await send({"type": "http.response.body", "body": response.content})
