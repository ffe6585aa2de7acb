"""Idempotent create: a repeated ``Idempotency-Key`` answers the task it created."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from rest_framework.test import APIClient

from board.models import Task
from tests.factories import TokenFactory, UserFactory
from tests.live import LiveServer
from tests.test_api import assert_error, claim, post

pytestmark = pytest.mark.django_db


def test_a_repeated_key_answers_the_task_it_created(agent_api: APIClient) -> None:
    body = {"title": "report", "queue": "reports", "payload": {"month": 11}}
    first = post(agent_api, "tasks/", body, HTTP_IDEMPOTENCY_KEY="report-2026-11")
    assert first.status_code == 201
    assert first.json()["idempotency_key"] == "report-2026-11"
    [held] = claim(agent_api)

    again = post(agent_api, "tasks/", body, HTTP_IDEMPOTENCY_KEY="report-2026-11")

    assert again.status_code == 200
    # The task as it is now: claimed since.
    assert again.json()["id"] == first.json()["id"]
    assert again.json()["status"] == "in_progress"
    assert held["id"] == first.json()["id"]
    other = post(
        agent_api, "tasks/", {**body, "title": "other"}, HTTP_IDEMPOTENCY_KEY="report-2026-11"
    )
    assert_error(other, 409, "idempotency_conflict")
    assert Task.objects.count() == 1


def test_keys_of_different_users_never_collide(
    agent_api: APIClient, api: Callable[[Any], APIClient], other_agent: Any
) -> None:
    mine = post(agent_api, "tasks/", {"title": "a"}, HTTP_IDEMPOTENCY_KEY="same")
    theirs = post(api(other_agent), "tasks/", {"title": "b"}, HTTP_IDEMPOTENCY_KEY="same")
    assert (mine.status_code, theirs.status_code) == (201, 201)
    assert mine.json()["id"] != theirs.json()["id"]


@pytest.mark.parametrize("key", ["", "has space", "x" * 256, "caf\u00e9"])
def test_an_idempotency_key_is_1_to_255_visible_ascii_characters(
    agent_api: APIClient, key: str
) -> None:
    response = post(agent_api, "tasks/", {"title": "a"}, HTTP_IDEMPOTENCY_KEY=key)
    body = assert_error(response, 400, "invalid")
    assert "Idempotency-Key" in body["fields"]
    assert Task.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_racing_identical_requests_over_http_create_one_task(server: LiveServer) -> None:
    token = TokenFactory.create(user=UserFactory.create(username="racer"))
    headers = {"Authorization": f"Bearer {token.key}", "Idempotency-Key": "race-1"}
    barrier = threading.Barrier(8)
    answers: list[httpx.Response] = []

    def send() -> None:
        barrier.wait(timeout=10)
        answers.append(
            httpx.post(
                f"{server.url}/api/v1/tasks/", json={"title": "once"}, headers=headers, timeout=30
            )
        )

    threads = [threading.Thread(target=send) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    assert sorted(a.status_code for a in answers) == [200] * 7 + [201]
    assert len({a.json()["id"] for a in answers}) == 1
    assert Task.objects.count() == 1
