"""Every API error as the contract's JSON body: ``{"error", "detail"[, "fields"]}``."""

from __future__ import annotations

import json
import logging
from typing import Any

from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, JsonResponse
from rest_framework import exceptions, status
from rest_framework.response import Response

from board.exceptions import BoardError, InvalidTransition, LeaseLost, TaskNotFound
from board.middleware import database_unavailable, error_response, is_database_outage

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


def _flatten(detail: Any) -> Any:
    """Turn DRF's ErrorDetail trees into plain strings, lists and dicts."""
    if isinstance(detail, dict):
        return {str(key): _flatten(value) for key, value in detail.items()}
    if isinstance(detail, list):
        return [_flatten(item) for item in detail]
    return str(detail)


def _fields(detail: Any) -> dict[str, list[Any]]:
    if isinstance(detail, dict):
        return {
            key: value if isinstance(value, list) else [value]
            for key, value in _flatten(detail).items()
        }
    return {"non_field_errors": _flatten(detail if isinstance(detail, list) else [detail])}


def _summary(fields: dict[str, list[Any]]) -> str:
    parts = []
    for name, messages in fields.items():
        first = messages[0] if messages else "invalid"
        text = first if isinstance(first, str) else "invalid"
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


def not_found(request: HttpRequest, exception: Exception | None = None) -> JsonResponse:
    """handler404: a JSON 404 for any URL nothing serves."""
    return error_response(404, "not_found", f"Nothing is served at {request.path}.")


def server_error(request: HttpRequest) -> JsonResponse:
    """handler500: a JSON 500 instead of Django's HTML page."""
    return error_response(500, "server_error", "The server failed to handle this request.")


def bad_request(request: HttpRequest, exception: Exception | None = None) -> JsonResponse:
    return error_response(400, "invalid", "The request could not be understood.", fields={})


def permission_denied(request: HttpRequest, exception: Exception | None = None) -> JsonResponse:
    return error_response(403, "permission_denied", "You may not do this.")
