from __future__ import annotations

from django.apps import AppConfig


class AccessConfig(AppConfig):
    """API tokens (stored hashed) and the throttle on failed authentication."""

    name = "access"
    verbose_name = "Access"

    def ready(self) -> None:
        from django.contrib.auth.signals import user_login_failed

        from access import throttle

        user_login_failed.connect(throttle.on_login_failed, dispatch_uid="access.throttle")
