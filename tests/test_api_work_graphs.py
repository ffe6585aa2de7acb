"""The API's work graphs: dependencies that block a task until they are done, subtasks,
progress that the next holder resumes from, and the attempt deadline."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from rest_framework.test import APIClient

from board.access import limit_queues
from board.models import Task
from tests.factories import UserFactory
from tests.test_api import assert_error, claim, create, get, post

pytestmark = pytest.mark.django_db


def test_a_task_with_dependencies_is_blocked_until_they_are_done(agent_api: APIClient) -> None:
    first = create(agent_api, title="first")
    then = create(agent_api, title="then", depends_on=[first["id"]], priority=10)
    assert (then["depends_on"], then["blocked"], then["status"]) == ([first["id"]], True, "pending")

    [held] = claim(agent_api, limit=5)
    assert held["id"] == first["id"]
    assert get(agent_api, "tasks/", blocked="true").json()["results"][0]["id"] == then["id"]
    assert [
        t["id"] for t in get(agent_api, "tasks/", depends_on=first["id"]).json()["results"]
    ] == [then["id"]]

    post(agent_api, f"tasks/{first['id']}/complete/", {"lease_token": held["lease_token"]})

    assert get(agent_api, f"tasks/{then['id']}/").json()["blocked"] is False
    assert get(agent_api, "tasks/", blocked="true").json()["results"] == []
    events = get(agent_api, "events/", task=then["id"], type="unblocked").json()["results"]
    assert [(e["actor"], e["payload"]) for e in events] == [("system", {"after": first["id"]})]
    [claimed] = claim(agent_api)
    assert claimed["id"] == then["id"]


@pytest.mark.parametrize(
    ("depends_on", "message"),
    [
        ("dup", "List each item once."),
        ("many", "Ensure this field has no more than 100 elements."),
        (["1"], "Must be an integer."),
        ([0], "Ensure this value is greater than or equal to 1."),
        (5, 'Expected a list of items but got type "int".'),
    ],
)
def test_dependencies_must_be_existing_distinct_tasks(
    agent_api: APIClient, depends_on: Any, message: str
) -> None:
    existing = create(agent_api)["id"]
    if depends_on == "dup":
        depends_on = [existing, existing]
    elif depends_on == "many":
        depends_on = list(range(1, 102))

    response = post(agent_api, "tasks/", {"title": "x", "depends_on": depends_on})

    body = assert_error(response, 400, "invalid")
    assert any(message in text for text in body["fields"]["depends_on"]), body
    assert Task.objects.count() == 1


@pytest.mark.parametrize("field", ["depends_on", "parent_id"])
def test_a_missing_dependency_or_parent_is_not_found(agent_api: APIClient, field: str) -> None:
    existing = create(agent_api)["id"]
    value = [existing, 999_999] if field == "depends_on" else 999_999

    response = post(agent_api, "tasks/", {"title": "x", field: value})

    body = assert_error(response, 404, "not_found")
    assert body["detail"] == f"Task 999999 does not exist ({field})."
    assert Task.objects.count() == 1


def test_subtasks_are_listed_by_parent(agent_api: APIClient) -> None:
    parent = create(agent_api, title="the whole job")
    [held] = claim(agent_api)
    children = [create(agent_api, title=f"part {i}", parent_id=parent["id"]) for i in range(3)]
    create(agent_api, title="unrelated")

    listed = get(agent_api, "tasks/", parent=parent["id"]).json()["results"]

    assert [t["id"] for t in listed] == [c["id"] for c in reversed(children)]
    assert all(t["parent_id"] == parent["id"] for t in listed)
    assert held["id"] == parent["id"]


def test_a_limited_agent_cannot_depend_on_or_split_tasks_it_cannot_see(
    api: Callable[[Any], APIClient], agent_api: APIClient
) -> None:
    hidden = create(agent_api, queue="secret")["id"]
    limited = UserFactory.create(username="agent-limited")
    limit_queues(limited, ["mine"])
    client = api(limited)

    for field, value in (("depends_on", [hidden]), ("parent_id", hidden)):
        body = assert_error(
            post(client, "tasks/", {"title": "x", "queue": "mine", field: value}), 404
        )
        assert body["detail"] == f"Task {hidden} does not exist ({field})."


def test_progress_comes_back_in_the_claim_that_resumes_the_task(
    agent_api: APIClient, api: Callable[[Any], APIClient], other_agent: Any
) -> None:
    task = create(agent_api, max_attempt_seconds=600)
    [held] = claim(agent_api, lease_seconds=60)
    assert held["attempt_started_at"] is not None
    beat = post(
        agent_api,
        f"tasks/{task['id']}/heartbeat/",
        {"lease_token": held["lease_token"], "progress": {"done": 3, "of": 10}},
    ).json()
    assert beat["progress"] == {"done": 3, "of": 10}
    post(agent_api, f"tasks/{task['id']}/release/", {"lease_token": held["lease_token"]})

    [resumed] = claim(api(other_agent))

    assert resumed["progress"] == {"done": 3, "of": 10}
    assert resumed["max_attempt_seconds"] == 600


def test_the_default_attempt_limit_comes_from_the_setting(
    agent_api: APIClient, settings: Any
) -> None:
    settings.TASKBOARD_MAX_ATTEMPT_SECONDS = 900
    assert create(agent_api)["max_attempt_seconds"] == 900
    assert create(agent_api, max_attempt_seconds=5)["max_attempt_seconds"] == 5
    # An explicit null opts out of the server's limit.
    assert create(agent_api, max_attempt_seconds=None)["max_attempt_seconds"] is None
    for bad in (0, 604_801, "60"):
        assert_error(post(agent_api, "tasks/", {"title": "x", "max_attempt_seconds": bad}), 400)


@pytest.mark.django_db(transaction=True)
def test_holder_actions_after_the_attempt_deadline_answer_lease_lost(
    agent_api: APIClient,
) -> None:
    task = create(agent_api, max_attempt_seconds=1)
    [held] = claim(agent_api, lease_seconds=60)
    time.sleep(1.1)

    response = post(
        agent_api, f"tasks/{task['id']}/complete/", {"lease_token": held["lease_token"]}
    )

    body = assert_error(response, 409, "lease_lost")
    assert "attempt deadline passed" in body["detail"]
