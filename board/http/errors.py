"""Error answers outside DRF: the contract's JSON error body, and Django's handlers for
400, 403, 404 and 500, which answer it under the paths whose clients read JSON and an
HTML page elsewhere. The API's own errors (board.api.errors) and the request-wide
middleware (board.http.middleware) both build on it."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render


def error_response(status: int, code: str, detail: str, **extra: object) -> JsonResponse:
    """Return the contract's error body: ``{"error": code, "detail": sentence, ...}``."""
    return JsonResponse({"error": code, "detail": detail, **extra}, status=status)


# Paths whose clients read JSON: a 404 there is the contract's error body.
JSON_PATHS = ("/api/", "/healthz")


def not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    """handler404: the JSON error under /api/ and /healthz, an HTML page everywhere else."""
    if request.path.startswith(JSON_PATHS):
        return error_response(404, "not_found", f"Nothing is served at {request.path}.")
    return render(request, "404.html", {"request_path": request.path}, status=404)


def server_error(request: HttpRequest) -> HttpResponse:
    """handler500: the JSON error under /api/ and /healthz, a plain HTML page elsewhere."""
    if request.path.startswith(JSON_PATHS):
        return error_response(500, "server_error", "The server failed to handle this request.")
    # No template rendering here: whatever failed may fail again while rendering.
    return HttpResponse(
        "<!doctype html><title>Server error · Taskboard</title>"
        "<h1>Something went wrong</h1><p>The server failed to handle this request.</p>",
        status=500,
    )


def bad_request(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    if request.path.startswith(JSON_PATHS):
        return error_response(400, "invalid", "The request could not be understood.", fields={})
    return HttpResponse("<!doctype html><h1>Bad request</h1>", status=400)


def permission_denied(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    if request.path.startswith(JSON_PATHS):
        return error_response(403, "permission_denied", "You may not do this.")
    return render(request, "403.html", status=403)
