"""Comments on tasks: anyone comments on a task in any status, and each is an event."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from rest_framework.test import APIClient

from board.access import limit_queues
from board.models import TaskEvent
from tests.factories import UserFactory
from tests.test_api import assert_error, claim, create, get, post

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff_api(api: Callable[[Any], APIClient], staff: Any) -> APIClient:
    return api(staff)


def test_anyone_comments_on_a_task_in_any_status(
    agent_api: APIClient, staff_api: APIClient
) -> None:
    task = create(agent_api)
    [held] = claim(agent_api)
    response = post(agent_api, f"tasks/{task['id']}/comments/", {"body": "halfway there"})
    assert response.status_code == 201, response.content
    event = response.json()
    assert (event["type"], event["status"], event["actor"], event["payload"]) == (
        "commented",
        "in_progress",
        "agent-smith",
        {"body": "halfway there"},
    )
    post(agent_api, f"tasks/{task['id']}/complete/", {"lease_token": held["lease_token"]})
    post(staff_api, f"tasks/{task['id']}/comments/", {"body": "thanks"})

    history = get(agent_api, f"tasks/{task['id']}/events/").json()["results"]
    assert [(e["type"], e["actor"]) for e in history][-3:] == [
        ("commented", "agent-smith"),
        ("completed", "agent-smith"),
        ("commented", "ops-alice"),
    ]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "body"),
        ({"body": ""}, "body"),
        ({"body": "   "}, "body"),
        ({"body": "x" * 10_001}, "body"),
        ({"body": 5}, "body"),
    ],
)
def test_a_comment_needs_a_body_of_1_to_10000_characters(
    agent_api: APIClient, body: dict[str, Any], field: str
) -> None:
    task = create(agent_api)
    response = post(agent_api, f"tasks/{task['id']}/comments/", body)
    assert field in assert_error(response, 400, "invalid")["fields"]
    assert not TaskEvent.objects.filter(type="commented").exists()


def test_comments_on_a_missing_or_hidden_task_are_refused(
    agent_api: APIClient, api: Callable[[Any], APIClient]
) -> None:
    assert_error(post(agent_api, "tasks/999999/comments/", {"body": "hi"}), 404, "not_found")
    hidden = create(agent_api, queue="secret")
    limited = UserFactory.create(username="agent-limited")
    limit_queues(limited, ["mine"])
    response = post(api(limited), f"tasks/{hidden['id']}/comments/", {"body": "hi"})
    assert response.status_code in (403, 404)
    assert not TaskEvent.objects.filter(type="commented").exists()
