"""Token authentication that accepts ``Bearer <token>`` as well as DRF's ``Token <token>``."""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension
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
