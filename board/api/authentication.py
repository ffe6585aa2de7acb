"""Token authentication that accepts ``Bearer <token>`` as well as DRF's ``Token <token>``.

Tokens are stored hashed (access.tokens); this looks them up by their digest.
"""

from __future__ import annotations

import time
from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.request import Request

from access import tokens
from board import conf


class BearerTokenAuthentication(BaseAuthentication):
    keyword = "Bearer"
    keywords = ("bearer", "token")

    def authenticate(self, request: Request) -> tuple[Any, Any] | None:
        auth = get_authorization_header(request).split()
        if not auth or auth[0].lower().decode(errors="replace") not in self.keywords:
            return None
        if len(auth) != 2:
            raise exceptions.AuthenticationFailed(
                "Invalid Authorization header: use 'Bearer <token>'."
            )
        try:
            key = auth[1].decode()
        except UnicodeError:
            raise exceptions.AuthenticationFailed("Invalid token.") from None
        return self.authenticate_credentials(key)

    def authenticate_credentials(self, key: str) -> tuple[Any, Any]:
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
            return cached
        started = _generation
        found = tokens.user_for(key)
        if found is None:
            raise exceptions.AuthenticationFailed("Invalid token.")
        user, token = found
        if not user.is_active:
            raise exceptions.AuthenticationFailed("User inactive or deleted.")
        if _generation == started:
            # Not when credentials changed during the lookup: it may have read the database
            # before the change committed, and would vouch for a revoked token.
            remember(digest, user, token)
        return user, token

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
