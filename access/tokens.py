"""Issue, rotate and look up API tokens. Only a token's SHA-256 digest is stored.

A token is 160 random bits from ``secrets`` (40 hex characters, the shape DRF's tokens
had). It is shown once, by whatever issued it (``create_agent``, ``drf_create_token``, the
admin's rotation, the first run of ``serve``), and cannot be shown again.

Why a fast hash and not a password hasher: PBKDF2 or Argon2 slow down guessing of
low-entropy secrets (passwords). Nobody guesses 160 random bits, fast hash or not, so key
stretching would only add its cost to every request. A fast, unsalted digest also lets the
database find the token by an index on the digest, where a salted hash would have to be
checked row by row.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

from django.db import transaction
from django.utils import timezone

from access.models import ApiToken

TOKEN_BYTES = 20


def digest(key: str) -> str:
    """Return the hex SHA-256 of ``key``, the form in which tokens are stored."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def issue(user: Any) -> ApiToken:
    """Give ``user`` a new token, replacing the one it had; return it with its ``key``.

    The old token stops working at once in every process that has not cached it, and
    within TASKBOARD_TOKEN_CACHE_SECONDS in those that have.
    """
    key = secrets.token_hex(TOKEN_BYTES)
    with transaction.atomic():
        token, _ = ApiToken.objects.update_or_create(
            user=user, defaults={"digest": digest(key), "created": timezone.now()}
        )
    token.key = key
    return token


def user_for(key: str) -> tuple[Any, ApiToken] | None:
    """Return (user, token) for the token ``key``, or None when no token has that key."""
    token = ApiToken.objects.select_related("user").filter(digest=digest(key)).first()
    return (token.user, token) if token is not None else None
