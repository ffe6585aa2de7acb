"""Asking a human, assigned tasks and capabilities, over the HTTP API (contract: "Additions
to v1 (second round)"): ask, answer, the hold for the asker, the deadline, the filters,
and every refusal with nothing changed."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection
from rest_framework.test import APIClient

from board import queues as glance
from board.models import Capabilities, Task, TaskEvent
from tests.factories import StaffFactory, UserFactory, grant
from tests.test_api import assert_error, assert_invalid, claim, claim_one, create, get, post

pytestmark = pytest.mark.django_db


@pytest.fixture
def person(db: None) -> Any:
    """A person who may answer questions (the board.answer_task permission)."""
    return grant(UserFactory.create(username="person-pat"), "board.answer_task")


@pytest.fixture
def person_api(api: Callable[[Any], APIClient], person: Any) -> APIClient:
    return api(person)


@pytest.fixture
def other_api(api: Callable[[Any], APIClient], other_agent: Any) -> APIClient:
    return api(other_agent)


def held(client: APIClient, **create_body: Any) -> dict[str, Any]:
    """A task the client created and holds: its claim (with the lease_token)."""
    task = create(client, queue="questions", **create_body)
    claimed = claim_one(client, queues=["questions"])
    assert claimed["id"] == task["id"]
    return claimed


def ask(client: APIClient, claimed: dict[str, Any], **body: Any) -> Any:
    return post(
        client,
        f"tasks/{claimed['id']}/ask/",
        {"lease_token": claimed["lease_token"], "question": "Which schema?", **body},
    )


def asked(client: APIClient, **body: Any) -> dict[str, Any]:
    response = ask(client, held(client), **body)
    assert response.status_code == 200, response.content
    return dict(response.json())


def snapshot(task_id: int) -> tuple[dict[str, Any], int]:
    """The task's row and its number of events: what a refusal must leave as it was."""
    row = dict(Task.objects.filter(id=task_id).values().get())
    return row, TaskEvent.objects.filter(task_id=task_id).count()


def test_ask_ends_the_lease_without_a_strike_and_waits_for_input(agent_api: APIClient) -> None:
    claimed = held(agent_api)

    response = ask(
        agent_api,
        claimed,
        options=["approve", "deny"],
        answer_within=600,
        action_digest="sha256:abc",
    )

    assert response.status_code == 200, response.content
    task = response.json()
    assert task["status"] == "awaiting_input"
    assert task["leased_by"] is None and task["leased_until"] is None
    assert task["attempt_started_at"] is None
    assert task["failure_count"] == 0
    question = task["question"]
    assert set(question) == {
        "event_id",
        "question",
        "options",
        "answer_schema",
        "assignee",
        "answer_by",
        "action_digest",
        "asked_by",
        "asked_at",
    }
    assert question["question"] == "Which schema?"
    assert question["options"] == ["approve", "deny"]
    assert question["asked_by"] == "agent-smith"
    assert question["action_digest"] == "sha256:abc"
    event = TaskEvent.objects.get(id=question["event_id"])
    assert (event.type, event.status, event.actor) == ("asked", "awaiting_input", "agent-smith")
    assert event.payload["question"] == "Which schema?"
    assert event.payload["options"] == ["approve", "deny"]
    assert event.payload["answer_by"]
    # Not claimable while it waits, by anyone.
    assert claim(agent_api, queues=["questions"]) == []


def test_the_answer_is_held_for_the_asker_then_handed_back_with_every_answer(
    agent_api: APIClient, other_api: APIClient, person_api: APIClient
) -> None:
    task = asked(agent_api, options=["a", "b"], action_digest="d1")

    response = post(
        person_api, f"tasks/{task['id']}/answer/", {"answer": "b", "note": "b is safer"}
    )

    assert response.status_code == 200, response.content
    body = response.json()
    assert body["status"] == "pending" and body["question"] is None
    [answer] = body["answers"]
    assert answer["answer"] == "b" and answer["note"] == "b is safer"
    assert answer["answered_by"] == "person-pat" and answer["asked_by"] == "agent-smith"
    event = TaskEvent.objects.filter(task_id=task["id"], type="answered").get()
    assert event.actor == "person-pat"
    assert event.payload == {
        "answer": "b",
        "note": "b is safer",
        "question_event": task["question"]["event_id"],
        "action_digest": "d1",
    }
    # Another agent's claim passes it by during the hold; the asker's takes it first.
    create(agent_api, queue="questions", title="other work", priority=100)
    assert [t["title"] for t in claim(other_api, queues=["questions"])] == ["other work"]
    again = claim_one(agent_api, queues=["questions"])
    assert again["id"] == task["id"]
    assert again["answers"][0]["answer"] == "b"
    done = post(agent_api, f"tasks/{task['id']}/complete/", {"lease_token": again["lease_token"]})
    assert done.status_code == 200 and done.json()["status"] == "done"


def test_after_the_hold_anyone_may_claim_the_answered_task(
    agent_api: APIClient, other_api: APIClient, person_api: APIClient, settings: Any
) -> None:
    settings.TASKBOARD_ANSWER_HOLD_SECONDS = 0
    task = asked(agent_api)

    assert post(person_api, f"tasks/{task['id']}/answer/", {"answer": "v2"}).status_code == 200

    assert claim_one(other_api, queues=["questions"])["id"] == task["id"]


def test_answer_schema_answers_are_validated_by_json_schema(
    agent_api: APIClient, person_api: APIClient
) -> None:
    schema = {
        "type": "object",
        "properties": {"table": {"type": "string"}, "rows": {"type": "integer", "minimum": 1}},
        "required": ["table", "rows"],
    }
    task = asked(agent_api, answer_schema=schema)

    refused = post(person_api, f"tasks/{task['id']}/answer/", {"answer": {"table": "t", "rows": 0}})
    body = assert_invalid(refused, "answer")
    assert "minimum" in json.dumps(body["fields"]["answer"]) or "less than" in body["detail"]
    assert Task.objects.get(id=task["id"]).status == "awaiting_input"

    accepted = post(
        person_api, f"tasks/{task['id']}/answer/", {"answer": {"table": "t", "rows": 3}}
    )
    assert accepted.status_code == 200, accepted.content
    assert accepted.json()["answers"][0]["answer"] == {"table": "t", "rows": 3}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"options": ["a", "b"], "answer_schema": {"type": "string"}}, "answer_schema"),
        ({"answer_schema": {"type": "no-such-type"}}, "answer_schema"),
        ({"answer_schema": {"description": "x" * (64 * 1024)}}, "answer_schema"),
        ({"answer_schema": ["not", "an", "object"]}, "answer_schema"),
        ({"options": ["only one"]}, "options"),
        ({"options": ["same", "same"]}, "options"),
        ({"options": [str(n) for n in range(11)]}, "options"),
        ({"options": ["a", "x" * 201]}, "options"),
        ({"assignee": "nobody-by-this-name"}, "assignee"),
        ({"answer_within": 59}, "answer_within"),
        ({"answer_within": 2_592_001}, "answer_within"),
        ({"question": ""}, "question"),
        ({"question": "x" * 10_001}, "question"),
        ({"action_digest": "x" * 129}, "action_digest"),
    ],
)
def test_a_bad_question_is_refused_and_changes_nothing(
    agent_api: APIClient, body: dict[str, Any], field: str
) -> None:
    claimed = held(agent_api)
    before = snapshot(claimed["id"])

    assert_invalid(ask(agent_api, claimed, **body), field)

    assert snapshot(claimed["id"]) == before


def test_asking_without_the_lease_is_lease_lost(agent_api: APIClient, other_api: APIClient) -> None:
    claimed = held(agent_api)
    before = snapshot(claimed["id"])

    assert_error(ask(other_api, claimed), 409, "lease_lost")
    assert_error(ask(agent_api, {**claimed, "lease_token": "0" * 32}), 409, "lease_lost")

    assert snapshot(claimed["id"]) == before


@pytest.mark.parametrize(
    ("question", "answer"),
    [
        ({"options": ["approve", "deny"]}, "maybe"),
        ({"options": ["approve", "deny"]}, None),
        ({}, ""),
        ({}, 42),
        ({}, "x" * 10_001),
        ({"answer_schema": {"type": "integer"}}, "seven"),
    ],
)
def test_an_answer_that_does_not_answer_is_refused_and_changes_nothing(
    agent_api: APIClient, person_api: APIClient, question: dict[str, Any], answer: Any
) -> None:
    task = asked(agent_api, **question)
    before = snapshot(task["id"])

    assert_invalid(post(person_api, f"tasks/{task['id']}/answer/", {"answer": answer}), "answer")

    assert snapshot(task["id"]) == before


def test_answering_twice_is_an_invalid_transition(
    agent_api: APIClient, person_api: APIClient
) -> None:
    task = asked(agent_api)
    assert post(person_api, f"tasks/{task['id']}/answer/", {"answer": "first"}).status_code == 200
    before = snapshot(task["id"])

    second = post(person_api, f"tasks/{task['id']}/answer/", {"answer": "second"})

    assert assert_error(second, 409, "invalid_transition")["status"] == "pending"
    assert snapshot(task["id"]) == before


def test_only_an_assignee_or_a_user_with_the_permission_may_answer(
    agent_api: APIClient, other_api: APIClient, api: Callable[[Any], APIClient]
) -> None:
    UserFactory.create(username="reviewer-rita")
    task = asked(agent_api, assignee="reviewer-rita")
    task2 = asked(agent_api)
    before = snapshot(task["id"])

    assert_error(post(other_api, f"tasks/{task['id']}/answer/", {"answer": "x"}), 403)
    assert_error(post(agent_api, f"tasks/{task['id']}/answer/", {"answer": "x"}), 403)
    assert snapshot(task["id"]) == before

    rita = api(UserFactory.create(username="reviewer-rita"))
    assert post(rita, f"tasks/{task['id']}/answer/", {"answer": "yes"}).status_code == 200
    superuser = api(StaffFactory.create(username="root-ruth", is_superuser=True))
    assert post(superuser, f"tasks/{task2['id']}/answer/", {"answer": "ok"}).status_code == 200


def test_answering_a_task_that_does_not_wait_for_input_is_refused(
    agent_api: APIClient, person_api: APIClient
) -> None:
    task = create(agent_api)

    assert_error(post(person_api, f"tasks/{task['id']}/answer/", {"answer": "x"}), 409)
    assert_error(post(person_api, "tasks/999999999/answer/", {"answer": "x"}), 404)


def overdue(task_id: int) -> None:
    """Move the question's deadline into the past (a test's shortcut past answer_within)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE tasks SET answer_by = now() - interval '1 second' WHERE id = %s", [task_id]
        )


def test_the_next_claim_escalates_a_question_nobody_answered_in_time(
    agent_api: APIClient, other_api: APIClient
) -> None:
    task = asked(agent_api)
    overdue(task["id"])

    assert claim(other_api, queues=["questions"]) == []

    after = Task.objects.get(id=task["id"])
    assert after.status == "escalated" and after.question is None
    assert after.failure_count == 0
    event = TaskEvent.objects.filter(task_id=task["id"]).latest("id")
    assert (event.type, event.actor) == ("escalated", "system")
    assert event.payload["reason"].startswith("no answer by ")


def test_assigned_tasks_are_claimed_only_by_their_assignee(
    agent_api: APIClient, other_api: APIClient
) -> None:
    task = create(agent_api, queue="assigned", assignee="agent-jones")
    assert task["assignee"] == "agent-jones"

    assert claim(agent_api, queues=["assigned"]) == []
    assert claim_one(other_api, queues=["assigned"])["id"] == task["id"]


def test_a_task_is_claimed_only_by_a_claimant_with_every_required_label(
    agent_api: APIClient, other_api: APIClient, agent: Any, other_agent: Any
) -> None:
    Capabilities.objects.create(user=agent, labels=["gpu"])
    Capabilities.objects.create(user=other_agent, labels=["gpu", "linux:x86_64", "python"])
    task = create(agent_api, queue="labels", requires=["gpu", "python"])
    assert task["requires"] == ["gpu", "python"]

    assert claim(agent_api, queues=["labels"]) == []
    assert claim_one(other_api, queues=["labels"])["id"] == task["id"]


@pytest.mark.parametrize(
    "body",
    [
        {"assignee": "no-such-user"},
        {"requires": ["Upper"]},
        {"requires": ["-leading-dash"]},
        {"requires": ["dup", "dup"]},
        {"requires": [f"l{n}" for n in range(21)]},
        {"requires": "gpu"},
    ],
)
def test_bad_assignees_and_labels_are_refused_on_create(
    agent_api: APIClient, body: dict[str, Any]
) -> None:
    count = Task.objects.count()

    assert_invalid(post(agent_api, "tasks/", {"title": "t", **body}), *body)

    assert Task.objects.count() == count


def test_tasks_filter_by_status_assignee_and_required_label(
    agent_api: APIClient, person_api: APIClient, person: Any
) -> None:
    for_pat = asked(agent_api, assignee="person-pat")
    other_question = asked(agent_api)
    assigned = create(agent_api, queue="filters", assignee="person-pat")
    labelled = create(agent_api, queue="filters", requires=["gpu"])

    def ids(client: APIClient, **params: Any) -> set[int]:
        response = get(client, "tasks/", **params)
        assert response.status_code == 200, response.content
        return {task["id"] for task in response.json()["results"]}

    assert ids(agent_api, status="awaiting_input") == {for_pat["id"], other_question["id"]}
    assert ids(person_api, assignee="me") == {for_pat["id"], assigned["id"]}
    assert ids(agent_api, assignee="person-pat") == {for_pat["id"], assigned["id"]}
    assert ids(person_api, assignee="me", status="awaiting_input") == {for_pat["id"]}
    assert ids(agent_api, requires="gpu") == {labelled["id"]}
    assert_invalid(get(agent_api, "tasks/", requires="Not A Label"), "requires")


def test_queues_count_the_tasks_awaiting_input(agent_api: APIClient) -> None:
    asked(agent_api)

    response = get(agent_api, "queues/")

    [queue] = [q for q in response.json() if q["name"] == "questions"]
    assert queue["counts"]["awaiting_input"] == 1
    assert queue["counts"]["in_progress"] == 0


def test_a_waiting_claim_is_told_when_a_question_is_due_and_when_a_hold_ends(
    agent_api: APIClient, person_api: APIClient
) -> None:
    task = asked(agent_api, answer_within=600)
    row = Task.objects.get(id=task["id"])

    assert glance.next_claimable_at(["questions"]) == row.answer_by
    assert glance.next_claimable_at(["elsewhere"]) is None

    post(person_api, f"tasks/{task['id']}/answer/", {"answer": "fine"})
    row.refresh_from_db()
    assert row.held_until is not None
    assert glance.next_claimable_at(["questions"]) == row.held_until
    assert glance.next_claimable_at(None) == row.held_until
