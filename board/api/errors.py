"""Every API error as the contract's JSON body: ``{"error", "detail"[, "fields"]}``."""

from __future__ import annotations

import json
import logging
from typing import Any

from django.core.exceptions import PermissionDenied
from django.http import Http404
from rest_framework import exceptions, status
from rest_framework.response import Response

from board.exceptions import (
    BoardError,
    ForbiddenQueue,
    IdempotencyConflict,
    InvalidAnswer,
    InvalidTransition,
    LeaseLost,
    RateLimited,
    TaskNotFound,
)
from board.http.middleware import database_unavailable, is_database_outage

logger = logging.getLogger(__name__)

# DRF's own codes, renamed where the contract names them differently.
_CODES = {
    "authentication_failed": "not_authenticated",
    "not_authenticated": "not_authenticated",
    "permission_denied": "permission_denied",
    "not_found": "not_found",
    "method_not_allowed": "method_not_allowed",
    "not_acceptable": "not_acceptable",
    "unsupported_media_type": "unsupported_media_type",
    "throttled": "throttled",
    "parse_error": "invalid",
}


def _messages(detail: Any, where: str = "") -> list[str]:
    """Flatten one field's DRF error tree into sentences; nested places are prefixed
    (``[1]: Must be a string.`` for the second item of a list)."""
    if isinstance(detail, dict):
        return [
            message
            for key, value in detail.items()
            for message in _messages(value, f"{where}[{key}]")
        ]
    if isinstance(detail, list):
        return [message for item in detail for message in _messages(item, where)]
    return [f"{where}: {detail}" if where else str(detail)]


def _fields(detail: Any) -> dict[str, list[str]]:
    """Return the contract's ``fields``: each refused field with a list of sentences."""
    if isinstance(detail, dict):
        return {str(key): _messages(value) for key, value in detail.items()}
    return {"non_field_errors": _messages(detail)}


def _summary(fields: dict[str, list[str]]) -> str:
    parts = []
    for name, messages in fields.items():
        text = messages[0] if messages else "invalid"
        parts.append(text if name == "non_field_errors" else f"{name}: {text}")
    return "Invalid request: " + "; ".join(parts) if parts else "Invalid request."


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """DRF's EXCEPTION_HANDLER: map every refusal to a JSON error with the right status."""
    if isinstance(exc, TaskNotFound | Http404):
        return Response(
            {"error": "not_found", "detail": str(exc) or "Not found."},
            status=status.HTTP_404_NOT_FOUND,
        )
    if isinstance(exc, LeaseLost | InvalidTransition):
        return Response(
            {"error": exc.code, "detail": str(exc), "status": exc.status},
            status=status.HTTP_409_CONFLICT,
        )
    if isinstance(exc, IdempotencyConflict):
        return Response(
            {"error": exc.code, "detail": str(exc), "task_id": exc.task_id},
            status=status.HTTP_409_CONFLICT,
        )
    if isinstance(exc, RateLimited):
        return Response(
            {"error": exc.code, "detail": str(exc)},
            status=status.HTTP_429_TOO_MANY_REQUESTS,
            headers={"Retry-After": str(exc.retry_after)},
        )
    if isinstance(exc, ForbiddenQueue):
        return Response({"error": exc.code, "detail": str(exc)}, status=status.HTTP_403_FORBIDDEN)
    if isinstance(exc, InvalidAnswer):
        fields = {exc.field: [str(exc)]}
        return Response(
            {"error": exc.code, "detail": _summary(fields), "fields": fields},
            status=status.HTTP_400_BAD_REQUEST,
        )
    if isinstance(exc, BoardError):
        return Response({"error": exc.code, "detail": str(exc)}, status=status.HTTP_400_BAD_REQUEST)
    if isinstance(exc, PermissionDenied):
        exc = exceptions.PermissionDenied()
    if is_database_outage(exc):
        logger.warning("database unavailable: %s", exc)
        unavailable = database_unavailable()
        return Response(
            json.loads(unavailable.content),
            status=unavailable.status_code,
            headers={"Retry-After": unavailable["Retry-After"]},
        )
    if not isinstance(exc, exceptions.APIException):
        return None  # a bug: Django's handler500 answers with JSON and logs it

    headers: dict[str, str] = {}
    if getattr(exc, "auth_header", None):
        headers["WWW-Authenticate"] = exc.auth_header  # type: ignore[attr-defined]
    if getattr(exc, "wait", None):
        headers["Retry-After"] = str(int(exc.wait))  # type: ignore[attr-defined]

    if isinstance(exc, exceptions.ValidationError | exceptions.ParseError):
        fields = (
            _fields(exc.detail)
            if isinstance(exc, exceptions.ValidationError)
            else {"body": [str(exc.detail)]}
        )
        body = {"error": "invalid", "detail": _summary(fields), "fields": fields}
        return Response(body, status=status.HTTP_400_BAD_REQUEST, headers=headers)

    code = exc.get_codes() if isinstance(exc.get_codes(), str) else exc.default_code
    body = {"error": _CODES.get(str(code), str(code)), "detail": str(exc.detail)}
    return Response(body, status=exc.status_code, headers=headers)
