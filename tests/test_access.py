"""Agents limited to queues (board.access): every endpoint, as the contract's "Least
privilege and abuse" says. The limited agent here may use the queues "mine" and "ours";
the other tasks are in "theirs"."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from board import transitions
from board.access import EVERY_QUEUE, QueueAccess, limit_queues, queue_access
from board.live import stream as stream_module
from board.live.waiting import WaitingRoom
from board.models import QueueLimit, Task, TaskEvent
from tests.factories import StaffFactory, TokenFactory, UserFactory, grant
from tests.live import LiveServer, StreamCollector

API = "/api/v1"

HOLDER_ACTIONS: dict[str, dict[str, Any]] = {
    "heartbeat": {"lease_seconds": 300},
    "complete": {"result": {"answer": 42}},
    "fail": {"error": "it broke"},
    "release": {},
    "escalate": {"reason": "needs a human"},
}
STAFF_ACTIONS = {"requeue": {}, "resolve": {"result": 1}, "cancel": {}}

pytestmark = pytest.mark.usefixtures("fast_password_hashing")


def post(client: APIClient, path: str, body: Any = None) -> Any:
    return client.post(f"{API}/{path}", {} if body is None else body, format="json")


def get(client: APIClient, path: str, **params: Any) -> Any:
    return client.get(f"{API}/{path}", params)


def assert_forbidden_queue(response: Any) -> None:
    assert response.status_code == 403, response.content
    body = json.loads(response.content)
    assert body["error"] == "forbidden_queue"
    assert isinstance(body["detail"], str) and body["detail"]


def history(task_id: int) -> list[tuple[str, str]]:
    return list(
        TaskEvent.objects.filter(task_id=task_id).order_by("id").values_list("type", "actor")
    )


@pytest.fixture
def limited(db: None) -> Any:
    user = UserFactory.create(username="agent-limited")
    limit_queues(user, ["mine", "ours"])
    return user


@pytest.fixture
def limited_api(api: Callable[[Any], APIClient], limited: Any) -> APIClient:
    return api(limited)


@pytest.fixture
def theirs(make_task: Callable[..., Any]) -> Any:
    """A pending task in a queue the limited agent may not use."""
    return make_task(title="their task", queue="theirs", priority=100)


@pytest.fixture
def mine(make_task: Callable[..., Any]) -> Any:
    return make_task(title="my task", queue="mine")


@pytest.fixture
def held_theirs(theirs: Any, agent: Any) -> tuple[Any, str]:
    """Their task, claimed by an unlimited agent: (task, lease token)."""
    [claim] = transitions.claim(actor=agent, queues=["theirs"])
    return theirs, claim.lease_token


def escalate(task: Any, agent: Any) -> None:
    [claim] = transitions.claim(actor=agent, queues=[task.queue])
    assert claim.task.pk == task.pk
    transitions.escalate(task_id=task.pk, actor=agent, lease_token=claim.lease_token, reason="x")


# -- The policy itself -----------------------------------------------------------------


def test_a_user_without_a_limit_may_use_every_queue(agent: Any) -> None:
    assert queue_access(agent) == EVERY_QUEUE
    assert queue_access(agent).claim_queues([]) == []


def test_a_limited_user_claims_from_its_own_queues_when_it_names_none(limited: Any) -> None:
    access = queue_access(UserFactory.create(username=limited.username))  # a fresh object: a query

    assert access == QueueAccess(frozenset({"mine", "ours"}))
    assert access.claim_queues([]) == ["mine", "ours"]


def test_lifting_a_limit_gives_every_queue_again(limited: Any) -> None:
    limit_queues(limited, None)

    assert queue_access(UserFactory.create(username=limited.username)) == EVERY_QUEUE


def test_an_agents_limit_costs_no_query_while_its_token_is_cached(
    limited_api: APIClient, mine: Any
) -> None:
    get(limited_api, "tasks/")

    with CaptureQueriesContext(connection) as queries:
        response = get(limited_api, "tasks/")

    assert [t["id"] for t in response.json()["results"]] == [mine.pk]
    assert not [q for q in queries.captured_queries if "queue_limits" in q["sql"]]


def test_a_changed_limit_applies_once_the_token_is_looked_up_again(
    limited_api: APIClient, limited: Any, mine: Any, theirs: Any, settings: Any
) -> None:
    settings.TASKBOARD_TOKEN_CACHE_SECONDS = 0
    assert [t["id"] for t in get(limited_api, "tasks/").json()["results"]] == [mine.pk]

    limit_queues(UserFactory.create(username=limited.username), ["theirs"])

    assert [t["id"] for t in get(limited_api, "tasks/").json()["results"]] == [theirs.pk]


# -- Claim -------------------------------------------------------------------------------


def test_a_limited_claim_without_queues_takes_only_from_its_own_queues(
    limited_api: APIClient, theirs: Any, mine: Any
) -> None:
    first = post(limited_api, "tasks/claim/", {"limit": 10})
    second = post(limited_api, "tasks/claim/", {})

    assert first.status_code == 200, first.content
    assert [task["id"] for task in first.json()["tasks"]] == [mine.id]
    assert second.json() == {"tasks": []}
    assert Task.objects.get(pk=theirs.pk).status == "pending"


@pytest.mark.parametrize("queues", [["theirs"], ["mine", "theirs"]])
def test_a_limited_claim_naming_another_queue_is_refused_with_403(
    limited_api: APIClient, theirs: Any, mine: Any, queues: list[str]
) -> None:
    response = post(limited_api, "tasks/claim/", {"queues": queues})

    assert_forbidden_queue(response)
    assert "theirs" in response.json()["detail"]
    assert set(Task.objects.values_list("status", flat=True)) == {"pending"}


def test_a_limited_claim_naming_its_own_queue_takes_from_it(
    limited_api: APIClient, make_task: Callable[..., Any], mine: Any
) -> None:
    ours = make_task(title="our task", queue="ours", priority=5)

    response = post(limited_api, "tasks/claim/", {"queues": ["mine"]})

    assert [task["id"] for task in response.json()["tasks"]] == [mine.id]
    assert Task.objects.get(pk=ours.pk).status == "pending"


# -- Create ------------------------------------------------------------------------------


@pytest.mark.parametrize("body", [{"queue": "theirs"}, {}], ids=["another queue", "default"])
def test_a_limited_agent_may_not_create_a_task_in_another_queue(
    limited_api: APIClient, body: dict[str, Any]
) -> None:
    response = post(limited_api, "tasks/", {"title": "sneaky", **body})

    assert_forbidden_queue(response)
    assert not Task.objects.exists()


def test_a_limited_agent_creates_tasks_in_its_own_queues(limited_api: APIClient) -> None:
    response = post(limited_api, "tasks/", {"title": "fine", "queue": "ours"})

    assert response.status_code == 201, response.content
    assert Task.objects.get().queue == "ours"


# -- Acting on a task --------------------------------------------------------------------


@pytest.mark.parametrize("action", sorted(HOLDER_ACTIONS))
def test_a_limited_agent_may_not_act_on_a_task_of_another_queue(
    limited_api: APIClient, held_theirs: tuple[Any, str], action: str
) -> None:
    task, token = held_theirs
    before = history(task.pk)

    # Even with the holder's lease token.
    body = {"lease_token": token, **HOLDER_ACTIONS[action]}
    response = post(limited_api, f"tasks/{task.pk}/{action}/", body)

    assert_forbidden_queue(response)
    assert task.queue not in response.json()["detail"], "the name of a queue it may not see"
    assert Task.objects.get(pk=task.pk).status == "in_progress"
    assert history(task.pk) == before


@pytest.mark.parametrize("action", sorted(HOLDER_ACTIONS))
def test_a_limited_agent_acts_on_its_own_queues_tasks(
    limited_api: APIClient, mine: Any, action: str
) -> None:
    [claimed] = post(limited_api, "tasks/claim/", {}).json()["tasks"]

    body = {"lease_token": claimed["lease_token"], **HOLDER_ACTIONS[action]}
    response = post(limited_api, f"tasks/{mine.pk}/{action}/", body)

    assert response.status_code == 200, response.content


@pytest.mark.parametrize("action", sorted(HOLDER_ACTIONS))
def test_acting_on_a_missing_task_is_still_404_for_a_limited_agent(
    limited_api: APIClient, action: str
) -> None:
    body = {"lease_token": "x", **HOLDER_ACTIONS[action]}
    response = post(limited_api, f"tasks/999999/{action}/", body)

    assert response.status_code == 404, response.content


@pytest.mark.parametrize("action", sorted(STAFF_ACTIONS))
def test_limited_staff_may_not_triage_a_task_of_another_queue(
    api: Callable[[Any], APIClient], theirs: Any, agent: Any, action: str
) -> None:
    escalate(theirs, agent)
    before = history(theirs.pk)
    triager = grant(StaffFactory.create(username="ops-limited"), "escalations.triage_task")
    limit_queues(triager, ["mine"])

    response = post(api(triager), f"tasks/{theirs.pk}/{action}/", STAFF_ACTIONS[action])

    assert_forbidden_queue(response)
    assert history(theirs.pk) == before


def test_limited_staff_triage_their_own_queues(
    api: Callable[[Any], APIClient], mine: Any, agent: Any
) -> None:
    escalate(mine, agent)
    triager = grant(StaffFactory.create(username="ops-limited"), "escalations.triage_task")
    limit_queues(triager, ["mine"])

    response = post(api(triager), f"tasks/{mine.pk}/requeue/", {})

    assert response.status_code == 200, response.content


# -- Reading: other queues are invisible -------------------------------------------------


def test_the_task_list_leaves_out_other_queues(
    limited_api: APIClient, theirs: Any, mine: Any, make_task: Callable[..., Any]
) -> None:
    ours = make_task(title="our task", queue="ours")

    everything = get(limited_api, "tasks/")
    asked_for_theirs = get(limited_api, "tasks/", queue="theirs")
    by_status = get(limited_api, "tasks/", status="pending")

    assert [t["id"] for t in everything.json()["results"]] == [ours.id, mine.id]
    assert asked_for_theirs.json() == {"results": [], "next": None}
    assert [t["id"] for t in by_status.json()["results"]] == [ours.id, mine.id]


def test_the_task_list_pages_through_only_the_agents_queues(
    limited_api: APIClient, make_task: Callable[..., Any]
) -> None:
    visible = {make_task(queue=("mine", "theirs")[n % 2]).id for n in range(12)}
    visible = {id for id in visible if Task.objects.get(pk=id).queue == "mine"}

    seen: list[int] = []
    url: str | None = f"{API}/tasks/?limit=2"
    while url is not None:
        body = limited_api.get(url).json()
        seen += [task["id"] for task in body["results"]]
        url = body["next"]

    assert sorted(seen) == sorted(visible)


@pytest.mark.parametrize("path", ["tasks/{id}/", "tasks/{id}/events/"])
def test_a_task_of_another_queue_is_404_when_read_by_id(
    limited_api: APIClient, theirs: Any, path: str
) -> None:
    response = get(limited_api, path.format(id=theirs.pk))

    assert response.status_code == 404, response.content
    assert response.json()["error"] == "not_found"


def test_a_limited_agent_reads_its_own_queues_tasks_and_their_events(
    limited_api: APIClient, mine: Any
) -> None:
    task = get(limited_api, f"tasks/{mine.pk}/")
    events = get(limited_api, f"tasks/{mine.pk}/events/")

    assert task.json()["id"] == mine.pk
    assert [e["type"] for e in events.json()["results"]] == ["created"]


def test_the_event_log_leaves_out_other_queues(
    limited_api: APIClient, theirs: Any, mine: Any, agent: Any
) -> None:
    transitions.claim(actor=agent, queues=["theirs"])

    everything = get(limited_api, "events/")
    of_their_task = get(limited_api, "events/", task=theirs.pk)
    claims = get(limited_api, "events/", type="claimed")

    assert [(e["task_id"], e["type"]) for e in everything.json()["results"]] == [
        (mine.pk, "created")
    ]
    assert of_their_task.json()["results"] == []
    assert claims.json()["results"] == []


def test_an_unlimited_agent_still_sees_every_queue(
    api: Callable[[Any], APIClient], agent: Any, theirs: Any, mine: Any
) -> None:
    client = api(agent)

    assert {t["id"] for t in get(client, "tasks/").json()["results"]} == {theirs.pk, mine.pk}
    assert len(get(client, "events/").json()["results"]) == 2


# -- The board pages ---------------------------------------------------------------------


@pytest.fixture
def limited_browser(limited: Any) -> Client:
    # An agent made by create_agent has no password; staff may give a limited user one.
    client = Client()
    client.force_login(limited)
    return client


def test_the_board_shows_a_limited_user_only_its_queues(
    limited_browser: Client, theirs: Any, mine: Any
) -> None:
    response = limited_browser.get("/")

    page = response.content.decode()
    assert response.status_code == 200
    assert "my task" in page
    assert "their task" not in page
    assert "theirs" not in response.context["queues"]
    assert response.context["state"]["counts"]["pending"] == 1


def test_a_task_page_of_another_queue_is_404_for_a_limited_user(
    limited_browser: Client, theirs: Any, mine: Any
) -> None:
    assert limited_browser.get(f"/tasks/{theirs.pk}/").status_code == 404
    assert limited_browser.get(f"/tasks/{mine.pk}/").status_code == 200


# -- The admin ---------------------------------------------------------------------------


def test_staff_set_and_lift_a_limit_on_the_users_admin_page(
    admin_client: Client, limited: Any
) -> None:
    url = f"/admin/auth/user/{limited.pk}/change/"
    page = admin_client.get(url)
    form = {
        "username": limited.username,
        "date_joined_0": "2026-01-01",
        "date_joined_1": "00:00:00",
        "is_active": "on",
        "queue_limit-TOTAL_FORMS": "1",
        "queue_limit-INITIAL_FORMS": "1",
        "queue_limit-MIN_NUM_FORMS": "0",
        "queue_limit-MAX_NUM_FORMS": "1",
        "queue_limit-0-user": str(limited.pk),
        "queue_limit-0-queues": "video, audio, video",
    }

    changed = admin_client.post(url, form)
    after_change = QueueLimit.objects.get(user=limited).queues
    refused = admin_client.post(url, {**form, "queue_limit-0-queues": "Not A Queue"})
    lifted = admin_client.post(url, {**form, "queue_limit-0-DELETE": "on"})

    assert page.status_code == 200
    assert "mine,ours" in page.content.decode()
    assert changed.status_code == 302, changed.context and changed.context["errors"]
    assert after_change == ["audio", "video"]
    assert refused.status_code == 200  # the form again, with the error
    assert lifted.status_code == 302
    assert queue_access(UserFactory.create(username=limited.username)) == EVERY_QUEUE


def test_the_user_list_shows_each_users_queues(admin_client: Client, limited: Any) -> None:
    page = admin_client.get("/admin/auth/user/").content.decode()

    assert "mine, ours" in page
    assert "every queue" in page


# -- The stream and waiting claims, on a live server -------------------------------------

live = pytest.mark.django_db(transaction=True)


def headers_of(user: Any) -> dict[str, str]:
    return {"Authorization": f"Bearer {TokenFactory.create(user=user).key}"}


def make_history(agent: Any, queue: str, title: str) -> list[int]:
    """Create, claim and complete a task in ``queue``; return the ids of its 3 events."""
    task = transitions.create(actor=agent, title=title, queue=queue)
    [claim] = transitions.claim(actor=agent, queues=[queue])
    transitions.complete(task_id=task.pk, actor=agent, lease_token=claim.lease_token)
    return list(TaskEvent.objects.filter(task=task).order_by("id").values_list("id", flat=True))


@live
def test_a_limited_agents_stream_never_carries_another_queues_event(
    server: LiveServer, limited: Any, agent: Any
) -> None:
    url = f"{server.url}/api/v1/stream/"
    with (
        StreamCollector(url, headers_of(limited)) as limited_stream,
        StreamCollector(url, headers_of(agent)) as full_stream,
    ):
        expected = []
        for n in range(3):
            make_history(agent, "theirs", f"theirs {n}")
            expected += make_history(agent, "mine", f"mine {n}")
        make_history(agent, "theirs", "theirs last")
        everything = full_stream.take(21, timeout=30)
        # The full stream has the last event: the limited one has had its chance at it.
        seen = limited_stream.take(len(expected), timeout=30)
        assert limited_stream.nothing_within(1.0)

    assert [int(event["id"]) for event in seen] == expected
    assert {event["json"]["task_id"] for event in everything} > {
        event["json"]["task_id"] for event in seen
    }


@live
@pytest.mark.parametrize("resume", ["after an event", "from the start"])
def test_a_limited_agents_resumed_stream_replays_only_its_queues(
    server: LiveServer, limited: Any, agent: Any, resume: str
) -> None:
    url = f"{server.url}/api/v1/stream/"
    first = make_history(agent, "mine", "before")
    missed: list[int] = []
    for n in range(3):
        make_history(agent, "theirs", f"theirs {n}")
        missed += make_history(agent, "ours", f"ours {n}")
    after = first[-1] if resume == "after an event" else 0
    expected = missed if after else first + missed

    with StreamCollector(url, {**headers_of(limited), "Last-Event-ID": str(after)}) as stream:
        replayed = stream.take(len(expected), timeout=30)
        assert stream.nothing_within(1.0)

    assert [int(event["id"]) for event in replayed] == expected


@live
def test_a_limited_stream_gets_keep_alives_while_other_queues_are_busy(
    server: LiveServer, limited: Any, agent: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stream_module, "KEEPALIVE_SECONDS", 0.5)
    with StreamCollector(f"{server.url}/api/v1/stream/", headers_of(limited)) as stream:
        # An event every 0.1 s, none of them for this stream: its queue is never idle.
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            transitions.create(actor=agent, title="busy", queue="theirs")
            time.sleep(0.1)
        comments = list(stream.comments)

    assert stream.events.empty()
    assert comments.count(": keep-alive") >= 2


def claim_in_background(
    server: LiveServer, headers: dict[str, str], **body: Any
) -> Future[tuple[httpx.Response, float]]:
    """Send a claim from a thread; the future holds its response and when it came."""
    future: Future[tuple[httpx.Response, float]] = Future()

    def run() -> None:
        try:
            response = httpx.post(
                f"{server.url}/api/v1/tasks/claim/", json=body, headers=headers, timeout=90
            )
            future.set_result((response, time.monotonic()))
        except Exception as exc:
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True).start()
    return future


def settle() -> None:
    """Give a just-sent claim time to make its first (empty) attempt and start waiting."""
    time.sleep(1.0)


def test_a_wake_up_that_came_before_a_waiter_was_narrowed_is_passed_on() -> None:
    async def scenario() -> tuple[bool, bool, str | None]:
        relay = SimpleNamespace(listeners=set(), demands=set(), queue_listeners=set())
        room = WaitingRoom(relay)  # type: ignore[arg-type]
        limited_waiter, other = room.enter(None), room.enter(None)
        # Woken for "theirs" while its first attempt ran, before Django named its queues.
        room.wake_one("theirs")
        room.narrow(limited_waiter, frozenset({"mine"}))
        return limited_waiter.woken.is_set(), other.woken.is_set(), other.woken_for

    assert asyncio.run(scenario()) == (False, True, "theirs")


@live
def test_a_limited_waiting_claim_is_handed_only_its_own_queues_work(
    server: LiveServer, limited: Any, agent: Any
) -> None:
    claim = claim_in_background(server, headers_of(limited), wait=20)
    settle()

    transitions.create(actor=agent, title="not yours", queue="theirs")
    time.sleep(1.0)
    assert not claim.done()
    mine = transitions.create(actor=agent, title="yours", queue="mine")
    response, _ = claim.result(timeout=30)

    assert [task["id"] for task in response.json()["tasks"]] == [mine.pk]
    assert "taskboard-claim-queues" not in response.headers


@live
def test_a_limited_waiter_does_not_take_the_wake_up_of_a_claim_that_may_have_the_task(
    server: LiveServer, limited: Any, agent: Any
) -> None:
    # The limited claim waits first, so it is first in line for every queue it waits for.
    limited_claim = claim_in_background(server, headers_of(limited), wait=30)
    settle()
    other_claim = claim_in_background(
        server, headers_of(UserFactory.create(username="free")), wait=30
    )
    settle()

    created_at = time.monotonic()
    theirs = transitions.create(actor=agent, title="for the other one", queue="theirs")
    response, answered_at = other_claim.result(timeout=40)

    assert [task["id"] for task in response.json()["tasks"]] == [theirs.pk]
    # Woken, not found at the end of its wait (30 s).
    assert answered_at - created_at < 10
    assert not limited_claim.done()


@live
def test_a_limited_waiting_claim_for_another_queue_is_refused_at_once(
    server: LiveServer, limited: Any
) -> None:
    started = time.monotonic()
    response, answered_at = claim_in_background(
        server, headers_of(limited), wait=30, queues=["theirs"]
    ).result(timeout=40)

    assert response.status_code == 403
    assert response.json()["error"] == "forbidden_queue"
    assert answered_at - started < 10


@live
def test_a_permission_given_or_taken_applies_at_once(
    server: LiveServer, make_task: Callable[..., Any], agent: Any, settings: Any
) -> None:
    """What a staff user may do changes at once in a process that remembers their token's
    lookup (TASKBOARD_TOKEN_CACHE_SECONDS), as a revoked token does: the database announces
    a permission or group given or taken, and staff status (migration 0015)."""
    from django.contrib.auth.models import Group, Permission

    settings.TASKBOARD_TOKEN_CACHE_SECONDS = 60
    human = StaffFactory.create(username="ops-promoted")
    headers = headers_of(human)
    triage = Permission.objects.get(codename="triage_task")

    queues = (f"q{n}" for n in itertools.count())

    def requeue_status() -> int:
        task = make_task(queue=next(queues))
        escalate(task, agent)
        response = httpx.post(
            f"{server.url}{API}/tasks/{task.pk}/requeue/", json={}, headers=headers
        )
        return response.status_code

    def becomes(expected: int, what: str) -> None:
        deadline = time.monotonic() + 3
        while (status := requeue_status()) != expected:
            assert time.monotonic() < deadline, f"{what}: still {status}"
            time.sleep(0.1)

    assert requeue_status() == 403  # and the lookup is remembered
    human.user_permissions.add(triage)
    becomes(200, "the permission given")
    human.user_permissions.remove(triage)
    becomes(403, "the permission taken")

    group = Group.objects.create(name="triagers")
    human.groups.add(group)
    assert requeue_status() == 403
    group.permissions.add(triage)
    becomes(200, "the permission given to their group")
    group.permissions.remove(triage)
    becomes(403, "the permission taken from their group")

    type(human).objects.filter(pk=human.pk).update(is_superuser=True)
    becomes(200, "made superuser")
    type(human).objects.filter(pk=human.pk).update(is_staff=False, is_superuser=False)
    becomes(403, "no longer staff")
