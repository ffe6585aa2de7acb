"""``/mcp/`` served by ``taskboard serve --workers 2`` (and behind Pushpin), driven by the
official MCP SDK's client, every request on a new connection so that the kernel spreads
them over both processes: each reaches the process holding its session (board.mcp.forwarding),
every tool call succeeds, the leases a session holds are heartbeated past their
lease_seconds, and a session whose process is killed (``kill -9``) answers 404, after which
a new session works."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx2
import psutil
import pytest
from django.db import connection
from django.utils import timezone
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from board import transitions
from board.models import Task
from tests import processes
from tests.factories import UserFactory
from tests.processes import ServeProcess, eventually, free_port, server_workers

pytestmark = [pytest.mark.slow, pytest.mark.once, pytest.mark.django_db(transaction=True)]

LEASE_SECONDS = 2
SESSIONS = 6
MAX_SESSIONS = 30


@pytest.fixture(params=["serve", "pushpin"])
def two_workers(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ServeProcess]:
    """``serve --workers 2`` on the test database, alone or behind Pushpin."""
    options = ["--workers", "2"]
    if request.param == "pushpin":
        if shutil.which("pushpin") is None:
            pytest.skip("pushpin is not installed (Debian: apt-get install pushpin)")
        options.insert(0, "--pushpin")
    env = {"DATABASE_URL": processes.tests_database_url(), "TASKBOARD_DATA_DIR": str(tmp_path)}
    server = ServeProcess(tmp_path / "serve.log", *options, env=env, port=free_port())
    try:
        server.wait_healthy(timeout=120)
        eventually(lambda: server_workers(server.pid, 2), timeout=30, what="two workers")
        yield server
    finally:
        server.stop()


def holder(server: ServeProcess, session_id: str) -> psutil.Process:
    """The worker process that holds ``session_id``: the one listening on the socket its
    tag names."""
    tag = session_id.partition("-")[0]
    for worker in server_workers(server.pid) or []:
        with contextlib.suppress(psutil.Error):
            if any(c.laddr.endswith(f"/{tag}.sock") for c in worker.net_connections("unix")):
                return worker
    raise AssertionError(f"no worker listens for session {session_id}")


class Agent:
    """An MCP session of the SDK's client whose every HTTP request opens a new connection,
    and the statuses and session id of its answers."""

    def __init__(self, url: str, token: str, name: str = "") -> None:
        self.url = url
        self.token = token
        self.name = name
        self.session_id: str | None = None
        self.statuses: list[int] = []

    async def _seen(self, response: httpx2.Response) -> None:
        self.statuses.append(response.status_code)
        self.session_id = response.headers.get("mcp-session-id", self.session_id)

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[ClientSession]:
        http = httpx2.AsyncClient(
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=httpx2.Timeout(30, read=300),
            # No keep-alive: each request is a new connection, handed to either process.
            limits=httpx2.Limits(max_keepalive_connections=0),
            event_hooks={"response": [self._seen]},
        )
        async with (
            http,
            streamable_http_client(f"{self.url}/mcp/", http_client=http) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            yield session


async def call(session: ClientSession, tool: str, **arguments: Any) -> Any:
    result = await session.call_tool(tool, arguments)
    assert not result.is_error, result.content
    structured = result.structured_content
    assert structured is not None
    return structured.get("result", structured) if set(structured) == {"result"} else structured


def in_thread(work: Callable[[], Any]) -> Any:
    try:
        return work()
    finally:
        connection.close()


def test_sessions_work_whichever_process_each_request_reaches(
    two_workers: ServeProcess, token_for: Callable[[str], str]
) -> None:
    planner = UserFactory.create(username="planner")
    tokens = {}
    for n in range(MAX_SESSIONS):
        transitions.create(actor=planner, title=f"task {n}", queue="w")
        tokens[f"agent-{n}"] = token_for(f"agent-{n}")

    async def work(agent: Agent, session: ClientSession) -> int:
        claimed = await call(session, "claim_task", queues=["w"], lease_seconds=LEASE_SECONDS)
        task_id = int(claimed["id"])
        for step in range(3):
            await call(session, "report_progress", task_id=task_id, progress={"step": step})
            await asyncio.sleep(LEASE_SECONDS * 0.75)  # past two leases in all
        # Still held, past its lease: the session's process heartbeats it.
        task = await asyncio.to_thread(in_thread, lambda: Task.objects.get(pk=task_id))
        assert task.status == "in_progress" and task.leased_by_id == agent.name
        assert task.leased_until is not None and task.leased_until > timezone.now()
        done = await call(session, "complete_task", task_id=task_id, result={"ok": True})
        assert done["status"] == "done"
        return task_id

    async def main() -> tuple[list[Agent], list[int]]:
        async with contextlib.AsyncExitStack() as stack:
            # Sessions open where the kernel hands their first connection: open them until
            # both processes hold some, so that about half of all requests must be passed
            # on (without forwarding, those fail with 404).
            opened: list[tuple[Agent, ClientSession]] = []
            while len(opened) < SESSIONS or len(holders(opened)) < 2:
                assert len(opened) < MAX_SESSIONS, "every session opened on one process"
                name = f"agent-{len(opened)}"
                agent = Agent(two_workers.url, tokens[name], name)
                opened.append((agent, await stack.enter_async_context(agent.session())))
            done = await asyncio.gather(*(work(agent, session) for agent, session in opened))
            return [agent for agent, _ in opened], list(done)

    def holders(opened: list[tuple[Agent, ClientSession]]) -> set[str]:
        return {str(agent.session_id).partition("-")[0] for agent, _ in opened}

    agents, done = asyncio.run(main())

    assert len(set(done)) == len(agents)
    assert Task.objects.filter(pk__in=done, status="done").count() == len(agents)
    assert all(status < 400 for agent in agents for status in agent.statuses), [
        agent.statuses for agent in agents
    ]
    assert not two_workers.server_errors(), two_workers.server_errors()


def test_a_session_whose_process_is_killed_is_404_and_a_new_one_works(
    two_workers: ServeProcess, token_for: Callable[[str], str]
) -> None:
    planner = UserFactory.create(username="planner")
    for n in range(2):
        transitions.create(actor=planner, title=f"task {n}", queue="w")
    agent = Agent(two_workers.url, token_for("agent"))

    async def main() -> None:
        async with contextlib.AsyncExitStack() as stack:
            session = await stack.enter_async_context(agent.session())
            await call(session, "claim_task", queues=["w"], lease_seconds=60)
            assert agent.session_id is not None
            killed = holder(two_workers, agent.session_id)
            os.kill(killed.pid, signal.SIGKILL)
            await asyncio.to_thread(killed.wait, 10)
            seen = len(agent.statuses)
            with pytest.raises(MCPError, match="Session not found"):
                await session.call_tool("list_tasks", {"queue": "w"})
            assert 404 in agent.statuses[seen:], agent.statuses[seen:]
            with contextlib.suppress(Exception):
                await stack.aclose()  # its DELETE is 404 too

        fresh = Agent(two_workers.url, agent.token)
        async with fresh.session() as session:
            claimed = await call(session, "claim_task", queues=["w"], lease_seconds=60)
            done = await call(session, "complete_task", task_id=int(claimed["id"]))
            assert done["status"] == "done"
        assert all(status < 400 for status in fresh.statuses), fresh.statuses

    asyncio.run(main())
