"""The management commands that give agents and humans their API tokens."""

from __future__ import annotations

from io import StringIO
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fast_password_hashing")]


def run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def client_with(token: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client


def test_create_agent_prints_the_token_as_the_last_line() -> None:
    output = run("create_agent", "bot-1")

    token = output.splitlines()[-1]
    assert token == Token.objects.get(user__username="bot-1").key
    assert len(token) >= 32 and " " not in token


def test_the_token_create_agent_prints_authenticates_as_the_agent() -> None:
    token = run("create_agent", "bot-1").splitlines()[-1]

    response = client_with(token).post("/api/v1/tasks/", {"title": "hello"}, format="json")

    assert response.status_code == 201, response.content
    assert response.json()["created_by"] == "bot-1"


def test_create_agent_run_twice_reuses_the_user_and_its_token() -> None:
    first = run("create_agent", "bot-1").splitlines()[-1]
    second = run("create_agent", "bot-1").splitlines()[-1]

    assert first == second
    assert get_user_model().objects.filter(username="bot-1").count() == 1
    assert Token.objects.filter(user__username="bot-1").count() == 1


def test_create_agent_gives_each_agent_its_own_token() -> None:
    first = run("create_agent", "bot-1").splitlines()[-1]
    second = run("create_agent", "bot-2").splitlines()[-1]

    assert first != second
    assert client_with(second).get("/api/v1/tasks/").status_code == 200


def test_an_agent_made_by_create_agent_has_no_password_to_log_in_with() -> None:
    run("create_agent", "bot-1")

    agent = get_user_model().objects.get(username="bot-1")
    assert not agent.has_usable_password()
    assert not agent.is_staff


@pytest.mark.parametrize(
    "name",
    [
        "two words",
        "slash/name",
        "semi;colon",
        "x" * 151,
        "",
        "   ",
    ],
)
def test_create_agent_refuses_an_invalid_username(name: str) -> None:
    with pytest.raises(CommandError):
        run("create_agent", name)

    assert not get_user_model().objects.exists()
    assert not Token.objects.exists()


def test_drf_create_token_gives_a_human_a_working_token(staff: Any) -> None:
    output = run("drf_create_token", staff.username)

    token = Token.objects.get(user=staff).key
    assert token in output
    response = client_with(token).get("/api/v1/tasks/")
    assert response.status_code == 200, response.content
