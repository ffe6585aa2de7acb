"""API tokens, stored as SHA-256 digests, the counts of failed authentications, and the
writes each user made lately (access.rates).

Why a model of the board's own rather than ``rest_framework.authtoken`` (plain-text keys) or
django-rest-knox (hashed): the contract keeps one token per user with
``drf_create_token``'s semantics and output, and accepts both ``Bearer`` and ``Token``.
Knox gives each login a token of its own with an expiry, keeps the first characters of
every token in plain text to find it, accepts one header keyword, and brings login and
logout views the board does not use. What the board needs is this small table and
``access.tokens``.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone


class ApiToken(models.Model):
    """A user's API token, of which only the SHA-256 digest is kept (see access.tokens)."""

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL,
        on_delete=models.CASCADE,
        primary_key=True,
        related_name="api_token",
    )
    digest = models.CharField(max_length=64, unique=True, editable=False)
    created = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        db_table = "api_tokens"
        verbose_name = "API token"

    # The plain token, on the instance that issued it and nowhere else: it is shown once
    # and never stored (access.tokens.issue sets it).
    key: str | None = None

    def __str__(self) -> str:
        return f"API token of {self.user}"


class AuthFailure(models.Model):
    """Failed authentications from one client address in one time window.

    The table is UNLOGGED (migration 0001): counts are worth no WAL and may be lost in a
    crash. Written only by access.throttle, one upsert per failure.
    """

    # Window first: the lookup names both, and dropping ended windows is a range on it.
    pk = models.CompositePrimaryKey("window_end", "address")
    window_end = models.DateTimeField()
    address = models.TextField()
    failures = models.IntegerField()

    class Meta:
        db_table = "auth_failures"

    def __str__(self) -> str:
        return f"{self.failures} failures from {self.address} in the window to {self.window_end}"


class WriteCount(models.Model):
    """The tasks one user created, or the comments one user wrote (``kind``), in one time
    window.

    UNLOGGED like auth_failures (migration 0002): counts are worth no WAL. Written only by
    access.rates, one upsert per create or comment.
    """

    pk = models.CompositePrimaryKey("window_end", "user_id", "kind")
    window_end = models.DateTimeField()
    # The user's id, not a foreign key: a count must not hold up deleting a user.
    user_id = models.BigIntegerField()
    kind = models.TextField()
    count = models.IntegerField()

    class Meta:
        db_table = "write_counts"

    def __str__(self) -> str:
        return f"{self.count} {self.kind} by user {self.user_id} in the window to {self.window_end}"
