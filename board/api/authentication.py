"""Authentication, one function for every entry point: :func:`authenticate`.

The API's views (DRF, through :class:`BearerTokenAuthentication`), the stream and /mcp/ (in
front of Django, board.live.stream and board.mcp.endpoint) and waiting claims (whose
attempts are the API's) all take a user from the same function: an API token in the
``Authorization`` header (``Bearer <token>``, or DRF's ``Token <token>``), else a session
key, giving the active user or a typed :class:`Refused`.

Tokens are stored hashed (access.tokens); they are looked up by their digest, through a
short-lived cache in the process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from importlib import import_module
from types import SimpleNamespace
from typing import Any

from django.conf import settings
from django.contrib import auth
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.request import Request

from access import throttle, tokens
from board import conf

KEYWORDS = ("bearer", "token")
NOT_PROVIDED = "Authentication credentials were not provided."


@dataclass(frozen=True)
class Authenticated:
    user: Any
    token: Any = None  # the ApiToken, when a token authenticated the request


@dataclass(frozen=True)
class Refused:
    """Why a request is not authenticated: the 401's ``detail``; whether it presented
    credentials (a failure the throttle counts); and for an address over the
    failed-authentication limit, the seconds until it may try again (a 429)."""

    detail: str
    presented: bool = False
    throttled_for: int | None = None


def authenticate(
    authorization: str, session_key: str = "", *, address: str | None = None
) -> Authenticated | Refused:
    """The active user that the ``Authorization`` header's token names, or else the
    session ``session_key`` names; or why not.

    ``address`` is the client's, for the entry points in front of Django (the stream,
    /mcp/): an address over the failed-authentication limit (access.throttle) is refused
    before any lookup, and a refusal of presented credentials is counted against it.
    Without it the request is Django's, whose middleware does both around the whole
    request (access.throttle.FailedAuthenticationThrottle). A database error is raised.
    """
    if address is not None and (seconds := throttle.retry_after(address)) is not None:
        return Refused("Throttled.", throttled_for=seconds)
    result = _authenticate(authorization, session_key)
    if address is not None and isinstance(result, Refused) and result.presented:
        throttle.record_failure(address)
    return result


def _authenticate(authorization: str, session_key: str) -> Authenticated | Refused:
    presented = throttle.presented_credentials(authorization)
    parts = authorization.split()
    if parts and parts[0].lower() in KEYWORDS:
        if len(parts) != 2:
            return Refused("Invalid Authorization header: use 'Bearer <token>'.", presented)
        try:
            key = parts[1].encode("latin-1").decode()  # as a header's bytes are decoded
        except UnicodeError:
            return Refused("Invalid token.", presented)
        return token_user(key)
    if session_key:
        user = auth.get_user(SimpleNamespace(session=_session_store(session_key)))  # type: ignore[arg-type]
        if user.is_authenticated:
            return Authenticated(user)
    return Refused(NOT_PROVIDED, presented)


def _session_store(session_key: str) -> Any:
    return import_module(settings.SESSION_ENGINE).SessionStore(session_key)


def token_user(key: str) -> Authenticated | Refused:
    """Look the token up, or take it from this process's short-lived cache.

    Agents send the same token with every call; remembering it for
    TASKBOARD_TOKEN_CACHE_SECONDS saves a query per request. Only successful lookups
    are remembered, so a new token works at once; a deleted or rotated token or a
    deactivated user is refused at most that many seconds later. The cache is keyed by
    the token's digest, so the process keeps no plain token either.
    """
    digest = tokens.digest(key)
    cached = _cached(digest)
    if cached is not None:
        return Authenticated(*cached)
    started = _generation
    found = tokens.user_for(key)
    if found is None:
        return Refused("Invalid token.", presented=True)
    user, token = found
    if not user.is_active:
        return Refused("User inactive or deleted.", presented=True)
    if _generation == started:
        # Not when credentials changed during the lookup: it may have read the database
        # before the change committed, and would vouch for a revoked token.
        remember(digest, user, token)
    return Authenticated(user, token)


class BearerTokenAuthentication(BaseAuthentication):
    """DRF's view of :func:`authenticate`, for the API's views: a token only (DRF's
    SessionAuthentication, next in line, takes the session, with its CSRF check), and no
    throttling here (Django's middleware does it)."""

    keyword = "Bearer"

    def authenticate(self, request: Request) -> tuple[Any, Any] | None:
        header = get_authorization_header(request).decode("latin-1")
        result = authenticate(header)
        if isinstance(result, Refused):
            if result.detail == NOT_PROVIDED:
                return None  # no token: the session may authenticate
            raise exceptions.AuthenticationFailed(result.detail)
        return result.user, result.token

    def authenticate_credentials(self, key: str) -> tuple[Any, Any]:
        result = token_user(key)
        if isinstance(result, Refused):
            raise exceptions.AuthenticationFailed(result.detail)
        return result.user, result.token

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="taskboard"'


def _cached(digest: str) -> tuple[Any, Any] | None:
    cached = _token_cache.get(digest)
    ttl = conf.token_cache_seconds()
    if ttl > 0 and cached is not None and cached[2] > time.monotonic():
        return cached[0], cached[1]
    return None


def cached_user(digest: str) -> Any:
    """The active user of the token with this digest, if this process's cache still
    vouches for it (no query); else None. For /mcp/ (board.mcp.endpoint), as for the API."""
    cached = _cached(digest)
    return cached[0] if cached is not None else None


def remember(digest: str, user: Any, token: Any = None) -> None:
    """Cache a successful lookup of the token with this digest (an active user)."""
    ttl = conf.token_cache_seconds()
    if ttl > 0:
        if len(_token_cache) >= _TOKEN_CACHE_SIZE:
            _token_cache.clear()
        _token_cache[digest] = (user, token, time.monotonic() + ttl)


def generation() -> int:
    """How many changes of credentials this process has heard of (:func:`forget`): a
    lookup made while this changed may predate the change, and is not to be kept."""
    return _generation


def forget(user_id: int | None) -> None:
    """Drop the cached lookups of ``user_id``'s token (None: every one): their credentials
    changed (board.live.revocation)."""
    global _generation
    _generation += 1
    if user_id is None:
        _token_cache.clear()
        return
    for digest, (user, _, _) in list(_token_cache.items()):
        if user.pk == user_id:
            _token_cache.pop(digest, None)


_generation = 0
_TOKEN_CACHE_SIZE = 10_000
# SHA-256 digest of the token -> (user, token, monotonic expiry). Dict reads and writes are
# atomic under the GIL; two threads missing at once both query and store the same answer.
_token_cache: dict[str, tuple[Any, Any, float]] = {}


class BearerTokenScheme(OpenApiAuthenticationExtension):
    """Describe BearerTokenAuthentication in the OpenAPI document as HTTP bearer auth."""

    target_class = "board.api.authentication.BearerTokenAuthentication"
    name = "bearerAuth"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": (
                "An API token: `Authorization: Bearer <token>` (`Token <token>` works too). "
                "`python manage.py create_agent NAME` prints one."
            ),
        }
