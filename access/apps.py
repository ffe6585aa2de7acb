from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.db import connection


class AccessConfig(AppConfig):
    """API tokens (stored hashed) and the throttle on failed authentication."""

    name = "access"
    verbose_name = "Access"

    def ready(self) -> None:
        from django.contrib.auth.signals import user_logged_out, user_login_failed

        from access import throttle
        from board.live import relay

        relay.on_auth_failure(throttle.failure_announced)
        throttle.listened_while(
            lambda: any(running.connected.is_set() for running in relay.running_relays())
        )
        user_login_failed.connect(throttle.on_login_failed, dispatch_uid="access.throttle")
        user_logged_out.connect(announce_logout, dispatch_uid="access.logout")


def announce_logout(sender: Any, request: Any, user: Any, **kwargs: Any) -> None:
    """A logout changes the user's credentials: announce it as the database announces the
    others (migrations board 0014 and 0015, board.live.revocation), so that the streams
    that the ended session opened end now rather than at their next re-check."""
    if user is None or user.pk is None:
        return
    # Django sends this signal before it ends the session: end it first, or a stream's
    # re-check, woken by the notification, may still find the session and keep the stream.
    # (Django's own flush after the signal then finds nothing left to end.)
    session = getattr(request, "session", None)
    if session is not None:
        session.flush()
    with connection.cursor() as cursor:
        cursor.execute("SELECT announce_credentials_changed(%s)", [user.pk])
