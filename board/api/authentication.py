"""Token authentication that accepts ``Bearer <token>`` as well as DRF's ``Token <token>``."""

from __future__ import annotations

from typing import Any

from rest_framework import exceptions
from rest_framework.authentication import TokenAuthentication, get_authorization_header
from rest_framework.request import Request


class BearerTokenAuthentication(TokenAuthentication):
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

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="taskboard"'
