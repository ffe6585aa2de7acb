"""The queues and the agents at a glance: counts, pauses, pages, and who holds what."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone
from rest_framework.test import APIClient

from board import transitions
from board.access import limit_queues
from board.models import QueuePause, TaskEvent
from board.sql import QUERIES
from tests.factories import StaffFactory, UserFactory
from tests.test_api import API, TASK_FIELDS, assert_error, claim, create, get, post

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff_api(api: Callable[[Any], APIClient], staff: Any) -> APIClient:
    return api(staff)


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
        "awaiting_input": 0,
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

    pages: list[list[str]] = []
    url: str | None = f"{API}/queues/?limit=2"
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
    limited = UserFactory.create(username="agent-limited")
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
    StaffFactory.create(username="never-claimed")

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
    limited = UserFactory.create(username="agent-limited")
    limit_queues(limited, ["mine"])
    client = api(limited)
    assert get(client, "agents/").json() == []
    create(agent_api, queue="mine")
    [mine] = claim(client)

    agents = get(client, "agents/").json()

    assert [(a["name"], a["holding"]) for a in agents] == [("agent-limited", [mine["id"]])]
