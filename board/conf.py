"""The board's settings, typed, with their defaults (set from the environment in settings.py)."""

from __future__ import annotations

from django.conf import settings

MAX_LEASE_SECONDS = 86400
MAX_WAIT_SECONDS = 60
MAX_CLAIM_LIMIT = 100
MAX_BODY_BYTES = 1024 * 1024


def lease_seconds() -> int:
    """Return the lease length a claim gets when it asks for none (TASKBOARD_LEASE_SECONDS)."""
    return int(getattr(settings, "TASKBOARD_LEASE_SECONDS", 120))


def max_failures() -> int:
    """Return the strikes before escalation for a task that names none (TASKBOARD_MAX_FAILURES)."""
    return int(getattr(settings, "TASKBOARD_MAX_FAILURES", 3))


def body_timeout() -> float:
    """Return the seconds a request body may take to arrive (TASKBOARD_BODY_TIMEOUT)."""
    return float(getattr(settings, "TASKBOARD_BODY_TIMEOUT", 30))


def max_attempt_seconds() -> int | None:
    """Return how long one attempt may hold a task that names no limit
    (TASKBOARD_MAX_ATTEMPT_SECONDS; unset: no limit)."""
    value = getattr(settings, "TASKBOARD_MAX_ATTEMPT_SECONDS", None)
    return int(value) if value else None
