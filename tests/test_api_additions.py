"""The API of the contract's December additions: work graphs, idempotent create, comments,
queues and agents at a glance."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import httpx
import pytest
from django.db import connection
from django.utils import timezone
from rest_framework.test import APIClient

from board import transitions
from board.access import limit_queues
from board.models import QueuePause, Task, TaskEvent
from board.sql import QUERIES
from tests.factories import StaffFactory, TokenFactory, UserFactory
from tests.live import LiveServer
from tests.test_api import API, TASK_FIELDS, assert_error, get, post

pytestmark = pytest.mark.django_db


@pytest.fixture
def agent_api(api: Callable[[Any], APIClient], agent: Any) -> APIClient:
    return api(agent)


@pytest.fixture
def staff_api(api: Callable[[Any], APIClient], staff: Any) -> APIClient:
    return api(staff)


def create(client: APIClient, **body: Any) -> dict[str, Any]:
    response = post(client, "tasks/", {"title": "t", **body})
    assert response.status_code == 201, response.content
    return dict(response.json())


def claim(client: APIClient, **body: Any) -> list[dict[str, Any]]:
    response = post(client, "tasks/claim/", body)
    assert response.status_code == 200, response.content
    return list(response.json()["tasks"])


# -- Work graphs ------------------------------------------------------------------------


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
    limited = UserFactory(username="agent-limited")
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


# -- Idempotent create ------------------------------------------------------------------


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
    token = TokenFactory(user=UserFactory(username="racer"))
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


# -- Comments ---------------------------------------------------------------------------


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
    limited = UserFactory(username="agent-limited")
    limit_queues(limited, ["mine"])
    response = post(api(limited), f"tasks/{hidden['id']}/comments/", {"body": "hi"})
    assert response.status_code in (403, 404)
    assert not TaskEvent.objects.filter(type="commented").exists()


# -- Queues and agents ------------------------------------------------------------------


def test_queues_lists_each_queue_with_its_counts(agent_api: APIClient, staff: Any) -> None:
    first = create(agent_api, queue="build")
    create(agent_api, queue="build", depends_on=[first["id"]])
    create(agent_api, queue="build")
    cancelled = create(agent_api, queue="docs")
    transitions.cancel(task_id=cancelled["id"], actor=staff)
    claim(agent_api, queues=["build"])

    response = get(agent_api, "queues/")

    assert response.status_code == 200
    queues = {q["name"]: q for q in response.json()}
    assert set(queues) == {"build", "docs"}
    assert queues["build"]["counts"] == {
        "pending": 1,
        "blocked": 1,
        "in_progress": 1,
        "escalated": 0,
        "done": 0,
        "cancelled": 0,
    }
    assert queues["build"]["paused"] is False
    assert queues["build"]["oldest_pending_at"] is not None
    assert queues["docs"]["counts"]["cancelled"] == 1
    assert queues["docs"]["oldest_pending_at"] is None
    assert set(queues["docs"]) == {"name", "paused", "counts", "oldest_pending_at"}


@pytest.mark.django_db(transaction=True)  # now(): each request's own
def test_oldest_pending_at_is_that_of_the_oldest_task_that_can_be_claimed(
    agent_api: APIClient,
) -> None:
    """A task that is not due yet (run_after in the future, or failed with retry_after)
    waits by design: the queue's oldest pending task is the oldest one a claim could take,
    or none (the metric's age, and the alert on it, read this)."""
    later = (timezone.now() + timedelta(hours=1)).isoformat()
    create(agent_api, queue="scheduled", run_after=later)
    retried = create(agent_api, queue="retried")
    [claimed] = claim(agent_api, queues=["retried"])
    failed = post(
        agent_api,
        f"tasks/{retried['id']}/fail/",
        {"lease_token": claimed["lease_token"], "error": "later", "retry_after": 600},
    )
    assert failed.status_code == 200, failed.content
    create(agent_api, queue="mixed", run_after=later)
    due = create(agent_api, queue="mixed")
    soon = (timezone.now() + timedelta(seconds=1)).isoformat().replace("+00:00", "Z")
    came_due = create(agent_api, queue="came_due", run_after=soon)
    time.sleep(1.1)

    queues = {q["name"]: q for q in get(agent_api, "queues/").json()}

    assert queues["scheduled"]["counts"]["pending"] == 1
    assert queues["scheduled"]["oldest_pending_at"] is None
    assert queues["retried"]["counts"]["pending"] == 1
    assert queues["retried"]["oldest_pending_at"] is None
    assert queues["mixed"]["oldest_pending_at"] == due["created_at"]
    # Claimable since it came due, not since it was made.
    assert queues["came_due"]["oldest_pending_at"] == came_due["run_after"]


@pytest.mark.django_db
def test_oldest_pending_at_is_one_index_step_past_any_number_of_scheduled_tasks(
    agent_api: APIClient,
) -> None:
    """A queue with 20,000 tasks scheduled for tomorrow ahead of its one due task: the
    answer reads one entry of an index, not the scheduled tasks (it read all of them)."""
    create(agent_api, queue="busy")
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO tasks (title, description, payload, queue, priority, max_failures,"
            " run_after, status, failure_count, created_by, created_at, updated_at)"
            " SELECT 'later', '', '{}', 'busy', 0, 3, now() + interval '1 day', 'pending', 0,"
            " 'agent-smith', now() - interval '1 hour', now() FROM generate_series(1, 20000)"
        )
        cursor.execute("ANALYZE tasks")
        cursor.execute(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + QUERIES["queue_list"],
            {"all_queues": True, "queues": [], "after": None, "limit": None},
        )
        plan = cursor.fetchone()[0][0]["Plan"]

    def nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
        return [node, *(n for child in node.get("Plans", []) for n in nodes(child))]

    read = [n for n in nodes(plan) if n.get("Relation Name") == "tasks"]
    assert read and all(n["Node Type"] == "Index Scan" for n in read), read
    assert all(n["Actual Rows"] <= 1 for n in read), read
    assert all(n.get("Rows Removed by Filter", 0) == 0 for n in read), read


def test_queues_come_in_pages_by_name_with_a_link_to_the_next(
    agent_api: APIClient, agent: Any
) -> None:
    for name in ("c", "a", "e", "b", "d"):
        transitions.create(actor=agent, title="t", queue=name)

    pages, url = [], f"{API}/queues/?limit=2"
    while url:
        response = agent_api.get(url)
        assert response.status_code == 200, response.content
        pages.append([q["name"] for q in response.json()])
        link = response.get("Link")
        url = link[1 : link.index(">")] if link else None
        assert link is None or link.endswith('>; rel="next"')
    assert pages == [["a", "b"], ["c", "d"], ["e"]]
    assert [q["name"] for q in get(agent_api, "queues/", after="b", limit=1).json()] == ["c"]
    assert_error(get(agent_api, "queues/", after="Not A Queue!"), 400, "invalid")
    assert_error(get(agent_api, "queues/", limit=1001), 400, "invalid")


def test_two_thousand_queues_answer_a_bounded_page_and_a_link_to_the_rest(
    agent_api: APIClient, agent: Any
) -> None:
    from taskboard_agent.client import QUEUE_PAGE

    names = sorted(f"q{n:04}" for n in range(2000))
    for name in names:
        transitions.create(actor=agent, title="t", queue=name)

    response = get(agent_api, "queues/")
    assert [q["name"] for q in response.json()] == names[:QUEUE_PAGE]
    assert len(response.content) < 250_000  # 2,000 queues answered 353 kB in one
    assert "after=q0999" in response["Link"]
    rest = agent_api.get(response["Link"][1 : response["Link"].index(">")])
    assert [q["name"] for q in rest.json()] == names[QUEUE_PAGE:]
    assert "Link" not in rest


def test_a_limited_agent_sees_only_its_queues(
    agent_api: APIClient, api: Callable[[Any], APIClient]
) -> None:
    create(agent_api, queue="mine")
    create(agent_api, queue="secret")
    limited = UserFactory(username="agent-limited")
    limit_queues(limited, ["mine"])
    assert [q["name"] for q in get(api(limited), "queues/").json()] == ["mine"]


def test_only_staff_pause_and_resume_and_each_is_recorded(
    agent_api: APIClient, staff_api: APIClient
) -> None:
    create(agent_api, queue="deploys")
    assert_error(post(agent_api, "queues/deploys/pause/", {}), 403, "permission_denied")

    paused = post(staff_api, "queues/deploys/pause/", {"note": "release freeze"})
    assert paused.status_code == 200, paused.content
    assert paused.json()["paused"] is True
    assert claim(agent_api) == []
    assert get(agent_api, "queues/").json()[0]["paused"] is True

    resumed = post(staff_api, "queues/deploys/resume/", {})
    assert resumed.json()["paused"] is False
    assert len(claim(agent_api)) == 1
    assert list(QueuePause.objects.order_by("id").values_list("paused", "actor", "note")) == [
        (True, "ops-alice", "release freeze"),
        (False, "ops-alice", ""),
    ]
    assert_error(post(staff_api, "queues/Not%20A%20Queue/pause/", {}), 404)


def test_agents_lists_who_holds_what_and_how_their_leases_ended(
    agent_api: APIClient, api: Callable[[Any], APIClient], other_agent: Any
) -> None:
    for _ in range(3):
        create(agent_api)
    first, second = claim(agent_api, limit=2)
    post(agent_api, f"tasks/{first['id']}/complete/", {"lease_token": first["lease_token"]})
    [theirs] = claim(api(other_agent))
    post(
        api(other_agent),
        f"tasks/{theirs['id']}/fail/",
        {"lease_token": theirs["lease_token"], "error": "no"},
    )
    StaffFactory(username="never-claimed")

    agents = {a["name"]: a for a in get(agent_api, "agents/").json()}

    assert set(agents) == {"agent-smith", "agent-jones"}
    smith = agents["agent-smith"]
    assert smith["holding"] == [second["id"]]
    assert (smith["completed_24h"], smith["failed_24h"], smith["expired_24h"]) == (1, 0, 0)
    assert smith["last_seen_at"] is not None
    assert agents["agent-jones"]["failed_24h"] == 1
    assert agents["agent-jones"]["holding"] == []
    assert set(smith) == {
        "name",
        "holding",
        "last_seen_at",
        "completed_24h",
        "failed_24h",
        "expired_24h",
    }


def last_seen_of(client: APIClient, name: str = "agent-smith") -> str:
    """The ``last_seen_at`` that GET agents/ shows for the agent ``name``."""
    [agent] = [a for a in get(client, "agents/").json() if a["name"] == name]
    return str(agent["last_seen_at"])


@pytest.mark.django_db(transaction=True)
def test_an_agents_last_sighting_survives_its_expired_lease_going_to_another(
    agent_api: APIClient, api: Callable[[Any], APIClient], other_agent: Any
) -> None:
    # Claims and heartbeats are seen through the task held; once an expired lease went to
    # another agent, the holder's last_seen_at went back to its last complete.
    create(agent_api)
    create(agent_api, priority=-1)
    [done] = claim(agent_api)
    post(agent_api, f"tasks/{done['id']}/complete/", {"lease_token": done["lease_token"]})
    time.sleep(0.05)
    claim(agent_api, lease_seconds=1)

    seen_holding = last_seen_of(agent_api)
    time.sleep(1.1)
    [taken] = claim(api(other_agent))

    assert TaskEvent.objects.get(task_id=taken["id"], type="expired").actor == "system"
    assert last_seen_of(agent_api) == seen_holding


@pytest.mark.django_db(transaction=True)
def test_an_agents_last_sighting_does_not_move_for_what_others_do_to_its_dependencies(
    agent_api: APIClient, api: Callable[[Any], APIClient], other_agent: Any, staff: Any
) -> None:
    """The holder of a task whose dependency is requeued and completed again by others did
    nothing meanwhile: a stalled agent must not look alive."""
    other = api(other_agent)
    dependency = create(other)
    create(other, depends_on=[dependency["id"]])
    [held] = claim(other)
    post(other, f"tasks/{held['id']}/complete/", {"lease_token": held["lease_token"]})
    claim(agent_api, lease_seconds=120)
    seen = last_seen_of(agent_api)

    time.sleep(0.05)
    transitions.requeue(task_id=dependency["id"], actor=staff)
    after_requeue = last_seen_of(agent_api)
    time.sleep(0.05)
    [again] = claim(other)
    post(other, f"tasks/{again['id']}/complete/", {"lease_token": again["lease_token"]})

    assert (after_requeue, last_seen_of(agent_api)) == (seen, seen)


@pytest.mark.django_db(transaction=True)
def test_an_expiry_never_takes_an_agents_last_sighting_back_across_hours(
    agent_api: APIClient, api: Callable[[Any], APIClient], other_agent: Any
) -> None:
    create(agent_api)
    create(agent_api, priority=-1)
    [held] = claim(agent_api, lease_seconds=1)  # seen at its claim, then never again
    time.sleep(0.05)
    [done] = claim(agent_api)
    post(agent_api, f"tasks/{done['id']}/complete/", {"lease_token": done["lease_token"]})
    seen_completing = last_seen_of(agent_api)
    # The complete was counted in an hour gone by; the expiry goes to this hour's row.
    with connection.cursor() as cursor:
        cursor.execute("UPDATE agent_activity SET hour = hour - interval '1 hour'")
    time.sleep(1.1)
    [taken] = claim(api(other_agent))

    assert taken["id"] == held["id"]
    assert last_seen_of(agent_api) == seen_completing


def test_task_fields_include_the_additions(agent_api: APIClient) -> None:
    assert set(create(agent_api)) == TASK_FIELDS


def test_a_limited_agent_sees_only_itself_among_the_agents(
    agent_api: APIClient, api: Callable[[Any], APIClient]
) -> None:
    create(agent_api, queue="secret")
    claim(agent_api)
    limited = UserFactory(username="agent-limited")
    limit_queues(limited, ["mine"])
    client = api(limited)
    assert get(client, "agents/").json() == []
    create(agent_api, queue="mine")
    [mine] = claim(client)

    agents = get(client, "agents/").json()

    assert [(a["name"], a["holding"]) for a in agents] == [("agent-limited", [mine["id"]])]
