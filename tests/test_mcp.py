"""The MCP tools driven by the official MCP SDK's own client against a live server, over
both transports: ``taskboard mcp`` (``ClientSession`` over ``stdio_client``) and the
server's ``/mcp/`` (over ``streamable_http_client``). The tools, leases kept alive while the
model thinks, refusals as tool errors, sessions that end while holding a task, and (HTTP)
Bearer authentication and session idle timeouts."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import anyio
import httpx
import pytest
from django.db import connection
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from board import conf, transitions
from board.models import (
    MAX_ATTEMPT_SECONDS,
    MAX_DEPENDENCIES,
    QUEUE_PATTERN,
    Task,
    TaskEvent,
    TaskStatus,
)
from tests.factories import TokenFactory, UserFactory
from tests.live import LiveServer, live_server
from tests.processes import ROOT, cli_env, eventually

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
    "ask_human",
}


@pytest.fixture
def token() -> str:
    return str(TokenFactory.create(user=UserFactory.create(username="llm-agent")).key)


@pytest.fixture(params=["stdio", "http"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@asynccontextmanager
async def mcp_session(
    server: LiveServer, token: str, transport: str = "stdio", state: Path | None = None
) -> AsyncIterator[ClientSession]:
    """An MCP session of the agent of ``token``: over stdio, with ``taskboard mcp`` as the
    host would start it (its claims filed under ``state``, by default a directory of its
    own), or over Streamable HTTP to the server's ``/mcp/``."""
    if transport == "http":
        headers = {"Authorization": f"Bearer {token}"}
        async with (
            create_mcp_http_client(headers=headers) as http,
            streamable_http_client(f"{server.url}/mcp/", http_client=http) as (read, write),
            ClientSession(read, write) as session,
        ):
            yield session
        return
    with tempfile.TemporaryDirectory(prefix="tb-mcp-state-") as own:
        params = StdioServerParameters(
            command=sys.executable,
            args=["-m", "taskboard_agent.cli", "mcp"],
            env={**cli_env(server, token), "XDG_STATE_HOME": str(state or own)},
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
    server: LiveServer, token: str, transport: str
) -> None:
    async def test() -> None:
        async with mcp_session(server, token, transport) as session:
            init = await session.initialize()
            tools = (await session.list_tools()).tools

            assert {tool.name for tool in tools} == TOOLS
            assert init.instructions and "lease_lost" in init.instructions
            for listed in tools:
                assert listed.description, listed.name
            claim = next(tool for tool in tools if tool.name == "claim_task")
            assert "progress" in (claim.description or "")

            # The API's bounds are in the schemas, and what is outside them is refused.
            def bounds(tool: str, name: str) -> dict[str, Any]:
                schema = next(t for t in tools if t.name == tool).input_schema
                field = schema["properties"][name]
                return next((part for part in field.get("anyOf", []) if "type" in part), field)

            assert bounds("claim_task", "wait")["maximum"] == conf.MAX_WAIT_SECONDS
            assert bounds("claim_task", "lease_seconds")["maximum"] == conf.MAX_LEASE_SECONDS
            assert bounds("fail_task", "retry_after")["maximum"] == conf.MAX_LEASE_SECONDS * 30
            assert bounds("create_task", "max_attempt_seconds")["maximum"] == MAX_ATTEMPT_SECONDS
            assert bounds("create_task", "depends_on")["maxItems"] == MAX_DEPENDENCIES
            assert bounds("create_task", "priority") | {"type": "integer"} == {
                "type": "integer",
                "minimum": -1000,
                "maximum": 1000,
            }
            too_long = await session.call_tool("claim_task", {"wait": 1e308})
            assert too_long.is_error and "wait" in text_of(too_long)
            title = bounds("create_task", "title")
            assert (title["minLength"], title["maxLength"]) == (
                1,
                Task._meta.get_field("title").max_length,
            )
            queue_pattern = QUEUE_PATTERN.replace(r"\Z", "$")
            assert bounds("create_task", "queue")["pattern"] == queue_pattern
            assert bounds("list_tasks", "queue")["pattern"] == queue_pattern
            assert bounds("claim_task", "queues")["items"]["pattern"] == queue_pattern
            assert bounds("claim_task", "queues")["maxItems"] == 100  # as the API's claim
            assert set(bounds("list_tasks", "status")["enum"]) == set(TaskStatus.values)
            for tool, name in [
                ("comment_task", "body"),
                ("fail_task", "error"),
                ("escalate_task", "reason"),
            ]:
                assert (bounds(tool, name)["minLength"], bounds(tool, name)["maxLength"]) == (
                    1,
                    10_000,
                ), (tool, name)
            assert bounds("create_task", "run_after")["format"] == "date-time"
            assert bounds("create_task", "depends_on")["uniqueItems"] is True
            out_of_bounds: list[tuple[str, dict[str, Any]]] = [
                ("create_task", {"title": "x" * 201}),
                ("create_task", {"title": "x", "queue": "Not A Queue"}),
                ("list_tasks", {"status": "nonsense"}),
                ("comment_task", {"task_id": 1, "body": ""}),
            ]
            for tool, arguments in out_of_bounds:
                refused = await session.call_tool(tool, arguments)
                assert refused.is_error, (tool, arguments)

    run(test)


def test_a_model_works_a_task_for_longer_than_its_lease_and_completes_it(
    server: LiveServer, token: str, transport: str
) -> None:
    async def test() -> None:
        async with mcp_session(server, token, transport) as session:
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
            assert text_of(again).count("Stop working on it") == 1, text_of(again)

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


def test_every_answer_has_its_json_as_text_null_and_empty_lists_included(
    server: LiveServer, token: str, transport: str
) -> None:
    # The SDK gives null and [] no text at all, and a list one block per item: a host that
    # shows the model only text showed it nothing for "no task".
    async def test() -> None:
        async with mcp_session(server, token, transport) as session:
            await session.initialize()

            async def answer(tool: str, **arguments: Any) -> Any:
                result = await session.call_tool(tool, arguments)
                assert not result.is_error, text_of(result)
                [block] = result.content
                value = json.loads(block.text)  # type: ignore[union-attr]
                assert result.structured_content == {"result": value}
                return value

            assert await answer("claim_task", queues=["empty"]) is None
            assert await answer("list_tasks", queue="empty") == []
            await call(session, "create_task", title="a", queue="two")
            await call(session, "create_task", title="b", queue="two")
            listed = await answer("list_tasks", queue="two")
            assert [task["title"] for task in listed] == ["b", "a"]
            claimed = await answer("claim_task", queues=["two"])
            assert claimed["title"] == "a" and "lease_token" not in claimed

    run(test)


def test_create_task_takes_null_for_no_attempt_limit_as_the_api_does(
    server: LiveServer, token: str, transport: str, settings: Any
) -> None:
    settings.TASKBOARD_MAX_ATTEMPT_SECONDS = 900

    async def test() -> None:
        async with mcp_session(server, token, transport) as session:
            await session.initialize()
            left_out = await call(session, "create_task", title="default")
            unbounded = await call(session, "create_task", title="x", max_attempt_seconds=None)
            capped = await call(session, "create_task", title="y", max_attempt_seconds=60)
            assert left_out["max_attempt_seconds"] == 900
            assert unbounded["max_attempt_seconds"] is None
            assert capped["max_attempt_seconds"] == 60

    run(test)


def test_refusals_are_tool_errors_with_the_api_code(
    server: LiveServer, token: str, transport: str
) -> None:
    async def test() -> None:
        async with mcp_session(server, token, transport) as session:
            await session.initialize()
            bad = await session.call_tool("create_task", {"title": "x", "run_after": "soon"})
            assert bad.is_error and "invalid: " in text_of(bad), text_of(bad)
            missing = await session.call_tool("get_task", {"task_id": 999_999})
            assert missing.is_error and "not_found" in text_of(missing)
            blank = await session.call_tool("create_task", {"title": "   "})
            assert text_of(blank).count("may not be blank") == 1, text_of(blank)

    run(test)


def test_an_action_on_a_task_the_session_does_not_hold_gets_the_apis_refusal(
    server: LiveServer, transport: str
) -> None:
    """Not held here: the API says why, as it would over REST (not_found, forbidden_queue,
    lease_lost), rather than the session answering lease_lost for all."""
    from board.access import limit_queues

    limited = UserFactory.create(username="llm-limited")
    limit_queues(limited, ["mine"])
    token = str(TokenFactory.create(user=limited).key)
    other = UserFactory.create(username="someone-else")
    theirs = transitions.create(actor=other, title="theirs", queue="theirs")
    held = transitions.create(actor=other, title="held", queue="mine")
    transitions.claim(actor=other, queues=["mine"])

    async def test() -> None:
        async with mcp_session(server, token, transport) as session:
            await session.initialize()
            holder_tools: list[tuple[str, dict[str, Any]]] = [
                ("complete_task", {}),
                ("fail_task", {"error": "no"}),
                ("release_task", {}),
                ("escalate_task", {"reason": "no"}),
                ("report_progress", {"progress": 1}),
            ]
            for tool, extra in holder_tools:
                for task_id, code in [
                    (999_999, "not_found: "),
                    (theirs.pk, "forbidden_queue: "),
                    (held.pk, "lease_lost: "),
                ]:
                    refused = await session.call_tool(tool, {"task_id": task_id, **extra})
                    assert refused.is_error, (tool, task_id)
                    assert code in text_of(refused), (tool, text_of(refused))
                    # Not the token's fault: the session sent none of its own.
                    assert "wrong token" not in text_of(refused), text_of(refused)
                    if task_id == held.pk:
                        assert f"did not claim task {held.pk}" in text_of(refused)
                    assert text_of(refused).count("Stop working on it") <= 1, text_of(refused)

    run(test)


def test_a_refused_finish_leaves_the_task_held_and_heartbeating(
    server: LiveServer, token: str, transport: str
) -> None:
    """A fail, escalate or complete that the API refuses as invalid finishes nothing: the
    session keeps the lease alive, and the model's corrected call goes through."""

    async def test() -> None:
        async with mcp_session(server, token, transport) as session:
            await session.initialize()
            created = await call(session, "create_task", title="retry me", queue="llm")
            await call(session, "claim_task", queues=["llm"], lease_seconds=2)
            # Blank: inside the tools' schemas, refused by the API.
            refusals = [("fail_task", {"error": "  "}), ("escalate_task", {"reason": "  "})]
            if transport == "stdio":  # /mcp/ refuses a body this large itself (413)
                refusals.append(("complete_task", {"result": "x" * (1024 * 1024 + 1)}))
            for tool, bad in refusals:
                refused = await session.call_tool(tool, {"task_id": created["id"], **bad})
                assert refused.is_error and "lease_lost" not in text_of(refused)
            await anyio.sleep(4.5)  # twice the lease: only heartbeats keep it

            task = await db(lambda: Task.objects.get(pk=created["id"]))
            assert task.status == "in_progress" and task.leased_by_id == "llm-agent"
            done = await call(session, "complete_task", task_id=created["id"], result=1)
            assert done["status"] == "done"
            expired = await db(
                lambda: TaskEvent.objects.filter(task_id=created["id"], type="expired").count()
            )
            assert expired == 0

    run(test)


def test_a_task_held_when_the_session_ends_returns_to_the_board_after_its_lease(
    server: LiveServer, token: str, transport: str
) -> None:
    other = UserFactory.create(username="next-agent")

    async def test() -> None:
        async with mcp_session(server, token, transport) as session:
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


def test_several_sessions_at_once_never_get_the_same_task(
    server: LiveServer, transport: str
) -> None:
    creator = UserFactory.create(username="planner")
    for n in range(12):
        transitions.create(actor=creator, title=f"t{n}", queue="many")
    tokens = [
        str(TokenFactory.create(user=UserFactory.create(username=f"llm-{n}")).key) for n in range(3)
    ]
    held: dict[int, list[int]] = {}

    async def test() -> None:
        async def agent(index: int) -> None:
            async with mcp_session(server, tokens[index], transport) as session:
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


def test_a_lost_lease_is_the_next_tool_calls_error_telling_the_model_to_stop(
    server: LiveServer, token: str, transport: str
) -> None:
    async def test() -> None:
        async with mcp_session(server, token, transport) as session:
            await session.initialize()
            created = await call(
                session, "create_task", title="short", queue="llm", max_attempt_seconds=2
            )
            await call(session, "claim_task", queues=["llm"])
            await anyio.sleep(2.5)  # past the attempt deadline: no heartbeat renews it
            refused = await session.call_tool(
                "report_progress", {"task_id": created["id"], "progress": 1}
            )
            assert refused.is_error
            assert "lease_lost: you no longer hold task" in text_of(refused)
            assert "The attempt deadline passed" in text_of(refused)
            assert "Stop working on it" in text_of(refused)
            # And it stays refused: the session no longer holds the task.
            again = await session.call_tool("complete_task", {"task_id": created["id"]})
            assert again.is_error and "lease_lost" in text_of(again)

    run(test)


INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-06-18",
        "capabilities": {},
        "clientInfo": {"name": "test", "version": "1"},
    },
}
ACCEPT = {"Accept": "application/json, text/event-stream"}


def test_http_refuses_a_request_without_a_valid_bearer_token(
    server: LiveServer, token: str
) -> None:
    for headers in (
        {},
        {"Authorization": "Bearer not-a-token"},
        {"Authorization": f"Basic {token}"},
    ):
        response = httpx.post(f"{server.url}/mcp/", json=INITIALIZE, headers={**ACCEPT, **headers})
        assert response.status_code == 401, headers
        error = response.json()["error"]
        challenge = response.headers["WWW-Authenticate"]
        assert challenge.startswith("Bearer")
        # No OAuth here: nothing for a client to discover.
        assert "resource_metadata" not in challenge
        if "not-a-token" in str(headers):
            assert error["data"]["error"] == "invalid_token"
            assert "invalid token" in error["message"]
            assert 'error="invalid_token"' in challenge and "error_description=" in challenge
        else:
            assert error["data"]["error"] == "not_authenticated"
            assert "error=" not in challenge  # RFC 6750: no error code without a token
    opened = httpx.post(
        f"{server.url}/mcp", json=INITIALIZE, headers={**ACCEPT, "Authorization": f"Bearer {token}"}
    )
    assert opened.status_code == 200 and opened.headers["mcp-session-id"]


def test_http_a_wrong_token_is_a_clear_error_from_the_sdks_client_not_an_oauth_flow(
    server: LiveServer,
) -> None:
    from mcp.shared.exceptions import MCPError

    async def test() -> None:
        headers = {"Authorization": "Bearer not-a-token"}
        # The SDK's task groups may wrap it in an exception group.
        refused = pytest.RaisesExc(MCPError, match="invalid token")
        with pytest.RaisesGroup(refused, allow_unwrapped=True, flatten_subgroups=True):
            async with (
                create_mcp_http_client(headers=headers) as http,
                streamable_http_client(f"{server.url}/mcp/", http_client=http) as (read, write),
                ClientSession(read, write) as session,
            ):
                await session.initialize()

    run(test)
    # Nor is there OAuth metadata to discover.
    for path in (
        "/.well-known/oauth-protected-resource/mcp/",
        "/.well-known/oauth-protected-resource",
        "/.well-known/oauth-authorization-server",
    ):
        assert httpx.get(f"{server.url}{path}").status_code == 404, path


def test_http_a_session_belongs_to_the_token_that_opened_it(server: LiveServer, token: str) -> None:
    other = str(TokenFactory.create(user=UserFactory.create(username="intruder")).key)
    opened = httpx.post(
        f"{server.url}/mcp/",
        json=INITIALIZE,
        headers={**ACCEPT, "Authorization": f"Bearer {token}"},
    )
    session_id = opened.headers["mcp-session-id"]
    listing = {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}

    def list_tools(key: str) -> httpx.Response:
        headers = {
            **ACCEPT,
            "Authorization": f"Bearer {key}",
            "Mcp-Session-Id": session_id,
            "Mcp-Protocol-Version": "2025-06-18",
        }
        return httpx.post(f"{server.url}/mcp/", json=listing, headers=headers)

    assert list_tools(other).status_code == 404
    mine = list_tools(token)
    assert mine.status_code == 200 and "claim_task" in mine.text


def test_http_a_vanished_clients_session_times_out_and_its_task_returns(
    settings: Any, token: str
) -> None:
    settings.TASKBOARD_MCP_SESSION_IDLE_SECONDS = 1
    other = UserFactory.create(username="next-agent")

    async def test(server: LiveServer) -> None:
        headers = {"Authorization": f"Bearer {token}"}
        async with (
            create_mcp_http_client(headers=headers) as http,
            streamable_http_client(
                f"{server.url}/mcp/", http_client=http, terminate_on_close=False
            ) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            created = await call(session, "create_task", title="dropped", queue="llm")
            await call(session, "claim_task", queues=["llm"], lease_seconds=2)
            # Longer than the idle timeout and the lease: the client's open stream keeps
            # the session, and so the lease, alive.
            await anyio.sleep(4)
            await call(session, "report_progress", task_id=created["id"], progress="p")
        # The client vanished without deleting its session (as a killed process would).
        gone = time.monotonic()
        claims: list[transitions.Claim] = []
        while not claims:
            assert time.monotonic() - gone < 10, "the task never came back"
            await anyio.sleep(0.2)
            claims = await db(lambda: transitions.claim(actor=other, queues=["llm"]))
        # Away (2 s) or idle (1 s, + 2 s margin), then the lease (2 s) ran out.
        assert time.monotonic() - gone > 3
        assert claims[0].task.pk == created["id"] and claims[0].task.progress == "p"

    with live_server() as server:
        run(lambda: test(server))


def test_http_a_client_that_opens_a_session_per_call_finishes_what_it_claimed(
    server: LiveServer, token: str
) -> None:
    """As the MCP Inspector's CLI does: each call in a new session, which it then deletes
    (the SDK's client) or just leaves (closing its connection)."""

    @asynccontextmanager
    async def one_call(*, delete: bool = True) -> AsyncIterator[ClientSession]:
        headers = {"Authorization": f"Bearer {token}"}
        async with (
            create_mcp_http_client(headers=headers) as http,
            streamable_http_client(
                f"{server.url}/mcp/", http_client=http, terminate_on_close=delete
            ) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            yield session

    async def test() -> list[int]:
        ids = []
        for delete in (True, False):
            async with one_call() as session:
                await call(session, "create_task", title=f"one-shot {delete}", queue="cli")
            async with one_call(delete=delete) as session:
                claimed = await call(session, "claim_task", queues=["cli"], lease_seconds=2)
                ids.append(claimed["id"])
        for task_id in ids:
            async with one_call() as session:
                progressed = await call(session, "report_progress", task_id=task_id, progress=1)
                assert progressed["progress"] == 1
            async with one_call() as session:
                done = await call(session, "complete_task", task_id=task_id, result="ok")
                assert done["status"] == "done"
        return ids

    ids = anyio.run(test)

    for task_id in ids:
        task = Task.objects.get(pk=task_id)
        assert task.status == "done" and task.failure_count == 0
        assert not TaskEvent.objects.filter(task_id=task_id, type="expired").exists()


def test_stdio_a_client_that_starts_a_process_per_call_finishes_what_it_claimed(
    server: LiveServer, token: str, tmp_path: Path
) -> None:
    """As the MCP Inspector's CLI does over stdio: a new ``taskboard mcp`` for each call."""

    async def test() -> int:
        async with mcp_session(server, token, state=tmp_path) as session:
            await session.initialize()
            await call(session, "create_task", title="one-shot", queue="cli")
        async with mcp_session(server, token, state=tmp_path) as session:
            await session.initialize()
            claimed = await call(session, "claim_task", queues=["cli"], lease_seconds=10)
        async with mcp_session(server, token, state=tmp_path) as session:
            await session.initialize()
            await call(session, "report_progress", task_id=claimed["id"], progress=1)
        async with mcp_session(server, token, state=tmp_path) as session:
            await session.initialize()
            done = await call(session, "complete_task", task_id=claimed["id"], result="ok")
            assert done["status"] == "done"
        return int(claimed["id"])

    task_id = anyio.run(test)

    task = Task.objects.get(pk=task_id)
    assert task.status == "done" and task.failure_count == 0 and task.progress == 1
    [claims] = (tmp_path / "taskboard").iterdir()
    assert claims.stat().st_mode & 0o077 == 0  # lease tokens: its user's only
    assert json.loads(claims.read_text()) == {}  # finished: no claim left filed


def test_http_a_claim_whose_lease_ran_out_before_a_new_session_came_says_so(
    server: LiveServer, token: str
) -> None:
    other = UserFactory.create(username="next-agent")

    async def test() -> None:
        headers = {"Authorization": f"Bearer {token}"}
        async with (
            create_mcp_http_client(headers=headers) as http,
            streamable_http_client(
                f"{server.url}/mcp/", http_client=http, terminate_on_close=False
            ) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            created = await call(session, "create_task", title="late", queue="llm")
            await call(session, "claim_task", queues=["llm"], lease_seconds=1)
        # The client left its session without a word, and came back too late.
        claims: list[transitions.Claim] = []
        gone = time.monotonic()
        while not claims:
            assert time.monotonic() - gone < 10, "the task never came back"
            await anyio.sleep(0.2)
            claims = await db(lambda: transitions.claim(actor=other, queues=["llm"]))
        async with mcp_session(server, token, "http") as session:
            await session.initialize()
            refused = await session.call_tool("complete_task", {"task_id": created["id"]})
            assert refused.is_error
            text = text_of(refused)
            assert "lease_lost: " in text and "wrong token" not in text, text
            assert "ran out before this session took it over" in text, text

    run(test)


def test_http_a_session_whose_task_another_session_took_over_is_told_so(
    server: LiveServer, token: str
) -> None:
    async def test() -> None:
        async with mcp_session(server, token, "http") as first:
            await first.initialize()
            created = await call(first, "create_task", title="shared", queue="llm")
            await call(first, "claim_task", queues=["llm"])
            async with mcp_session(server, token, "http") as second:
                await second.initialize()
                done = await call(second, "complete_task", task_id=created["id"])
                assert done["status"] == "done"
                refused = await first.call_tool("complete_task", {"task_id": created["id"]})
                assert refused.is_error
                text = text_of(refused)
                assert "lease_lost: " in text and "Another MCP session of this token" in text
                assert "wrong token" not in text, text

    run(test)


# An MCP host over Streamable HTTP, in a process of its own: it claims a task (printing
# its id) and keeps its session open, as a host does while its model works, until killed.
HOLDING_CLIENT = """
import sys
import anyio
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

async def main(url: str, token: str) -> None:
    headers = {"Authorization": f"Bearer {token}"}
    async with (
        create_mcp_http_client(headers=headers) as http,
        streamable_http_client(url, http_client=http) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        await session.call_tool("create_task", {"title": "killed", "queue": "llm"})
        claimed = await session.call_tool("claim_task", {"queues": ["llm"], "lease_seconds": 3})
        print(claimed.structured_content["result"]["id"], flush=True)
        await anyio.sleep_forever()

anyio.run(main, sys.argv[1], sys.argv[2])
"""


def test_http_a_killed_clients_task_returns_within_its_lease_not_the_session_idle_time(
    server: LiveServer, token: str, settings: Any
) -> None:
    from board.mcp.endpoint import AWAY_AFTER

    lease = 3
    assert settings.TASKBOARD_MCP_SESSION_IDLE_SECONDS == 120  # the default, far above
    other = UserFactory.create(username="next-agent")
    client = subprocess.Popen(
        [sys.executable, "-c", HOLDING_CLIENT, f"{server.url}/mcp/", token],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert client.stdout is not None
        task_id = int(client.stdout.readline())
        # While the client lives, its session renews the lease past its first term.
        eventually(
            lambda: TaskEvent.objects.filter(task_id=task_id, type="heartbeat").count() >= 4,
            timeout=10,
            what="heartbeats for longer than the lease",
        )
        assert Task.objects.get(pk=task_id).leased_by_id == "llm-agent"
    finally:
        client.kill()
        client.wait()
    killed = time.monotonic()

    def claimable() -> list[transitions.Claim]:
        try:
            return transitions.claim(actor=other, queues=["llm"])
        finally:
            connection.close()

    claims = eventually(claimable, timeout=lease + AWAY_AFTER + 3, what="the task's return")
    took = time.monotonic() - killed
    assert claims[0].task.pk == task_id
    print(f"the killed client's task came back after {took:.1f} s (lease {lease} s)")


def test_http_the_sdks_client_in_auto_mode_falls_back_to_a_session(
    server: LiveServer, token: str
) -> None:
    """The SDK's high-level Client probes the sessionless protocol first (server/discover,
    2026-07-28); /mcp/ answers that it speaks only the session versions, and the client
    falls back to the initialize handshake, whose sessions keep leases."""
    from mcp.client.client import Client

    async def test() -> None:
        headers = {"Authorization": f"Bearer {token}"}
        async with create_mcp_http_client(headers=headers) as http:
            transport = streamable_http_client(f"{server.url}/mcp/", http_client=http)
            async with Client(transport) as client:
                tools = await client.list_tools()
                assert {tool.name for tool in tools.tools} == TOOLS
                created = await client.call_tool("create_task", {"title": "auto", "queue": "a"})
                assert not created.is_error, text_of(created)
                claimed = await client.call_tool(
                    "claim_task", {"queues": ["a"], "lease_seconds": 2}
                )
                assert not claimed.is_error, text_of(claimed)
                await anyio.sleep(3)  # past the lease: the session heartbeats it
                task_id = created.structured_content["id"]
                done = await client.call_tool("complete_task", {"task_id": task_id})
                assert not done.is_error, text_of(done)
        assert (await db(lambda: Task.objects.get(pk=task_id))).status == "done"

    run(test)
