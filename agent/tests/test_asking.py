"""Asking a person with taskboard_agent.client, against a fake board: the ask, the wait
for the answer (through a server that does not answer for a while), the claim back and
the lease that heartbeats the new claim. The whole loop against a live server is tested
in the repository's tests/test_asking_agents.py."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import taskboard_agent.client as client_module
from taskboard_agent.client import (
    Answer,
    AwaitingInput,
    ClaimedTask,
    Client,
    LeaseLost,
    Question,
    Task,
    ValidationError,
)

NOW = "2025-01-01T00:00:00Z"


class FakeBoard:
    """Tasks of one agent, as far as asking goes: claim, heartbeat, ask, release and read;
    :meth:`answer` is a person answering. Claims hand out pending tasks in the order their
    questions were answered (``order`` overrides it)."""

    def __init__(self, *task_ids: int) -> None:
        self.tasks: dict[int, dict[str, Any]] = {
            task_id: {"status": "in_progress", "token": f"{task_id}-1", "question": None}
            | {"answers": [], "leased_by": "agent-smith"}
            for task_id in task_ids
        }
        self.answered: list[int] = []
        self.order: list[int] | None = None
        self.requests: list[tuple[str, str, Any]] = []
        self.unreachable = 0  # reads refused (a server restarting) before answering again
        self.hidden: set[int] = set()  # tasks whose reads still show the question open
        self.refuse_ask: httpx.Response | None = None
        self._tokens = itertools.count(2)
        self._events = itertools.count(100)
        self._lock = threading.Lock()

    def render(self, task_id: int, *, hide: bool = False) -> dict[str, Any]:
        task = self.tasks[task_id]
        status, question, answers = task["status"], task["question"], task["answers"]
        if hide and task_id in self.hidden and answers:
            status, question, answers = "awaiting_input", answers[-1]["question_fields"], []
        return {
            "id": task_id,
            "title": f"task {task_id}",
            "queue": "q",
            "status": status,
            "leased_by": task["leased_by"] if status == "in_progress" else None,
            "created_at": NOW,
            "updated_at": NOW,
            "question": question,
            "answers": [
                {key: value for key, value in answer.items() if key != "question_fields"}
                for answer in answers
            ],
        }

    def answer(self, task_id: int, value: Any) -> None:
        with self._lock:
            task = self.tasks[task_id]
            question = task["question"]
            task["answers"].append(
                {
                    **question,
                    "answer": value,
                    "note": "go ahead",
                    "answered_by": "ada",
                    "answered_at": NOW,
                    "question_fields": question,
                }
            )
            task.update(status="pending", question=None)
            self.answered.append(task_id)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        path = request.url.path.removeprefix("/api/v1")
        self.requests.append((request.method, path, body))
        with self._lock:
            return self._answer(request.method, path, body, request)

    def _answer(self, method: str, path: str, body: Any, request: httpx.Request) -> httpx.Response:
        if path == "/tasks/claim/":
            order = self.order if self.order is not None else self.answered
            for task_id in order:
                task = self.tasks[task_id]
                if task["status"] == "pending":
                    task.update(status="in_progress", token=f"{task_id}-{next(self._tokens)}")
                    data = self.render(task_id)
                    data.update(
                        leased_until="2100-01-01T00:00:00Z",
                        attempt_started_at=None,
                        lease_token=task["token"],
                    )
                    return httpx.Response(200, json={"tasks": [data]})
            return httpx.Response(200, json={"tasks": []})
        task_id = int(path.split("/")[2])
        task = self.tasks[task_id]
        if method == "GET":
            if self.unreachable:
                self.unreachable -= 1
                raise httpx.ConnectError("Connection refused", request=request)
            return httpx.Response(200, json=self.render(task_id, hide=True))
        if task["status"] != "in_progress" or body.get("lease_token") != task["token"]:
            lost = {"error": "lease_lost", "detail": "Not yours.", "status": task["status"]}
            return httpx.Response(409, json=lost)
        if path.endswith("/ask/"):
            if self.refuse_ask is not None:
                return self.refuse_ask
            fields = {key: value for key, value in body.items() if key != "lease_token"}
            question = {"event_id": next(self._events), "asked_by": "agent-smith", **fields}
            task.update(status="awaiting_input", token=None, question=question)
        elif path.endswith("/release/"):
            task.update(status="pending", token=None)
            if self.order is not None:
                self.order.remove(task_id)  # as a task held for nobody: after the held one
        return httpx.Response(200, json=self.render(task_id))


@pytest.fixture(autouse=True)
def quick_looks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_module, "ANSWER_POLL_FIRST", 0.02)
    monkeypatch.setattr(client_module, "ANSWER_POLL_MAX", 0.05)


@pytest.fixture
def fake() -> FakeBoard:
    return FakeBoard(7)


@pytest.fixture
def board(fake: FakeBoard) -> Iterator[Client]:
    transport = httpx.MockTransport(fake)
    with Client("http://board.test", "token", transport=transport, retries=1, backoff=0.01) as c:
        yield c


def claimed(fake: FakeBoard, task_id: int = 7) -> ClaimedTask:
    data = fake.render(task_id) | {"leased_until": "2100-01-01T00:00:00Z"}
    task = Task.from_json(data)
    fields = {name: getattr(task, name) for name in task.__dataclass_fields__}
    token = fake.tasks[task_id]["token"]
    return ClaimedTask(**fields, lease_token=token, lease_seconds=30, claimed_at=time.monotonic())


def answer_soon(fake: FakeBoard, value: Any, task_id: int = 7, after: float = 0.2) -> None:
    def answer() -> None:
        while fake.tasks[task_id]["status"] != "awaiting_input":
            time.sleep(0.01)
        time.sleep(after)
        fake.answer(task_id, value)

    threading.Thread(target=answer, daemon=True).start()


def test_a_task_reads_its_open_question_its_answers_its_assignee_and_what_it_requires() -> None:
    asked = {"event_id": 5, "question": "Which?", "options": ["a", "b"], "asked_by": "bot"}
    data = {
        "id": 1,
        "title": "t",
        "queue": "q",
        "status": "awaiting_input",
        "created_at": NOW,
        "updated_at": NOW,
        "assignee": "ada",
        "requires": ["gpu", "lang:fr"],
        "question": asked | {"answer_by": "2025-01-02T00:00:00Z", "action_digest": "abc"},
        "answers": [
            {"event_id": 3, "question": "May I?", "answer": {"n": 2}, "note": None}
            | {"answered_by": "ada", "answered_at": NOW, "answer_schema": {"type": "object"}}
        ],
    }

    task = Task.from_json(data)

    assert (task.assignee, task.requires) == ("ada", ["gpu", "lang:fr"])
    assert isinstance(task.question, Question)
    assert (task.question.event_id, task.question.options) == (5, ["a", "b"])
    assert task.question.answer_by is not None and task.question.action_digest == "abc"
    [answer] = task.answers
    assert isinstance(answer, Answer)
    assert (answer.question, answer.answer, answer.answered_by) == ("May I?", {"n": 2}, "ada")
    assert answer.answer_schema == {"type": "object"} and answer.answered_at is not None
    assert task.answer_to(3) is answer and task.answer_to(task.question) is None
    old = Task.from_json(
        {key: data[key] for key in ("id", "title", "queue", "status")}
        | {"created_at": NOW, "updated_at": NOW}
    )
    assert (old.question, old.answers, old.assignee, old.requires) == (None, [], None, [])


def test_ask_waits_for_the_answer_takes_the_task_back_and_heartbeats_the_new_claim(
    fake: FakeBoard, board: Client
) -> None:
    answer_soon(fake, "approve")

    with board.lease(claimed(fake)) as lease:
        answer = lease.ask(
            "Drop the table?", options=["approve", "deny"], action_digest="d1", wait=10
        )
        assert answer == "approve"
        assert not lease.finished and not lease.lost
        assert lease.task.lease_token == fake.tasks[7]["token"] != "7-1"
        assert lease.answer is not None
        assert (lease.answer.note, lease.answer.answered_by) == ("go ahead", "ada")
        assert lease.answer.action_digest == "d1"
        assert [a.answer for a in lease.task.answers] == ["approve"]
        lease.heartbeat()  # on the new claim: the fake refuses any other token
        lease.release()

    asks = [body for method, path, body in fake.requests if path.endswith("/ask/")]
    assert asks == [
        {
            "lease_token": "7-1",
            "question": "Drop the table?",
            "options": ["approve", "deny"],
            "action_digest": "d1",
        }
    ]
    claims = [body for method, path, body in fake.requests if path == "/tasks/claim/"]
    assert claims == [{"queues": ["q"], "limit": 1, "lease_seconds": 30}]  # once answered


def test_the_wait_rides_out_a_server_that_does_not_answer_for_a_while(
    fake: FakeBoard, board: Client
) -> None:
    fake.unreachable = 6  # more than the client's own retries of a read
    answer_soon(fake, "yes", after=0.0)

    lease = board.lease(claimed(fake))
    assert lease.ask("Proceed?", wait=10) == "yes"
    lease.stop()

    assert fake.unreachable == 0
    assert fake.tasks[7]["status"] == "in_progress"


def test_a_wait_that_ends_first_raises_awaiting_input_holding_nothing(
    fake: FakeBoard, board: Client
) -> None:
    started = time.monotonic()
    with board.lease(claimed(fake)) as lease, pytest.raises(AwaitingInput) as waited:
        lease.ask("Which schema?", wait=0.3)

    assert 0.3 <= time.monotonic() - started < 3
    assert waited.value.code == "awaiting_input" and waited.value.task_status == "awaiting_input"
    task = waited.value.task
    assert task is not None and task.question is not None
    assert task.question.question == "Which schema?"
    assert lease.finished and not lease.lost
    # Nothing claimed, and the with block did not fail or release a task it no longer holds.
    assert [path for method, path, body in fake.requests if method == "POST"] == ["/tasks/7/ask/"]


def test_an_ask_the_server_refuses_keeps_the_lease_heartbeating(
    fake: FakeBoard, board: Client
) -> None:
    fake.refuse_ask = httpx.Response(
        400,
        json={"error": "invalid", "detail": "Invalid.", "fields": {"options": ["Not both."]}},
    )
    lease = board.lease(claimed(fake))

    with pytest.raises(ValidationError) as refused:
        lease.ask("Which?", options=["a", "b"], answer_schema={"type": "string"}, wait=5)

    assert refused.value.fields == {"options": ["Not both."]}
    assert not lease.finished and not lease.lost
    lease.heartbeat()
    lease.stop()


def test_an_ask_without_the_lease_raises_lease_lost(fake: FakeBoard, board: Client) -> None:
    task = claimed(fake)
    fake.tasks[7]["token"] = "someone-else"

    with pytest.raises(LeaseLost):
        board.lease(task).ask("Mine?", wait=1)


def test_a_task_answered_and_taken_by_another_agent_raises_lease_lost(
    fake: FakeBoard, board: Client
) -> None:
    lease = board.lease(claimed(fake))

    def taken() -> None:
        while fake.tasks[7]["status"] != "awaiting_input":
            time.sleep(0.01)
        fake.answer(7, "yes")
        fake.tasks[7].update(status="in_progress", token="theirs", leased_by="agent-jones")

    threading.Thread(target=taken, daemon=True).start()
    with pytest.raises(LeaseLost) as lost:
        lease.ask("May I?", wait=10)

    assert "agent-jones" in lost.value.detail and lost.value.task_status == "in_progress"
    assert lease.lost


def test_a_claim_back_that_brings_another_waiters_task_hands_it_over() -> None:
    # Tasks 1 and 2 of one client both wait for answers; 2's came first, so the claim
    # that 1's waiter makes brings 2: it goes to 2's waiter, and the next claim brings 1.
    fake = FakeBoard(1, 2)
    fake.hidden = {2}  # 2's waiter does not see its answer by itself
    with Client("http://board.test", "token", transport=httpx.MockTransport(fake)) as board:
        one = board.lease(claimed(fake, 1)).send_ask("One?")
        two = board.lease(claimed(fake, 2)).send_ask("Two?")
        got: list[ClaimedTask] = []
        waiter = threading.Thread(
            target=lambda: got.append(board.await_answer(two, wait=10)), daemon=True
        )
        waiter.start()
        time.sleep(0.1)
        fake.answer(2, "two")
        fake.answer(1, "one")

        back = board.await_answer(one, wait=10)
        waiter.join(10)

    assert (back.id, back.lease_token) == (1, fake.tasks[1]["token"])
    [handed] = got
    assert (handed.id, handed.lease_token) == (2, fake.tasks[2]["token"])
    assert [a.answer for a in handed.answers] == ["two"]
    claims = [path for method, path, body in fake.requests if path == "/tasks/claim/"]
    assert len(claims) == 2
    assert not any(path.endswith("/release/") for method, path, body in fake.requests)


def test_a_claim_back_that_brings_a_task_nobody_here_waits_for_releases_it() -> None:
    fake = FakeBoard(1, 3)
    with Client("http://board.test", "token", transport=httpx.MockTransport(fake)) as board:
        one = board.lease(claimed(fake, 1)).send_ask("One?")
        fake.tasks[3].update(status="pending", token=None)
        fake.order = [3, 1]
        fake.answer(1, "one")

        back = board.await_answer(one, wait=10)

    assert back.id == 1
    assert ("POST", "/tasks/3/release/") in [(m, p) for m, p, body in fake.requests]
    assert fake.tasks[3]["status"] == "pending"
