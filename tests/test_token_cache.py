"""A server process remembers token lookups for TASKBOARD_TOKEN_CACHE_SECONDS."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from access import tokens
from access.models import ApiToken
from board.api import authentication
from tests.factories import TokenFactory, UserFactory

pytestmark = pytest.mark.django_db


def client_with(token: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client


def token_queries(client: APIClient) -> int:
    with CaptureQueriesContext(connection) as queries:
        assert client.get("/api/v1/events/").status_code == 200
    return sum("api_tokens" in query["sql"] for query in queries.captured_queries)


def test_a_known_token_is_looked_up_once_per_process() -> None:
    client = client_with(TokenFactory(user=UserFactory(username="repeat")).key)

    assert token_queries(client) == 1
    assert token_queries(client) == 0


def test_without_the_cache_a_deleted_token_is_refused_at_once(settings: Any) -> None:
    settings.TASKBOARD_TOKEN_CACHE_SECONDS = 0
    token = TokenFactory(user=UserFactory(username="revoked"))
    client = client_with(token.key)
    assert client.get("/api/v1/events/").status_code == 200

    ApiToken.objects.filter(digest=tokens.digest(token.key)).delete()

    assert client.get("/api/v1/events/").status_code == 401


def test_an_unknown_token_is_never_remembered() -> None:
    client = client_with("0" * 40)
    assert client.get("/api/v1/events/").status_code == 401

    token = TokenFactory(user=UserFactory(username="late"))
    ApiToken.objects.filter(pk=token.pk).update(digest=tokens.digest("0" * 40))

    assert client.get("/api/v1/events/").status_code == 200


def test_the_cache_keeps_no_plain_token() -> None:
    token = TokenFactory(user=UserFactory(username="cached"))
    client_with(token.key).get("/api/v1/events/")

    assert list(authentication._token_cache) == [tokens.digest(token.key)]
    assert token.key not in repr(authentication._token_cache)
