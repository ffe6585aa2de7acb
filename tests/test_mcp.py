"""``taskboard mcp`` driven by the official MCP SDK's own client (``ClientSession`` over
``stdio_client``) against a live server: the tools, leases kept alive while the model
thinks, refusals as tool errors, and sessions that end while holding a task."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio
import pytest
from django.db import connection
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from board import transitions
from board.models import Task, TaskEvent
from tests.factories import TokenFactory, UserFactory
from tests.live import LiveServer
from tests.processes import ROOT, cli_env

T = TypeVar("T")

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.once]

TOOLS = {
    "create_task",
    "claim_task",
    "report_progress",
    "complete_task",
    "fail_task",
    "release_task",
    "escalate_task",
    "comment_task",
    "get_task",
    "list_tasks",
}


@pytest.fixture
def token() -> str:
    return str(TokenFactory(user=UserFactory(username="llm-agent")).key)


@asynccontextmanager
async def mcp_session(server: LiveServer, token: str) -> AsyncIterator[ClientSession]:
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "taskboard.cli", "mcp"],
        env=cli_env(server, token),
        cwd=ROOT,
    )
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        yield session


def run(test: Callable[[], Awaitable[None]]) -> None:
    anyio.run(test)


async def db(query: Callable[[], T]) -> T:
    """Run a Django query from the test's event loop, in a thread that closes its
    connection afterwards (Django refuses queries on an event loop's thread)."""

    def work() -> T:
        try:
            return query()
        finally:
            connection.close()

    return await anyio.to_thread.run_sync(work)


def text_of(result: Any) -> str:
    return "".join(getattr(part, "text", "") for part in result.content)


async def call(session: ClientSession, tool: str, **arguments: Any) -> Any:
    """Call a tool that must succeed; return its structured result."""
    result = await session.call_tool(tool, arguments)
    assert not result.is_error, text_of(result)
    structured = result.structured_content
    assert structured is not None
    # A tool that returns a list or null has it wrapped as {"result": ...}.
    return structured.get("result", structured) if set(structured) == {"result"} else structured


def test_the_session_lists_exactly_the_contract_tools_with_instructions(
    server: LiveServer, token: str
) -> None:
    async def test() -> None:
        async with mcp_session(server, token) as session:
            init = await session.initialize()
            tools = (await session.list_tools()).tools

            assert {tool.name for tool in tools} == TOOLS
            assert init.instructions and "lease_lost" in init.instructions
            for tool in tools:
                assert tool.description, tool.name
            claim = next(tool for tool in tools if tool.name == "claim_task")
            assert "progress" in (claim.description or "")

    run(test)


def test_a_model_works_a_task_for_longer_than_its_lease_and_completes_it(
    server: LiveServer, token: str
) -> None:
    async def test() -> None:
        async with mcp_session(server, token) as session:
            await session.initialize()
            created = await call(session, "create_task", title="summarise", queue="llm")
            claimed = await call(session, "claim_task", queues=["llm"], lease_seconds=2)
            assert claimed["id"] == created["id"]
            assert "lease_token" not in claimed

            # The model thinks for longer than its lease: the session heartbeats for it.
            await anyio.sleep(4.5)
            task = await db(lambda: Task.objects.get(pk=created["id"]))
            assert task.status == "in_progress" and task.leased_by_id == "llm-agent"
            expired = await db(
                lambda: TaskEvent.objects.filter(task_id=task.pk, type="expired").exists()
            )
            assert not expired

            progressed = await call(
                session, "report_progress", task_id=task.pk, progress={"step": 2}
            )
            assert progressed["progress"] == {"step": 2}
            comment = await call(session, "comment_task", task_id=task.pk, body="halfway")
            assert comment["type"] == "commented" and comment["created_at"].endswith("Z")
            done = await call(session, "complete_task", task_id=task.pk, result={"ok": True})
            assert done["status"] == "done" and done["result"] == {"ok": True}

            again = await session.call_tool("complete_task", {"task_id": task.pk})
            assert again.is_error
            assert "lease_lost: " in text_of(again)
            assert "Stop working" in text_of(again)

            history = await call(session, "get_task", task_id=task.pk)
            types = [event["type"] for event in history["events"]]
            assert types[:2] == ["created", "claimed"] and types[-1] == "completed"
            assert "heartbeat" in types and "commented" in types
            listed = await call(session, "list_tasks", queue="llm", status="done")
            assert [t["id"] for t in listed] == [task.pk]
            nothing = await call(session, "claim_task", queues=["llm"])
            assert nothing is None
            dumped = json.dumps(history) + json.dumps(listed) + json.dumps(claimed)
            assert "lease_token" not in dumped

    run(test)


def test_refusals_are_tool_errors_with_the_api_code(server: LiveServer, token: str) -> None:
    async def test() -> None:
        async with mcp_session(server, token) as session:
            await session.initialize()
            bad = await session.call_tool("create_task", {"title": "x", "queue": "Not A Queue"})
            assert bad.is_error and "invalid: " in text_of(bad), text_of(bad)
            missing = await session.call_tool("get_task", {"task_id": 999_999})
            assert missing.is_error and "not_found" in text_of(missing)
            unheld = await session.call_tool("release_task", {"task_id": 999_999})
            assert unheld.is_error and "lease_lost" in text_of(unheld)

    run(test)


def test_a_task_held_when_the_session_ends_returns_to_the_board_after_its_lease(
    server: LiveServer, token: str
) -> None:
    other = UserFactory(username="next-agent")

    async def test() -> None:
        async with mcp_session(server, token) as session:
            await session.initialize()
            created = await call(session, "create_task", title="abandoned", queue="llm")
            await call(session, "claim_task", queues=["llm"], lease_seconds=2)
            await call(session, "report_progress", task_id=created["id"], progress={"page": 7})
        # The session (the stdio process) is gone: nobody heartbeats any more.
        ended = time.monotonic()
        task_id = created["id"]
        claims: list[transitions.Claim] = []
        while not claims:
            assert time.monotonic() - ended < 6, "the task never came back"
            await anyio.sleep(0.2)
            claims = await db(lambda: transitions.claim(actor=other, queues=["llm"]))
        assert claims[0].task.pk == task_id
        assert claims[0].task.progress == {"page": 7}

    run(test)


def test_several_sessions_at_once_never_get_the_same_task(server: LiveServer) -> None:
    creator = UserFactory(username="planner")
    for n in range(12):
        transitions.create(actor=creator, title=f"t{n}", queue="many")
    tokens = [str(TokenFactory(user=UserFactory(username=f"llm-{n}")).key) for n in range(3)]
    held: dict[int, list[int]] = {}

    async def test() -> None:
        async def agent(index: int) -> None:
            async with mcp_session(server, tokens[index]) as session:
                await session.initialize()
                mine = held.setdefault(index, [])
                while True:
                    task = await call(session, "claim_task", queues=["many"], lease_seconds=30)
                    if task is None:
                        return
                    mine.append(task["id"])

        async with anyio.create_task_group() as group:
            for index in range(3):
                group.start_soon(agent, index)

    run(test)

    everything = [task_id for ids in held.values() for task_id in ids]
    assert sorted(everything) == sorted(Task.objects.values_list("id", flat=True))
    assert len(everything) == len(set(everything)) == 12
