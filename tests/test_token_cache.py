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
    token = TokenFactory.create(user=UserFactory.create(username="repeat"))
    assert token.key is not None
    client = client_with(token.key)

    assert token_queries(client) == 1
    assert token_queries(client) == 0


def test_without_the_cache_a_deleted_token_is_refused_at_once(settings: Any) -> None:
    settings.TASKBOARD_TOKEN_CACHE_SECONDS = 0
    token = TokenFactory.create(user=UserFactory.create(username="revoked"))
    assert token.key is not None
    client = client_with(token.key)
    assert client.get("/api/v1/events/").status_code == 200

    ApiToken.objects.filter(digest=tokens.digest(token.key)).delete()

    assert client.get("/api/v1/events/").status_code == 401


def test_an_unknown_token_is_never_remembered() -> None:
    client = client_with("0" * 40)
    assert client.get("/api/v1/events/").status_code == 401

    token = TokenFactory.create(user=UserFactory.create(username="late"))
    ApiToken.objects.filter(pk=token.pk).update(digest=tokens.digest("0" * 40))

    assert client.get("/api/v1/events/").status_code == 200


def test_the_cache_keeps_no_plain_token() -> None:
    token = TokenFactory.create(user=UserFactory.create(username="cached"))
    assert token.key is not None
    client_with(token.key).get("/api/v1/events/")

    assert list(authentication._token_cache) == [tokens.digest(token.key)]
    assert token.key not in repr(authentication._token_cache)


def test_a_lookup_that_a_change_of_credentials_overtakes_is_not_remembered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lookup may read the token before a revocation commits and finish after the
    process heard of it (board.live.revocation): remembered, it would vouch for the revoked
    token for TASKBOARD_TOKEN_CACHE_SECONDS, and a stream held again in Pushpin with it
    for TASKBOARD_HELD_STREAM_RECHECK_SECONDS."""
    user = UserFactory.create(username="overtaken")
    key = TokenFactory.create(user=user).key
    assert key is not None
    looked_up = tokens.user_for

    def overtaken(token_key: str) -> Any:
        found = looked_up(token_key)  # read before the change...
        authentication.forget(user.pk)  # ...heard of before the lookup ends
        return found

    monkeypatch.setattr(tokens, "user_for", overtaken)
    authentication.BearerTokenAuthentication().authenticate_credentials(key)

    assert authentication.cached_user(tokens.digest(key)) is None
    monkeypatch.setattr(tokens, "user_for", looked_up)
    authentication.BearerTokenAuthentication().authenticate_credentials(key)
    assert authentication.cached_user(tokens.digest(key)) == user
