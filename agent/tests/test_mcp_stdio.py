"""``taskboard mcp`` over stdio without a server: the SDK's own client starts it as an MCP
host would, finds the board's tools, and a call while the board cannot be reached is a tool
error that says so, not a crash of the session. The tools against a live server are tested
in the repository's tests/test_mcp.py."""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

import anyio
import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.server.mcpserver.exceptions import ToolError

from taskboard_agent import mcp_server


def nowhere() -> str:
    """The address of a port that nothing listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


def test_the_stdio_session_lists_the_tools_and_an_unreachable_board_is_a_tool_error(
    tmp_path: Any,
) -> None:
    env = {
        **os.environ,
        "TASKBOARD_URL": nowhere(),
        "TASKBOARD_TOKEN": "t",
        "XDG_STATE_HOME": str(tmp_path),
    }
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "taskboard_agent.cli", "mcp"], env=env
    )

    async def session() -> tuple[set[str], Any]:
        async with stdio_client(params) as streams, ClientSession(*streams) as client:
            await client.initialize()
            tools = {tool.name for tool in (await client.list_tools()).tools}
            return tools, await client.call_tool("get_task", {"task_id": 1})

    tools, answer = anyio.run(session)

    assert {"claim_task", "complete_task", "create_task", "list_tasks"} <= tools
    assert answer.is_error
    text = "".join(getattr(part, "text", "") for part in answer.content)
    assert "unreachable" in text or "reach" in text, text


def test_a_tool_call_that_waits_for_a_person_tells_its_progress_and_raises_as_it_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A host that times tool calls out, counting from the last progress, keeps waiting.
    monkeypatch.setattr(mcp_server, "PROGRESS_EVERY", 0.05)
    told: list[tuple[float, float | None, str | None]] = []

    class Context:
        async def report_progress(
            self, progress: float, total: float | None = None, message: str | None = None
        ) -> None:
            told.append((progress, total, message))

    async def answered() -> str:
        await anyio.sleep(0.4)
        return "yes"

    async def lost() -> str:
        await anyio.sleep(0.1)
        raise ToolError("lease_lost: gone")

    ctx: Any = Context()
    assert anyio.run(mcp_server._telling_progress, ctx, answered, 60.0) == "yes"
    assert len(told) >= 3
    assert [total for _, total, _ in told] == [60.0] * len(told)
    assert [progress for progress, _, _ in told] == sorted(p for p, _, _ in told)
    assert told[0][2] == "waiting for a person's answer"
    with pytest.raises(ToolError, match="lease_lost"):  # not an ExceptionGroup
        anyio.run(mcp_server._telling_progress, ctx, lost, 60.0)
