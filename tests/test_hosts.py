"""ALLOWED_HOSTS in front of Django: the stream and waiting claims refuse a foreign Host as
every Django page does."""

from __future__ import annotations

import httpx
import pytest

from board.live import relay as relay_module
from tests.factories import TokenFactory, UserFactory
from tests.live import LiveServer

pytestmark = pytest.mark.django_db(transaction=True)

EVIL = {"Host": "evil.example"}


@pytest.fixture
def token_headers() -> dict[str, str]:
    token = TokenFactory.create(user=UserFactory.create(username="host-checker"))
    return {"Authorization": f"Bearer {token.key}"}


def running_relays() -> list[relay_module.Relay]:
    return [relay for loop, relay in relay_module._relays.items() if not loop.is_closed()]


def test_the_stream_answers_a_foreign_host_as_django_does(
    server: LiveServer, token_headers: dict[str, str]
) -> None:
    django_page = httpx.get(f"{server.url}/api/v1/tasks/", headers={**token_headers, **EVIL})
    stream = httpx.get(f"{server.url}/api/v1/stream/", headers={**token_headers, **EVIL})
    anonymous = httpx.get(f"{server.url}/api/v1/stream/", headers=EVIL)

    assert django_page.status_code == 400
    assert stream.status_code == 400
    assert anonymous.status_code == 400, "the Host is checked before the credentials"
    assert stream.json() == anonymous.json() == django_page.json()
    assert stream.json()["error"] == "invalid"


def test_the_stream_still_serves_an_allowed_host(
    server: LiveServer, token_headers: dict[str, str]
) -> None:
    with httpx.stream(
        "GET", f"{server.url}/api/v1/stream/", headers={**token_headers, "Host": "localhost"}
    ) as response:
        assert response.status_code == 200


def test_a_waiting_claim_from_a_foreign_host_is_refused_before_it_waits(
    server: LiveServer, token_headers: dict[str, str]
) -> None:
    refused = httpx.post(
        f"{server.url}/api/v1/tasks/claim/",
        json={"wait": 30},
        headers={**token_headers, **EVIL},
        timeout=10,
    )

    assert refused.status_code == 400
    assert refused.json()["error"] == "invalid"
    # The relay runs from start-up (the webhooks' dispatcher listens through it); the
    # refused request never reached the waiting room that it would have made.
    assert all(getattr(relay, "waiting_room", None) is None for relay in running_relays()), (
        "a refused request never waited"
    )
