"""Agents that ask a person, end to end against a live server: the Python client's
``Lease.ask`` (also across a server restart while it waits), ``taskboard work``'s ask line
and exit status 75, and the MCP tool ``ask_human`` over both transports. Each time: the ask
leaves the task awaiting input with no lease and no strike, a person answers over the API,
the asker gets the answer and holds the task again (nobody else can take it during the
hold), and completes it."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from board.models import Task as TaskRow
from taskboard_agent.client import (
    AwaitingInput,
    Client,
    InvalidTransition,
    LeaseLost,
    PermissionDenied,
    Task,
    ValidationError,
)
from tests.factories import TokenFactory, UserFactory, grant
from tests.live import LiveServer, free_port, live_server
from tests.processes import WorkerProcess, eventually
from tests.test_mcp import call, mcp_session, run, text_of

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.once]

ASKER = "asking-agent"
# A task's history when its agent asked once, had its answer, and completed it.
ASKED_AND_DONE = ["created", "claimed", "asked", "answered", "claimed", "completed"]


def token_of(user: Any) -> str:
    token: Any = TokenFactory.create(user=user)
    return str(token.key)


@pytest.fixture
def token(fast_password_hashing: None) -> str:
    return token_of(UserFactory.create(username=ASKER))


@pytest.fixture
def answerer_token(fast_password_hashing: None) -> str:
    """A person who may answer any question: the ``board.answer_task`` permission."""
    return token_of(grant(UserFactory.create(username="ada"), "board.answer_task"))


@pytest.fixture
def board(server: LiveServer, token: str) -> Iterator[Client]:
    with Client(server.url, token) as client:
        yield client


@pytest.fixture
def person(server: LiveServer, answerer_token: str) -> Iterator[Client]:
    with Client(server.url, answerer_token) as client:
        yield client


@pytest.fixture
def other_board(server: LiveServer, fast_password_hashing: None) -> Iterator[Client]:
    with Client(server.url, token_of(UserFactory.create(username="other-agent"))) as client:
        yield client


def awaiting(board: Client, task_id: int) -> Task:
    """Wait until the task awaits input; return it as the API shows it."""
    task: Task = eventually(
        lambda: (task := board.get(task_id)).status == "awaiting_input" and task,
        what="the ask",
    )
    return task


def assert_asked_without_lease_or_strike(task: Task, question: str) -> None:
    assert (task.status, task.leased_by, task.leased_until) == ("awaiting_input", None, None)
    assert task.failure_count == 0 and task.attempt_started_at is None
    assert task.question is not None and task.question.question == question
    assert task.question.asked_by == ASKER


def types_of(board: Client, task_id: int) -> list[str]:
    return [e.type for e in board.iter_task_events(task_id) if e.type != "heartbeat"]


# -- The Python client -------------------------------------------------------------------


def test_the_client_asks_waits_and_gets_the_answer_with_the_task_held_again(
    board: Client, person: Client, other_board: Client
) -> None:
    created = board.create("migrate the database", queue="db")
    [task] = board.claim(queues=["db"], lease_seconds=3)
    got: list[Any] = []

    with board.lease(task) as lease:
        asking = threading.Thread(
            target=lambda: got.append(
                lease.ask(
                    "Drop table t?",
                    options=["approve", "deny"],
                    action_digest="sha256:0123",
                    wait=60,
                )
            )
        )
        asking.start()
        asked = awaiting(other_board, created.id)
        assert_asked_without_lease_or_strike(asked, "Drop table t?")
        assert asked.question is not None and asked.question.options == ["approve", "deny"]
        assert other_board.claim(queues=["db"]) == []  # not claimable while it awaits

        answered = person.answer(created.id, "approve", note="t is a leftover")
        assert answered.status == "pending"
        asking.join(30)
        assert got == ["approve"]
        assert lease.answer is not None
        assert (lease.answer.answered_by, lease.answer.note) == ("ada", "t is a leftover")
        assert lease.answer.action_digest == "sha256:0123"
        # Held again, on a new claim, and kept alive past its 3 s lease.
        assert lease.task.lease_token != task.lease_token
        time.sleep(4)
        held = other_board.get(created.id)
        assert (held.status, held.leased_by, held.failure_count) == ("in_progress", ASKER, 0)
        assert [a.answer for a in held.answers] == ["approve"]
        assert other_board.claim(queues=["db"]) == []
        done = lease.complete({"dropped": "t"})

    assert (done.status, done.failure_count) == ("done", 0)
    assert types_of(board, created.id) == ASKED_AND_DONE


def test_an_answer_that_does_not_come_in_time_leaves_the_task_for_the_askers_next_claim(
    board: Client, person: Client, other_board: Client
) -> None:
    created = board.create("choose a schema", queue="db")
    [task] = board.claim(queues=["db"])
    lease = board.lease(task)

    with pytest.raises(AwaitingInput) as waited:
        lease.ask("Which schema?", answer_schema={"type": "string", "enum": ["v1", "v2"]}, wait=1)

    assert waited.value.task is not None and waited.value.task.status == "awaiting_input"
    assert lease.finished and not lease.lost
    assert_asked_without_lease_or_strike(board.get(created.id), "Which schema?")
    person.answer(created.id, "v2")
    # Held for the asker: another agent's claim passes it by; the asker's takes it.
    assert other_board.claim(queues=["db"]) == []
    [again] = board.claim(queues=["db"])
    assert again.id == created.id
    assert [(a.question, a.answer, a.answered_by) for a in again.answers] == [
        ("Which schema?", "v2", "ada")
    ]
    assert again.question is None
    board.complete(again, result="v2")


def test_refusals_of_an_ask_and_of_an_answer_raise_the_clients_errors(
    board: Client, person: Client, other_board: Client
) -> None:
    created = board.create("refusals", queue="no")
    [task] = board.claim(queues=["no"])
    lease = board.lease(task)

    with pytest.raises(ValidationError) as both:
        lease.ask("Which?", options=["a", "b"], answer_schema={"type": "string"}, wait=5)
    assert both.value.status == 400 and "answer_schema" in both.value.fields
    assert not lease.finished  # refused: still held, still heartbeating
    with pytest.raises(ValidationError) as nobody:
        lease.send_ask("Whom?", assignee="no-such-user")
    assert "assignee" in nobody.value.fields
    with pytest.raises(LeaseLost):
        other_board.ask(created.id, "Mine?", lease_token="not-the-token")

    lease.send_ask("Which?", options=["a", "b"])
    with pytest.raises(LeaseLost):
        board.ask(task, "Again?")  # the ask ended the lease
    with pytest.raises(PermissionDenied):
        other_board.answer(created.id, "a")  # neither assignee nor allowed to answer
    with pytest.raises(ValidationError) as outside:
        person.answer(created.id, "c")
    assert "answer" in outside.value.fields
    person.answer(created.id, "a")
    with pytest.raises(InvalidTransition):
        person.answer(created.id, "b")


def test_the_client_resumes_its_wait_for_the_answer_across_a_server_restart(
    token: str, answerer_token: str
) -> None:
    port = free_port()
    first = LiveServer(port).start()
    asker = Client(first.url, token, backoff=0.05, max_backoff=0.2)
    try:
        created = asker.create("restart meanwhile", queue="r")
        [task] = asker.claim(queues=["r"], lease_seconds=5)
        lease = asker.lease(task)
        got: list[Any] = []
        asking = threading.Thread(
            target=lambda: got.append(lease.ask("Still there?", wait=60)), daemon=True
        )
        asking.start()
        awaiting(asker, created.id)
        first.stop()
        time.sleep(2)  # nothing answers: the wait goes on
        assert asking.is_alive() and not got
        with live_server(port) as second, Client(second.url, answerer_token) as person:
            person.answer(created.id, "yes")
            asking.join(30)
            assert got == ["yes"]
            assert asker.get(created.id).leased_by == ASKER
            assert lease.complete().status == "done"
    finally:
        asker.close()
        first.stop()


# -- taskboard work ----------------------------------------------------------------------

# Asks which colour when no answer came yet (an ask line, exit 75); else uses the answer.
COLOURING = """
import json, os, sys
answers = json.loads(os.environ["TASKBOARD_ANSWERS"])
if not answers:
    with os.fdopen(int(os.environ["TASKBOARD_PROGRESS_FD"]), "w") as fd:
        fd.write(json.dumps({"step": "chose nothing yet"}) + "\\n")
        ask = {"question": "Which colour?", "options": ["red", "blue"], "answer_within": 3600}
        fd.write(json.dumps({"ask": ask}) + "\\n")
    sys.exit(75)
last = answers[-1]
print(json.dumps({"colour": last["answer"], "by": last["answered_by"],
                  "asked": last["question"], "attempt": os.environ["TASKBOARD_ATTEMPT"]}))
"""


@pytest.fixture
def start_worker(
    server: LiveServer, token: str, tmp_path: Path
) -> Iterator[Callable[..., WorkerProcess]]:
    workers: list[WorkerProcess] = []

    def start(*options: str, command: list[str]) -> WorkerProcess:
        worker = WorkerProcess(server, token, tmp_path / "worker.log", list(options), command)
        workers.append(worker)
        return worker

    yield start
    for worker in workers:
        worker.kill()


def test_a_command_asks_with_exit_status_75_and_its_next_attempt_gets_the_answer(
    start_worker: Callable[..., WorkerProcess],
    board: Client,
    person: Client,
    other_board: Client,
) -> None:
    created = board.create("paint the shed", queue="paint")

    worker = start_worker(
        "--queue", "paint", "--wait", "5", command=[sys.executable, "-c", COLOURING]
    )
    asked = awaiting(board, created.id)
    assert_asked_without_lease_or_strike(asked, "Which colour?")
    assert asked.question is not None and asked.question.options == ["red", "blue"]
    assert asked.progress == {"step": "chose nothing yet"}  # sent before the ask
    assert eventually(lambda: "asked a person" in worker.output, what="the log line")

    person.answer(created.id, "blue")
    assert other_board.claim(queues=["paint"]) == []  # held for the worker that asked
    eventually(lambda: board.get(created.id).status == "done", what="the second attempt")
    assert worker.stop() == 0

    done = board.get(created.id)
    assert done.result == {"colour": "blue", "by": "ada", "asked": "Which colour?", "attempt": "1"}
    assert done.failure_count == 0
    assert types_of(board, created.id) == ASKED_AND_DONE
    assert "stopped: 1 done, 0 failed, 0 released, 0 lost, 1 asked" in worker.output


def test_an_ask_the_server_refuses_fails_the_task_saying_why(
    start_worker: Callable[..., WorkerProcess], board: Client
) -> None:
    created = board.create("bad ask", queue="bad", max_failures=1)
    bad = {"ask": {"question": "Which?", "options": ["only one"]}}
    command = (
        "import json, os, sys\n"
        "with os.fdopen(int(os.environ['TASKBOARD_PROGRESS_FD']), 'w') as fd:\n"
        f"    fd.write({json.dumps(json.dumps(bad))} + '\\n')\n"
        "sys.exit(75)\n"
    )

    worker = start_worker("--queue", "bad", command=[sys.executable, "-c", command])
    eventually(lambda: board.get(created.id).status == "escalated", what="the failure")
    worker.stop()

    error = board.get(created.id).last_error or ""
    assert error.startswith("exit status 75 to ask, but the ask was refused: 400 invalid"), error
    assert "options" in error


# -- MCP, both transports ----------------------------------------------------------------


@pytest.fixture(params=["stdio", "http"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def row(task_id: int) -> TaskRow:
    return TaskRow.objects.get(id=task_id)


def test_a_model_asks_a_person_waits_and_gets_the_answer_and_the_task_back(
    server: LiveServer, token: str, transport: str, person: Client, other_board: Client
) -> None:
    async def test() -> None:
        async with mcp_session(server, token, transport) as session:
            await session.initialize()
            created = await call(session, "create_task", title="deploy", queue="ops")
            await call(session, "claim_task", queues=["ops"], lease_seconds=3)
            seen: list[Task] = []

            def answer() -> None:
                seen.append(awaiting(other_board, created["id"]))
                seen.append(person.answer(created["id"], "yes", note="go"))

            async with anyio.create_task_group() as group:
                group.start_soon(anyio.to_thread.run_sync, answer)
                result = await call(
                    session,
                    "ask_human",
                    task_id=created["id"],
                    question="Deploy now?",
                    options=["yes", "no"],
                    wait=60,
                )

            assert_asked_without_lease_or_strike(seen[0], "Deploy now?")
            assert result["answer"] == "yes"
            task = result["task"]
            assert (task["status"], task["leased_by"]) == ("in_progress", ASKER)
            assert [(a["answer"], a["note"]) for a in task["answers"]] == [("yes", "go")]
            assert "lease_token" not in json.dumps(result)
            # The session holds it again, and keeps it past its 3 s lease.
            await anyio.sleep(4)
            nothing = await anyio.to_thread.run_sync(lambda: other_board.claim(queues=["ops"]))
            assert nothing == []
            done = await call(session, "complete_task", task_id=created["id"], result="shipped")
            assert done["status"] == "done" and done["failure_count"] == 0

    run(test)


def test_a_model_that_does_not_wait_gets_awaiting_input_and_a_later_claim_brings_the_answer(
    server: LiveServer, token: str, transport: str, person: Client, other_board: Client
) -> None:
    async def test() -> None:
        async with mcp_session(server, token, transport) as session:
            await session.initialize()
            created = await call(session, "create_task", title="rename", queue="names")
            await call(session, "claim_task", queues=["names"])
            schema = {"type": "object", "properties": {"name": {"type": "string"}}}

            result = await call(
                session,
                "ask_human",
                task_id=created["id"],
                question="Which name?",
                answer_schema=schema,
                assignee="ada",
            )

            assert result["status"] == "awaiting_input"
            assert result["task"]["question"]["assignee"] == "ada"
            asked = await anyio.to_thread.run_sync(lambda: other_board.get(created["id"]))
            assert_asked_without_lease_or_strike(asked, "Which name?")
            # The session no longer holds it: nothing to heartbeat, nothing to complete.
            refused = await session.call_tool("complete_task", {"task_id": created["id"]})
            assert refused.is_error and "lease_lost" in text_of(refused)
            again = await session.call_tool(
                "ask_human", {"task_id": created["id"], "question": "Again?", "wait": 1}
            )
            assert again.is_error and "lease_lost" in text_of(again)

            await anyio.to_thread.run_sync(
                lambda: person.answer(created["id"], {"name": "taskboard"})
            )
            claimed = await call(session, "claim_task", queues=["names"])
            assert claimed["id"] == created["id"]
            assert [a["answer"] for a in claimed["answers"]] == [{"name": "taskboard"}]
            done = await call(session, "complete_task", task_id=created["id"])
            assert done["status"] == "done"

    run(test)


def test_a_model_whose_wait_ends_first_gets_awaiting_input(
    server: LiveServer, token: str, transport: str
) -> None:
    async def test() -> None:
        async with mcp_session(server, token, transport) as session:
            await session.initialize()
            created = await call(session, "create_task", title="wait", queue="w")
            await call(session, "claim_task", queues=["w"])
            started = time.monotonic()
            result = await call(
                session, "ask_human", task_id=created["id"], question="Anyone?", wait=1.5
            )
            assert result["status"] == "awaiting_input"
            assert 1.5 <= time.monotonic() - started < 15
            status = await anyio.to_thread.run_sync(lambda: _status(created["id"]))
            assert status == "awaiting_input"

    run(test)


def _status(task_id: int) -> str:
    from django.db import connection

    try:
        return str(row(task_id).status)
    finally:
        connection.close()
