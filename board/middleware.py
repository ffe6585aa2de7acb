"""Request-wide policy: the body size limit and a 503 when the database is down."""

from __future__ import annotations

import logging
from collections.abc import Callable

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
