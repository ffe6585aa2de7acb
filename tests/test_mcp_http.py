"""``/mcp/`` at the level of its HTTP requests, as a client that is not the SDK's (or a
hostile one) sends them: sessions belong to the token that opened them, requests the board
cannot serve are refused clearly, and no tool call can hold up the server's event loop or
the other sessions' tools. (The SDK's own client drives the tools in tests/test_mcp.py.)"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from access.models import AuthFailure
from board import transitions
from board.models import Task, TaskEvent
from tests.factories import TokenFactory, UserFactory
from tests.live import LiveServer, live_server

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.once]

ACCEPT = "application/json, text/event-stream"
VERSION = "2025-06-18"


def token_of(username: str) -> str:
    return str(TokenFactory.create(user=UserFactory.create(username=username)).key)


def rpc_result(response: httpx.Response) -> Any:
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        for line in response.text.splitlines():
            if line.startswith("data:"):
                return json.loads(line[5:])
    return response.json()


def open_session(url: str, token: str) -> str:
    headers = {"Authorization": f"Bearer {token}", "Accept": ACCEPT}
    params = {"protocolVersion": VERSION, "capabilities": {}, "clientInfo": {"name": "t"}}
    initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": params}
    opened = httpx.post(url, headers=headers, json=initialize)
    assert opened.status_code == 200, opened.text
    session_id = opened.headers["mcp-session-id"]
    headers.update({"Mcp-Session-Id": session_id, "MCP-Protocol-Version": VERSION})
    ready = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    assert httpx.post(url, headers=headers, json=ready).status_code == 202
    return session_id


def call(url: str, token: str, session_id: str, tool: str, **arguments: Any) -> Any:
    headers = {
        "Authorization": f"Bearer {token}",
        "Accept": ACCEPT,
        "Mcp-Session-Id": session_id,
        "MCP-Protocol-Version": VERSION,
    }
    request = {
        "jsonrpc": "2.0",
        "id": 2,
        "method": "tools/call",
        "params": {"name": tool, "arguments": arguments},
    }
    response = httpx.post(url, headers=headers, json=request, timeout=30)
    return response.status_code, rpc_result(response)


def stream_headers(token: str, session_id: str) -> dict[str, str]:
    """The headers of a GET of the session's event stream."""
    return {
        "Authorization": f"Bearer {token}",
        "Accept": "text/event-stream",
        "Mcp-Session-Id": session_id,
        "MCP-Protocol-Version": VERSION,
    }


def holding_a_task(url: str, token: str, lease_seconds: int = 120) -> tuple[str, int]:
    """Open a session of ``token`` that creates a task and claims it: (session id, task id)."""
    session_id = open_session(url, token)
    call(url, token, session_id, "create_task", title="mine", queue="q")
    _, body = call(url, token, session_id, "claim_task", queues=["q"], lease_seconds=lease_seconds)
    return session_id, int(body["result"]["structuredContent"]["result"]["id"])


def test_a_sessionless_2026_request_is_refused_and_cannot_borrow_a_session(
    server: LiveServer,
) -> None:
    alice, mallory = token_of("alice"), token_of("mallory")
    url = f"{server.url}/mcp/"
    session_id, task_id = holding_a_task(url, alice)

    # Mallory names alice's session in a request of the sessionless protocol (2026-07-28),
    # which the SDK serves without looking at sessions.
    headers = {
        "Authorization": f"Bearer {mallory}",
        "Accept": ACCEPT,
        "MCP-Protocol-Version": "2026-07-28",
        "Mcp-Session-Id": session_id,
    }
    params = {"name": "complete_task", "arguments": {"task_id": task_id, "result": "pwned"}}
    forged = {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": params}
    response = httpx.post(url, headers=headers, json=forged)

    assert response.status_code == 400
    assert "2026-07-28" in response.json()["error"]["message"]
    task = Task.objects.get(pk=task_id)
    assert task.status == "in_progress" and task.result is None


def test_another_tokens_request_for_a_session_leaves_its_leases_alone(
    server: LiveServer,
) -> None:
    alice, mallory = token_of("alice"), token_of("mallory")
    url = f"{server.url}/mcp/"
    session_id, task_id = holding_a_task(url, alice, lease_seconds=2)

    headers = {
        "Authorization": f"Bearer {mallory}",
        "Accept": ACCEPT,
        "Mcp-Session-Id": session_id,
        "MCP-Protocol-Version": VERSION,
    }
    assert httpx.get(url, headers=headers).status_code == 404
    assert httpx.delete(url, headers=headers).status_code == 404

    # Alice's client is there (its stream open, as the SDK's client keeps one).
    with httpx.stream("GET", url, headers=stream_headers(alice, session_id), timeout=None) as s:
        assert s.status_code == 200
        time.sleep(3.5)  # past the lease: only the session's heartbeats keep it
        _status, body = call(url, alice, session_id, "complete_task", task_id=task_id)
    assert not body["result"].get("isError"), body
    assert Task.objects.get(pk=task_id).status == "done"


def test_a_lost_lease_found_by_report_progress_never_blocks_the_event_loop(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = transitions.heartbeat

    def slow_background_heartbeat(**kwargs: Any) -> Any:
        if kwargs.get("progress") is None:  # the session's own heartbeats
            time.sleep(1.5)  # a slow database
        return real(**kwargs)

    monkeypatch.setattr(transitions, "heartbeat", slow_background_heartbeat)
    alice = token_of("alice")
    url = f"{server.url}/mcp/"
    started = time.monotonic()
    session_id, task_id = holding_a_task(url, alice, lease_seconds=6)
    # The lease is lost (as when another agent claimed the task after it expired) ...
    Task.objects.filter(pk=task_id).update(lease_token=uuid.uuid4())
    # ... while the session's heartbeat (every 2 s) is on its way.
    time.sleep(max(0, started + 2.3 - time.monotonic()))
    latency: list[float] = []

    def probe() -> None:
        time.sleep(0.3)
        began = time.monotonic()
        httpx.get(f"{server.url}/healthz", timeout=30)
        latency.append(time.monotonic() - began)

    prober = threading.Thread(target=probe)
    prober.start()
    _status, body = call(url, alice, session_id, "report_progress", task_id=task_id, progress=1)
    prober.join()

    assert body["result"]["isError"] and "lease_lost" in body["result"]["content"][0]["text"]
    assert latency[0] < 1.0, f"the server froze for {latency[0]:.1f} s"


def test_forty_waiting_claims_do_not_hold_up_another_sessions_tools(
    server: LiveServer,
) -> None:
    url = f"{server.url}/mcp/"
    tokens = [token_of(f"agent-{n}") for n in range(41)]
    sessions = [open_session(url, token) for token in tokens]

    def wait_for_work(n: int) -> None:
        call(url, tokens[n], sessions[n], "claim_task", queues=["empty"], wait=8)

    waiters = [threading.Thread(target=wait_for_work, args=(n,)) for n in range(40)]
    for waiter in waiters:
        waiter.start()
    time.sleep(1.5)
    started = time.monotonic()
    status, body = call(url, tokens[40], sessions[40], "list_tasks")
    took = time.monotonic() - started
    for waiter in waiters:
        waiter.join()

    assert status == 200 and not body["result"].get("isError"), body
    assert took < 2, f"list_tasks of an unrelated session took {took:.1f} s"


@contextlib.contextmanager
def two_servers(settings: Any) -> Iterator[tuple[LiveServer, LiveServer, Path]]:
    """Two servers as two processes of one ``serve --workers 2`` see each other: each
    listens on a socket of its own in one private directory (board.mcp.forwarding). Here they
    are two servers in this process, on two ports, so that a test picks which one each
    request reaches."""
    directory = Path(tempfile.mkdtemp(prefix="tb-mcp-"))  # short: a socket's path is
    settings.TASKBOARD_SERVE_SOCKETS = str(directory)  # limited to 108 bytes
    try:
        with live_server() as a, live_server() as b:
            yield a, b, directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def two_processes(settings: Any) -> Iterator[tuple[LiveServer, LiveServer, Path]]:
    with two_servers(settings) as servers:
        yield servers


def test_a_stream_through_another_process_keeps_its_session_and_ends_with_its_client(
    settings: Any,
) -> None:
    settings.TASKBOARD_MCP_SESSION_IDLE_SECONDS = 1
    other = UserFactory.create(username="next-agent")
    with two_servers(settings) as (a, b, _directory):
        alice = token_of("alice")
        session_id, task_id = holding_a_task(f"{a.url}/mcp/", alice, lease_seconds=2)
        headers = stream_headers(alice, session_id)
        with httpx.stream("GET", f"{b.url}/mcp/", headers=headers, timeout=10) as stream:
            assert stream.status_code == 200
            # Past the idle timeout and the lease: the stream, open through B, keeps the
            # session in A, and so its heartbeats.
            time.sleep(4)
            assert transitions.claim(actor=other, queues=["q"]) == []
        # The client left: B lets go of A's stream, the session is idle, and ends.
        gone = time.monotonic()
        claims: list[transitions.Claim] = []
        while not claims:
            assert time.monotonic() - gone < 10, "the session outlived its client's stream"
            time.sleep(0.2)
            claims = transitions.claim(actor=other, queues=["q"])
        assert claims[0].task.pk == task_id
        # Idle (1 s, + 2 s margin), then the lease (2 s) ran out.
        assert time.monotonic() - gone > 3


def test_a_session_is_served_by_its_process_whichever_process_a_request_reaches(
    two_processes: tuple[LiveServer, LiveServer, Path],
) -> None:
    a, b, directory = two_processes
    alice = token_of("alice")
    session_id, task_id = holding_a_task(f"{a.url}/mcp/", alice, lease_seconds=2)
    tag = session_id.partition("-")[0]
    assert (directory / f"{tag}.sock").exists() and len(list(directory.iterdir())) == 2

    # Past the lease: only the heartbeats of the session (in A) keep it. Not much past: with
    # no request in flight and no stream open, the session stops heartbeating AWAY_AFTER
    # (2 s) after the last request, and its last heartbeat's lease must still hold when the
    # call below reaches A through B on a loaded machine (3 s left 0.9 s for that).
    time.sleep(2.5)
    status, body = call(
        f"{b.url}/mcp/", alice, session_id, "report_progress", task_id=task_id, progress=1
    )
    assert status == 200 and not body["result"].get("isError"), body

    headers = stream_headers(alice, session_id)
    # The session's event stream, through B: it streams (headers now, events later).
    with httpx.stream("GET", f"{b.url}/mcp/", headers=headers, timeout=5) as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
    status, body = call(f"{b.url}/mcp/", alice, session_id, "complete_task", task_id=task_id)
    assert status == 200 and not body["result"].get("isError"), body
    assert Task.objects.get(pk=task_id).status == "done"

    # Another token cannot reach it through B either; its owner ends it through B.
    mallory = token_of("mallory")
    status, _ = call(f"{b.url}/mcp/", mallory, session_id, "list_tasks")
    assert status == 404
    assert httpx.delete(f"{b.url}/mcp/", headers=headers).status_code == 200
    status, _ = call(f"{a.url}/mcp/", alice, session_id, "list_tasks")
    assert status == 404


def test_a_session_of_a_process_that_is_gone_is_404_once_authenticated(
    two_processes: tuple[LiveServer, LiveServer, Path],
) -> None:
    a, _b, directory = two_processes
    alice = token_of("alice")
    # A process that stopped (its socket removed), and one killed (its socket left behind,
    # with nothing listening).
    killed = socket.socket(socket.AF_UNIX)
    killed.bind(str(directory / f"{'b' * 16}.sock"))
    killed.close()
    for tag in ("a" * 16, "b" * 16):
        session_id = f"{tag}-{uuid.uuid4().hex}"
        status, body = call(f"{a.url}/mcp/", alice, session_id, "list_tasks")
        assert status == 404 and "Session not found" in body["error"]["message"], body
        stranger = httpx.post(
            f"{a.url}/mcp/",
            headers={"Accept": ACCEPT, "Mcp-Session-Id": session_id},
            json={"jsonrpc": "2.0", "id": 1, "method": "ping"},
        )
        assert stranger.status_code == 401


def test_a_new_session_in_another_process_finishes_what_its_tokens_sessions_claimed(
    two_processes: tuple[LiveServer, LiveServer, Path],
) -> None:
    """A client that opens a new session for every call, under ``serve --workers N``: its
    next session may open in another process than the one that holds its claim."""
    a, b, _directory = two_processes
    alice = token_of("alice")
    # One session left open (its client gone without a word), one deleted.
    _left, kept = holding_a_task(f"{a.url}/mcp/", alice, lease_seconds=3)
    deleted, parked = holding_a_task(f"{a.url}/mcp/", alice, lease_seconds=3)
    headers = {"Authorization": f"Bearer {alice}", "Mcp-Session-Id": deleted}
    assert httpx.delete(f"{a.url}/mcp/", headers=headers).status_code < 300

    for task_id in (kept, parked):
        url = f"{b.url}/mcp/"
        _status, body = call(
            url, alice, open_session(url, alice), "report_progress", task_id=task_id, progress=1
        )
        assert not body["result"].get("isError"), body
        _status, body = call(url, alice, open_session(url, alice), "complete_task", task_id=task_id)
        assert not body["result"].get("isError"), body
    for task in Task.objects.filter(pk__in=[kept, parked]):
        assert task.status == "done" and task.failure_count == 0 and task.progress == 1
    assert not TaskEvent.objects.filter(task_id__in=[kept, parked], type="expired").exists()


def test_a_forwarded_requests_client_address_cannot_be_forged(
    two_processes: tuple[LiveServer, LiveServer, Path], settings: Any
) -> None:
    a, b, _directory = two_processes
    session_id = open_session(f"{a.url}/mcp/", token_of("alice"))
    settings.TASKBOARD_TOKEN_CACHE_SECONDS = 0
    # A wrong token for A's session, sent to B, which passes it on: A refuses it and counts
    # the failure against the address B saw, not the one the request claims.
    headers = {
        "Authorization": "Bearer wrong",
        "Accept": ACCEPT,
        "Mcp-Session-Id": session_id,
        "Taskboard-Forwarded-Client": "203.0.113.9 4444",
    }
    refused = httpx.post(f"{b.url}/mcp/", headers=headers, json={"jsonrpc": "2.0", "method": "x"})

    assert refused.status_code == 401
    assert list(AuthFailure.objects.values_list("address", flat=True)) == ["127.0.0.1"]


def test_a_token_is_looked_up_once_then_taken_from_the_apis_cache(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from board.api.authentication import authenticate as real
    from board.mcp import endpoint as mcp_endpoint

    lookups: list[str] = []

    def counted(authorization: str, session_key: str = "", *, address: str | None = None) -> Any:
        lookups.append(str(address))
        return real(authorization, session_key, address=address)

    monkeypatch.setattr(mcp_endpoint, "authenticate", counted)
    alice = token_of("alice")
    url = f"{server.url}/mcp/"
    session_id = open_session(url, alice)
    for n in range(5):
        call(url, alice, session_id, "create_task", title=f"t{n}", queue="q")

    # Seven requests (initialize, initialized, five tool calls), one lookup (and so one
    # database connection) among them.
    assert len(lookups) == 1


def test_when_the_database_is_away_a_session_goes_on_and_a_new_one_gets_a_json_rpc_503(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch, settings: Any
) -> None:
    from django.db import OperationalError

    from board.mcp import endpoint as mcp_endpoint

    settings.TASKBOARD_TOKEN_CACHE_SECONDS = 0  # every request looks its token up
    alice = token_of("alice")
    url = f"{server.url}/mcp/"
    session_id = open_session(url, alice)

    def away(authorization: str, session_key: str = "", *, address: str | None = None) -> Any:
        raise OperationalError("the database is away")

    monkeypatch.setattr(mcp_endpoint, "authenticate", away)
    # The session's request goes on: its tool call meets the board as it is (here, up).
    status, body = call(url, alice, session_id, "list_tasks")
    assert status == 200 and not body["result"].get("isError"), body

    headers = {"Authorization": f"Bearer {alice}", "Accept": ACCEPT}
    params = {"protocolVersion": VERSION, "capabilities": {}, "clientInfo": {"name": "t"}}
    initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": params}
    refused = httpx.post(url, headers=headers, json=initialize)
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "5"
    assert refused.json()["error"]["message"].startswith("unavailable: ")


def test_a_session_that_is_gone_is_answered_with_what_to_do(server: LiveServer) -> None:
    alice = token_of("alice")
    url = f"{server.url}/mcp/"
    status, body = call(url, alice, uuid.uuid4().hex, "list_tasks")
    assert status == 404
    assert "Connect again" in body["error"]["message"]


def test_a_claim_that_arrives_after_its_session_ended_is_released_without_a_strike(
    server: LiveServer,
) -> None:
    from mcp.server.mcpserver.exceptions import ToolError

    from taskboard_agent.client import Client
    from taskboard_agent.mcp_server import Session

    alice = token_of("alice")
    with Client(server.url, alice) as client:
        task = client.create("late", queue="q")
        session = Session(client)
        session.close()  # the host went away while its claim waited
        (claimed,) = client.claim(queues=["q"])
        with pytest.raises(ToolError, match="released"):
            session.hold(claimed)

    row = Task.objects.get(pk=task.id)
    assert row.status == "pending" and row.failure_count == 0


def test_a_waiting_claim_whose_session_is_deleted_gives_back_what_it_then_claims(
    server: LiveServer,
) -> None:
    # The session's end closed its client while the claim waited; the claim that then came
    # back could not be released through it, and the task stayed held by nobody until its
    # lease ran out, with a strike.
    alice = token_of("alice")
    url = f"{server.url}/mcp/"
    session_id = open_session(url, alice)

    def claim_and_wait() -> None:
        # Its answer never comes: the session is deleted meanwhile (an empty body).
        with contextlib.suppress(ValueError):
            call(url, alice, session_id, "claim_task", queues=["late"], wait=30)

    waiting = threading.Thread(target=claim_and_wait)
    waiting.start()
    time.sleep(1)  # the claim waits on the board
    headers = {"Authorization": f"Bearer {alice}", "Mcp-Session-Id": session_id}
    assert (
        httpx.delete(url, headers={**headers, "MCP-Protocol-Version": VERSION}).status_code == 200
    )
    task = transitions.create(actor=UserFactory.create(username="bob"), title="late", queue="late")
    waiting.join(timeout=30)

    def types() -> list[str]:
        events = TaskEvent.objects.filter(task_id=task.pk).order_by("id")
        return list(events.values_list("type", flat=True))

    deadline = time.monotonic() + 15  # the claim, still waiting on the board, takes it
    while types() != ["created", "claimed", "released"] and time.monotonic() < deadline:
        time.sleep(0.1)
    row = Task.objects.get(pk=task.pk)
    assert (row.status, row.failure_count, row.leased_by) == ("pending", 0, None)
    assert types() == ["created", "claimed", "released"]


def test_a_tool_argument_over_the_apis_limit_is_the_tools_error_as_over_stdio(
    server: LiveServer,
) -> None:
    # The SDK refused the request itself, with a bare text 413 its client reports as an
    # opaque error; over stdio the same call was the API's payload_too_large.
    alice = token_of("alice")
    url = f"{server.url}/mcp/"
    session_id, task_id = holding_a_task(url, alice)

    status, body = call(
        url, alice, session_id, "complete_task", task_id=task_id, result="a" * 1_100_000
    )

    assert status == 200
    assert body["result"]["isError"] is True
    assert "payload_too_large" in body["result"]["content"][0]["text"]
    assert Task.objects.get(pk=task_id).status == "in_progress"  # still held, heartbeating

    headers = {
        "Authorization": f"Bearer {alice}",
        "Accept": ACCEPT,
        "Mcp-Session-Id": session_id,
        "MCP-Protocol-Version": VERSION,
        "Content-Type": "application/json",
    }
    huge = httpx.post(url, headers=headers, content=b" " * (5 * 1024 * 1024))
    assert huge.status_code == 413
    assert "payload_too_large" in huge.json()["error"]["message"]


def test_every_entry_point_authenticates_through_one_function(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/mcp/, the API's views, the stream and waiting claims all take their user from
    board.api.authentication.authenticate: a token refused there is refused by each."""
    from board.api import authentication
    from board.api.authentication import Refused

    seen: list[str] = []
    real = authentication._authenticate

    def counted(authorization: str, session_key: str) -> Any:
        seen.append(authorization)
        return real(authorization, session_key)

    monkeypatch.setattr(authentication, "_authenticate", counted)
    alice = token_of("alice")
    bearer = {"Authorization": f"Bearer {alice}"}
    open_session(f"{server.url}/mcp/", alice)
    assert seen, "/mcp/"
    seen.clear()
    assert httpx.get(f"{server.url}/api/v1/tasks/", headers=bearer).status_code == 200
    assert seen, "the API's views"
    seen.clear()
    assert httpx.head(f"{server.url}/api/v1/stream/", headers=bearer).status_code == 200
    assert seen, "the stream"
    seen.clear()
    claim = httpx.post(
        f"{server.url}/api/v1/tasks/claim/", headers=bearer, json={"wait": 0.2}, timeout=10
    )
    assert claim.status_code == 200
    assert seen, "a waiting claim"

    def refuse(authorization: str, session_key: str) -> Any:
        return Refused("Invalid token.", presented=True)

    monkeypatch.setattr(authentication, "_authenticate", refuse)
    authentication.forget(None)  # /mcp/ would otherwise trust the cache without asking
    assert httpx.get(f"{server.url}/api/v1/tasks/", headers=bearer).status_code == 401
    assert httpx.head(f"{server.url}/api/v1/stream/", headers=bearer).status_code == 401
    claim = httpx.post(f"{server.url}/api/v1/tasks/claim/", headers=bearer, json={"wait": 0.2})
    assert claim.status_code == 401
    mcp = httpx.post(
        f"{server.url}/mcp/",
        headers={**bearer, "Accept": ACCEPT},
        json={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}},
    )
    assert mcp.status_code == 401
