"""An MCP host (an LLM agent's process) killed with ``kill -9`` while its session holds a
task, over both transports, against ``taskboard serve``: the task returns to the board by
itself, and the next agent resumes from the last progress reported.

- stdio: the host's ``taskboard mcp`` sees its stdin close and exits, and its heartbeats
  with it;
- Streamable HTTP: the killed host's stream closes, so its client is gone: its session
  stops renewing its leases 2 s later (and ends after TASKBOARD_MCP_SESSION_IDLE_SECONDS).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from board import transitions
from board.models import Task, TaskEvent
from tests.factories import UserFactory
from tests.processes import ROOT, ServeProcess, cli_env, eventually

pytestmark = [pytest.mark.slow, pytest.mark.once, pytest.mark.django_db(transaction=True)]

LEASE_SECONDS = 2
IDLE_SECONDS = 1

# The host: opens an MCP session, claims the task, reports progress, says so, and thinks
# (sleeps) until it is killed.
HOST = """
import os, sys, anyio
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

transport, url, token, lease = sys.argv[1:5]

async def work(session):
    await session.initialize()
    claim = {"queues": ["llm"], "lease_seconds": int(lease)}
    claimed = await session.call_tool("claim_task", claim)
    task_id = claimed.structured_content["result"]["id"]
    await session.call_tool("report_progress", {"task_id": task_id, "progress": {"step": 3}})
    print("holding", task_id, flush=True)
    await anyio.sleep(3600)

async def main():
    if transport == "http":
        headers = {"Authorization": "Bearer " + token}
        async with create_mcp_http_client(headers=headers) as http, streamable_http_client(
            url + "/mcp/", http_client=http
        ) as (read, write), ClientSession(read, write) as session:
            await work(session)
    else:
        # As a host configured as docs/tutorials/mcp-agent.md says: TASKBOARD_URL, TASKBOARD_TOKEN.
        params = StdioServerParameters(
            command=sys.executable, args=["-m", "taskboard_agent.cli", "mcp"], env=dict(os.environ)
        )
        async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
            await work(session)

anyio.run(main)
"""


@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_a_killed_hosts_task_returns_and_the_next_agent_resumes_its_progress(
    transport: str,
    start_serve: Callable[..., ServeProcess],
    token_for: Callable[[str], str],
    tmp_path: Path,
) -> None:
    server = start_serve(TASKBOARD_MCP_SESSION_IDLE_SECONDS=str(IDLE_SECONDS))
    planner = UserFactory.create(username="planner")
    task = transitions.create(actor=planner, title="long think", queue="llm")
    script = tmp_path / "host.py"
    script.write_text(HOST)
    token = token_for("llm-agent")
    log = tmp_path / "host.log"
    with log.open("w") as out:
        host = subprocess.Popen(
            [sys.executable, str(script), transport, server.url, token, str(LEASE_SECONDS)],
            # stdio: its claims filed here, not in this user's home.
            env={**cli_env(server, token), "XDG_STATE_HOME": str(tmp_path)},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=out,
            text=True,
        )
    try:
        assert host.stdout is not None
        line = host.stdout.readline()
        assert line.strip() == f"holding {task.pk}", (line, log.read_text())
        children = psutil.Process(host.pid).children(recursive=True)
        # Held for longer than its lease while the host lives: the session heartbeats.
        time.sleep(LEASE_SECONDS * 1.5)
        held = Task.objects.get(pk=task.pk)
        assert held.status == "in_progress" and held.leased_by_id == "llm-agent"

        host.kill()
        host.wait(5)
    finally:
        if host.poll() is None:
            host.kill()
    # stdio: the host's `taskboard mcp` goes with it (its stdin closed).
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"left running after its host was killed: {alive}"

    other = UserFactory.create(username="next-agent")
    claims = eventually(
        lambda: transitions.claim(actor=other, queues=["llm"]),
        timeout=IDLE_SECONDS + 2 + LEASE_SECONDS + 10,
        what="the task's return",
    )
    assert claims[0].task.pk == task.pk
    assert claims[0].task.progress == {"step": 3}
    expired = TaskEvent.objects.filter(task_id=task.pk, type="expired").count()
    assert expired == 1
