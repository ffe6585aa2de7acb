"""``/mcp/``: the board's MCP tools (taskboard_agent.mcp_server) over Streamable HTTP.

The tools, and the HTTP client they call the API with, are the agent's package's (the
server's distribution depends on taskboard-agent), so that both transports serve the same
tools; this module and board.mcp.forwarding are the only parts of the server that import
that package.

The transport and its sessions are the official SDK's (``StreamableHTTPSessionManager``);
what is here is what the board adds around it:

- **Authentication.** Every request needs the API's ``Authorization: Bearer <token>``
  (board.api.authentication.authenticate, as for every entry point, failures throttled
  per address), or it is answered ``401`` before it reaches the SDK. A session belongs to the
  token that opened it: the SDK answers ``404`` to a request for it with another token,
  and such a request moves nothing here. Requests of the sessionless protocol version
  (2026-07-28), which the SDK serves without looking at sessions and which could not keep
  a lease from one call to the next, are refused (``400``).
- **The tools call this process's own API, in process.** Each session has a
  :class:`~taskboard_agent.client.Client` with its token whose transport hands the request to
  this server's HTTP application on its event loop (:class:`InProcess`), so the tools
  answer with exactly the API's validation and error codes, and use the API's worker
  threads and database connections, as stdio's ``taskboard mcp`` does over the network.
- **Leases live while the session's client is there.** A session's claims are heartbeated
  by :class:`~taskboard_agent.mcp_server.Session` while the session has a request in flight or
  an open stream (the SDK's client keeps one open while it lives); AWAY_AFTER seconds
  without either pause the heartbeats until its next request, so that a killed client's
  tasks run out within their lease, not the session's idle time. The heartbeats stop for
  good when the session ends: the client deletes it (``DELETE /mcp/``), it is idle for
  TASKBOARD_MCP_SESSION_IDLE_SECONDS, or this server stops. Its leases then run out as
  usual.
- **A token's sessions share its claims.** A tool call on a task that another session of
  the same token holds, or ended with while its lease lasts (a client that opens a new
  session for every call), takes the claim over (:meth:`Sessions.take_over`, in another
  process of this server through board.mcp.forwarding); the session it came from then
  answers ``lease_lost`` saying so.

The SDK keeps no hook for a session's end that a tool can reach, so :class:`Sessions`
follows each session from the HTTP requests that name it: a ``DELETE`` that succeeded or
a ``404`` ends it at once, and its idle timer is the SDK's plus a margin, so that the SDK
has forgotten the session (and answers ``404``) before its leases are let go.

Sessions live in the process that opened them. Behind several servers, a session's
requests must reach the same one (docs/explanation/scaling.md); between the processes of
one ``serve --workers N``, whose connections reach them at random, board.mcp.forwarding passes
each request to the process that holds its session.

Nothing here or in the tools that may wait for the board runs on the event loop: the
board's answers to the tools come from that very loop (taskboard_agent.mcp_server._call).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from asgiref.sync import sync_to_async
from django.db import DatabaseError
from django.http import JsonResponse
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.streamable_http import MCP_SESSION_ID_HEADER
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.inbound import MCP_PROTOCOL_VERSION_HEADER
from mcp_types import INTERNAL_ERROR, INVALID_REQUEST, UNSUPPORTED_PROTOCOL_VERSION
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS

from access import throttle
from access.tokens import digest as tokens_digest
from board import conf
from board.api.authentication import Refused, authenticate, cached_user
from board.http.asgi_tools import read_body, send_response
from board.http.errors import error_response
from board.http.middleware import check_host
from board.mcp import forwarding
from taskboard_agent.client import ClaimedTask, Client
from taskboard_agent.mcp_server import TOOL_CALL_LIMITS, Session, build_server

logger = logging.getLogger(__name__)

PATHS = frozenset({"/mcp", "/mcp/"})
# Seconds this module's idle timer runs past the SDK's, so that the SDK ends a session first.
IDLE_MARGIN = 2.0
# Seconds a session may be without a request or an open stream before its client counts
# as gone and its leases are no longer renewed: long enough for a stream to reconnect, or
# for the gap between two requests of a client that keeps no stream open.
AWAY_AFTER = 2.0
# Seconds a session waits for another of its token to finish closing, for the claims it
# parks (its heartbeats stop within a request's time).
CLOSE_WAIT = 15.0
# Open sessions per process, and per token (so that one agent cannot take them all).
MAX_SESSIONS = 2000
SESSIONS_PER_TOKEN = 50
# A JSON-RPC request may be larger than the API's limit on bodies, so that a tool call whose
# argument the API refuses as too large (a result over 1 MiB) reaches the tool and is its
# error, payload_too_large, as over stdio; one larger than this is refused before the SDK
# reads it, with a JSON-RPC error (the SDK's own refusal is a bare text 413).
MAX_RPC_BYTES = 4 * conf.MAX_BODY_BYTES
# Where the token that authenticated a request is kept in its ASGI scope.
TOKEN_KEY = "taskboard.token"
# What a session says of a task that is in progress but that no session of its token here
# holds (Session.not_held).
NOT_HELD_HERE = (
    "A session of /mcp/ acts on the tasks its token claimed in any of its sessions on this "
    "server, while their leases last; this one is held by another agent, by a client of "
    "this token other than an MCP session here, or claimed on another server."
)

Scope = dict[str, Any]


class InProcess(httpx.BaseTransport):
    """An httpx transport that sends each request to an ASGI application running on
    ``loop`` (this server's own), from the thread that makes the request.

    For the MCP tools' :class:`~taskboard_agent.client.Client`: a blocking client, called from
    worker threads and heartbeat threads, whose requests go through the same application
    (body limit, waiting claims, Django) as requests from the network.
    """

    def __init__(self, app: Any, loop: asyncio.AbstractEventLoop, client: tuple[str, int]) -> None:
        self._asgi = httpx.ASGITransport(app=app, client=client, raise_app_exceptions=False)
        self._loop = loop

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if _on_loop(self._loop):
            raise RuntimeError("InProcess requests block: make them from another thread")
        body = request.read()
        headers = [
            (name, value)
            for name, value in request.headers.multi_items()
            if name.lower() not in {"content-length", "transfer-encoding"}
        ]
        forwarded = httpx.Request(request.method, request.url, headers=headers, content=body)
        timeout = request.extensions.get("timeout", {}).get("read")
        future = asyncio.run_coroutine_threadsafe(self._send(forwarded), self._loop)
        try:
            status, response_headers, content = future.result(timeout)
        except concurrent.futures.TimeoutError as exc:
            future.cancel()
            raise httpx.ReadTimeout("no answer in time", request=request) from exc
        except RuntimeError as exc:  # the loop is closed: the server is stopping
            raise httpx.ConnectError(str(exc), request=request) from exc
        return httpx.Response(status, headers=response_headers, content=content, request=request)

    async def _send(self, request: httpx.Request) -> tuple[int, httpx.Headers, bytes]:
        response = await self._asgi.handle_async_request(request)
        content = await response.aread()
        return response.status_code, response.headers, content


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


@dataclass
class Tracked:
    """What :class:`Sessions` knows of one MCP session: whose it is (the digest of the
    token that opened it), its leases, and the requests in flight for it."""

    owner: str
    session: Session | None = None
    in_flight: int = 0
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)
    away_timer: asyncio.TimerHandle | None = field(default=None, repr=False)


class Sessions:
    """The board's side of this process's MCP sessions (their leases), by session id.

    Only a session's owner moves it: a request with another token is answered 404 by the
    SDK and changes nothing here.
    """

    def __init__(
        self, app: Any, idle_seconds: float, router: forwarding.Router | None = None
    ) -> None:
        self.app = app
        self.idle_seconds = idle_seconds
        self.router = router
        self._tracked: dict[str, Tracked] = {}
        # The claims that sessions still held when they ended, by owner and task id, with
        # when their leases have surely run out: a later session of the same token takes
        # them over (a client that opens a session for every call finishes what it claimed).
        self._parked: dict[str, dict[int, tuple[ClaimedTask, float]]] = {}
        # Sessions of each owner being closed (their claims not parked yet), each set once
        # it is closed.
        self._closing: dict[str, set[threading.Event]] = {}
        self._parked_lock = threading.Lock()

    def session_of(self, ctx: Context) -> Session:
        """The :class:`Session` of the MCP session that made this tool call."""
        request = ctx.request_context.request
        scope = request.scope if request is not None else {}
        session_id = request.headers.get(MCP_SESSION_ID_HEADER) if request is not None else None
        tracked = self._tracked.get(session_id) if session_id else None
        token = scope.get(TOKEN_KEY)
        if (
            request is None
            or tracked is None
            or token is None
            or tokens_digest(token) != tracked.owner
        ):
            # __call__ lets a tool call through only in a session its owner opened here.
            raise ToolError("unavailable: no MCP session of this token here. Open a new one.")
        if tracked.session is None:
            client = scope.get("client") or ("127.0.0.1", 0)
            # The token authenticate() accepted, and the Host, which passed ALLOWED_HOSTS.
            api = Client(
                f"http://{request.headers.get('host', 'localhost')}{scope.get('root_path', '')}",
                token,
                transport=InProcess(self.app, asyncio.get_running_loop(), tuple(client)),
                **TOOL_CALL_LIMITS,
            )
            session = Session(api, owns_client=True, not_held=NOT_HELD_HERE)
            loop = asyncio.get_running_loop()
            session.take_over = functools.partial(self.take_over, tracked.owner, session, loop)
            session.park = functools.partial(self.park, tracked.owner)
            tracked.session = session
        return tracked.session

    def take_over(
        self, owner: str, taker: Session, loop: asyncio.AbstractEventLoop, task_id: int
    ) -> ClaimedTask | None:
        """For ``taker``, a session of ``owner``'s: the claim on ``task_id`` that another
        session of that token holds or ended with, here or in another process of this
        server, taken from it. In a worker thread (it waits for heartbeats to stop)."""
        task = self.take_here(owner, task_id, taker)
        if task is None and self.router is not None:
            asking = asyncio.run_coroutine_threadsafe(self.router.take(owner, task_id), loop)
            try:
                task = asking.result()
            except Exception:
                logger.exception("mcp: asking the other processes for task %s failed", task_id)
        return task

    def take_here(
        self, owner: str, task_id: int, taker: Session | None = None
    ) -> ClaimedTask | None:
        """The claim on ``task_id`` that a session of ``owner`` in this process (other than
        ``taker``) holds, or ended with while its lease may last, taken from it."""
        with self._parked_lock:
            closing = list(self._closing.get(owner, ()))
        for closed in closing:  # a client's DELETE may come just before its next session
            closed.wait(CLOSE_WAIT)
        with self._parked_lock:
            parked = self._parked.get(owner, {})
            entry = parked.pop(task_id, None)
            if not parked:
                self._parked.pop(owner, None)
        if entry is not None and entry[1] > time.monotonic():
            return entry[0]
        for tracked in list(self._tracked.values()):
            session = tracked.session
            if tracked.owner == owner and session is not None and session is not taker:
                task = session.give_up(task_id)
                if task is not None:
                    return task
        return None

    def park(self, owner: str, task: ClaimedTask) -> None:
        """Keep the claim on ``task`` that a session of ``owner`` ended with, for another
        session of that token, until its lease has surely run out."""
        now = time.monotonic()
        with self._parked_lock:
            for name, parked in list(self._parked.items()):  # forget those that ran out
                for task_id in [key for key, (_, until) in parked.items() if until <= now]:
                    del parked[task_id]
                if not parked:
                    del self._parked[name]
            self._parked.setdefault(owner, {})[task.id] = (task, now + task.lease_seconds)

    def opened(self, session_id: str, owner: str) -> None:
        """The SDK opened ``session_id`` for the token whose digest is ``owner``; it is
        idle until its next request."""
        self._tracked[session_id] = Tracked(owner=owner)
        self._idle(session_id, self._tracked[session_id])

    def owned_by(self, session_id: str, owner: str) -> bool:
        tracked = self._tracked.get(session_id)
        return tracked is not None and tracked.owner == owner

    def count(self, owner: str) -> int:
        return sum(1 for tracked in self._tracked.values() if tracked.owner == owner)

    def begin(self, session_id: str) -> Tracked | None:
        """A request of its owner for ``session_id`` begins: it is not idle."""
        tracked = self._tracked.get(session_id)
        if tracked is not None:
            tracked.in_flight += 1
            _cancel(tracked)
            if tracked.session is not None and not tracked.session.present:
                self._attend(tracked.session, present=True)
        return tracked

    def finish(self, session_id: str, tracked: Tracked, *, gone: bool) -> None:
        """The owner's request for ``session_id`` that :meth:`begin` counted finished;
        ``gone``: the SDK no longer has the session."""
        if self._tracked.get(session_id) is not tracked:
            return  # ended meanwhile
        tracked.in_flight = max(0, tracked.in_flight - 1)
        if gone:
            self.end(session_id)
        elif tracked.in_flight == 0:
            self._idle(session_id, tracked)

    def _idle(self, session_id: str, tracked: Tracked) -> None:
        loop = asyncio.get_running_loop()
        tracked.timer = loop.call_later(self.idle_seconds + IDLE_MARGIN, self.end, session_id)
        tracked.away_timer = loop.call_later(AWAY_AFTER, self._away, session_id)

    def _away(self, session_id: str) -> None:
        """The session's client has been gone for AWAY_AFTER: stop renewing its leases (its
        next request renews them again, if they have not run out meanwhile). The session
        itself is kept for the idle time, for a client that comes back."""
        tracked = self._tracked.get(session_id)
        if tracked is not None and tracked.in_flight == 0 and tracked.session is not None:
            self._attend(tracked.session, present=False)

    def _attend(self, session: Session, *, present: bool) -> None:
        session.attend(present)
        # In a thread: stopping a heartbeat may wait for its answer from this loop.
        settling = asyncio.get_running_loop().run_in_executor(None, session.settle)
        settling.add_done_callback(_log_failure)

    def end(self, session_id: str) -> None:
        """Forget ``session_id`` and stop its heartbeats (in a thread: they may be waiting
        for this loop)."""
        tracked = self._tracked.pop(session_id, None)
        if tracked is None:
            return
        _cancel(tracked)
        if tracked.session is not None:
            logger.info("MCP session %s ended; its leases will run out", session_id[:8])
            closed = threading.Event()
            with self._parked_lock:
                self._closing.setdefault(tracked.owner, set()).add(closed)
            closing = asyncio.get_running_loop().run_in_executor(
                None, self._close, tracked.owner, tracked.session, closed
            )
            closing.add_done_callback(_log_failure)

    def _close(self, owner: str, session: Session, closed: threading.Event) -> None:
        try:
            session.close()  # which parks its claims
        finally:
            with self._parked_lock:
                self._closing.get(owner, set()).discard(closed)
                if not self._closing.get(owner, True):
                    del self._closing[owner]
            closed.set()

    async def end_all(self) -> None:
        sessions = [t.session for t in self._tracked.values() if t.session is not None]
        for session in sessions:
            session.park = None  # this server stops: nobody here will take them over
        for tracked in self._tracked.values():
            _cancel(tracked)
        self._tracked.clear()
        await asyncio.gather(*(asyncio.to_thread(session.close) for session in sessions))


def _cancel(tracked: Tracked) -> None:
    for timer in (tracked.timer, tracked.away_timer):
        if timer is not None:
            timer.cancel()
    tracked.timer = tracked.away_timer = None


def _log_failure(future: asyncio.Future[None]) -> None:
    if not future.cancelled() and (error := future.exception()) is not None:
        logger.error("closing an MCP session failed", exc_info=error)


class MCPApplication:
    """The ASGI application at ``/mcp/``: authentication, then the SDK's transport."""

    def __init__(self, app: Any) -> None:
        # Set when this is one of several processes of a `serve` (board.mcp.forwarding).
        self.router = (
            forwarding.Router(Path(conf.serve_sockets())) if conf.serve_sockets() else None
        )
        self.sessions = Sessions(app, conf.mcp_session_idle_seconds(), router=self.router)
        self.server = build_server(self.sessions.session_of)
        # Made for its session manager: the requests reach it through __call__, not
        # through this Starlette application.
        self.server.streamable_http_app(
            session_idle_timeout=conf.mcp_session_idle_seconds(),
            max_request_body_size=MAX_RPC_BYTES,
            max_sessions=MAX_SESSIONS,
            # Hosts are checked against ALLOWED_HOSTS as for every request (in __call__).
            # Origins need no check: only a token opens a session, and no browser sends
            # one by itself (no cookie is accepted here).
            transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
        )
        self.manager = self.server.session_manager

    @contextlib.asynccontextmanager
    async def run(self) -> AsyncIterator[None]:
        """Serve sessions while in this context; on leaving it, end them all."""
        async with contextlib.AsyncExitStack() as stack:
            if self.router is not None:
                # Entered first, left last: forwarded requests are served until this
                # process's sessions have ended.
                await stack.enter_async_context(self.router.listening(private_application))
            try:
                async with self.manager.run():
                    yield
            finally:
                await self.sessions.end_all()

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        # The Host was checked in front (taskboard.asgi, or private_application).
        if self.router is not None:
            routed = await self.route(self.router, scope, receive, send)
            if routed is None:
                return
            scope, send = routed
        headers = {
            name.decode("latin-1").lower(): value.decode("latin-1")
            for name, value in scope["headers"]
        }
        authenticated = await self.authenticate(scope, headers, send)
        if authenticated is None:
            return
        version = headers.get(MCP_PROTOCOL_VERSION_HEADER)
        if version is not None and version not in HANDSHAKE_PROTOCOL_VERSIONS:
            # Sessionless exchanges (2026-07-28) cannot keep a lease between two calls. The
            # protocol's answer to a version a server does not speak names those it does:
            # the SDK's client (mode "auto") then falls back to the initialize handshake.
            supported = list(HANDSHAKE_PROTOCOL_VERSIONS)
            await _jsonrpc_error(
                send,
                400,
                f"MCP protocol version {version[:32]!r} is not served here: this server "
                f"keeps leases in sessions ({', '.join(supported)}).",
                code=UNSUPPORTED_PROTOCOL_VERSION,
                data={"supported": supported, "requested": version[:32]},
            )
            return
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_RPC_BYTES:
            await _jsonrpc_error(
                send,
                413,
                f"payload_too_large: MCP requests are limited to {MAX_RPC_BYTES} bytes.",
            )
            return
        user, token = authenticated
        owner = tokens_digest(token)
        scope = dict(scope, user=user, path="/mcp/", raw_path=b"/mcp/")
        scope[TOKEN_KEY] = token
        session_id = headers.get(MCP_SESSION_ID_HEADER)
        if session_id is None:
            if self.sessions.count(owner) >= SESSIONS_PER_TOKEN:
                await _jsonrpc_error(
                    send,
                    429,
                    f"This token has {SESSIONS_PER_TOKEN} MCP sessions open here: end one "
                    "(DELETE) before opening another.",
                )
                return
            await self.manager.handle_request(
                scope, receive, _capture_session(send, self.sessions, owner)
            )
            return
        if not self.sessions.owned_by(session_id, owner):
            # Another token's session, or one that ended: nothing here moves, and the answer
            # is the SDK's 404 (the same for both), saying what to do.
            await self.not_found(send)
            return
        status: list[int] = []

        async def watched(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        tracked = self.sessions.begin(session_id)
        try:
            await self.manager.handle_request(scope, receive, watched)
        finally:
            if tracked is not None:
                deleted = scope["method"] == "DELETE" and bool(status) and status[0] < 300
                gone = deleted or status[:1] == [404]
                self.sessions.finish(session_id, tracked, gone=gone)

    async def not_found(self, send: Any) -> None:
        await _jsonrpc_error(
            send,
            404,
            "Session not found: this MCP session does not exist here (it was deleted, "
            f"idle for over {self.sessions.idle_seconds:g} s, or the server restarted). "
            "Connect again for a new session; tasks the old one held return to the board "
            "when their leases run out.",
        )

    async def route(
        self, router: forwarding.Router, scope: Scope, receive: Any, send: Any
    ) -> tuple[Scope, Any] | None:
        """Under ``serve --workers N``: pass a request for another process's session to
        it (None: answered), or return the scope and send with which to serve it here (the
        SDK's session id in the scope, answers naming this process's ids)."""
        header = MCP_SESSION_ID_HEADER.encode("latin-1")
        renamed = router.renaming(send, header)
        for name, value in scope["headers"]:
            if name.lower() != header:
                continue
            tag, inner = router.inbound(value.decode("latin-1"))
            if tag == router.tag:
                others = [(n, v) for n, v in scope["headers"] if n.lower() != header]
                scope = dict(scope, headers=[*others, (header, inner.encode("latin-1"))])
                return scope, renamed
            if tag is None or scope.get(forwarding.FORWARDED_KEY):
                break  # no process of this server handed it out: the SDK's 404
            try:
                await router.forward(tag, scope, receive, send)
            except forwarding.Gone:
                # The process that held the session is gone, and the session with it.
                # Answered as any request for an unknown session: authenticated first.
                named = {
                    n.decode("latin-1").lower(): v.decode("latin-1") for n, v in scope["headers"]
                }
                if await self.authenticate(scope, named, send) is not None:
                    await self.not_found(send)
            except forwarding.Interrupted:
                await _jsonrpc_error(
                    send,
                    503,
                    "unavailable: the server process holding this MCP session did not answer. "
                    "Try again shortly.",
                    code=INTERNAL_ERROR,
                    headers={"Retry-After": "1"},
                )
            return None
        return scope, renamed

    async def authenticate(
        self, scope: Scope, headers: dict[str, str], send: Any
    ) -> tuple[AuthenticatedUser, str] | None:
        """The request's token, as the SDK's user and as it was sent; or None after
        answering 401, 429 or 503.

        A token the API's cache (TASKBOARD_TOKEN_CACHE_SECONDS) vouches for costs no query;
        another is looked up as the stream looks it up, and then cached. When the database
        is away, a request for a session that this token opened goes on: its tool calls
        then meet the outage as tool errors (``unavailable: ...``), which a model can read.
        """
        client = scope.get("client")
        address = str(client[0]) if client else ""
        authorization = headers.get("authorization", "")
        keyword, _, token = authorization.partition(" ")
        token = token.strip()
        digest = tokens_digest(token)
        # The SDK binds a session to this principal: the token, not just the user, so that
        # a rotated token cannot carry on a session the old one opened.
        principal = AuthenticatedUser(
            AccessToken(token=digest, client_id=f"token:{digest}", scopes=[])
        )
        if keyword.lower() in {"bearer", "token"} and cached_user(digest) is not None:
            return principal, token
        try:
            # Only a token: a browser's session cookie is no credential for an agent's tools.
            authorized = await sync_to_async(authenticate, thread_sensitive=False)(
                authorization, address=address
            )
        except DatabaseError as exc:
            session_id = headers.get(MCP_SESSION_ID_HEADER)
            if session_id is not None and self.sessions.owned_by(session_id, digest):
                return principal, token
            logger.warning("mcp: database unavailable: %s", exc)
            await _jsonrpc_error(
                send,
                503,
                "unavailable: The database is unavailable. Try again shortly.",
                code=INTERNAL_ERROR,
                headers={"Retry-After": "5"},
            )
            return None
        if isinstance(authorized, Refused) and authorized.throttled_for is not None:
            await send_response(send, throttle.throttled(authorized.throttled_for))
            return None
        if isinstance(authorized, Refused):
            presented = keyword.lower() in {"bearer", "token"} and bool(token)
            await _unauthorized(send, refused=presented)
            return None
        # board.api.authentication.authenticate has cached the lookup.
        return principal, token


async def _jsonrpc_error(
    send: Any,
    status: int,
    message: str,
    *,
    code: int = INVALID_REQUEST,
    data: Any = None,
    headers: dict[str, str] | None = None,
) -> None:
    """Answer as the SDK answers a request it refuses: a JSON-RPC error without an id (its
    client passes the message on to the caller)."""
    error: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        error["data"] = data
    response = JsonResponse({"jsonrpc": "2.0", "id": None, "error": error}, status=status)
    for name, value in (headers or {}).items():
        response[name] = value
    await send_response(send, response)


async def _unauthorized(send: Any, *, refused: bool) -> None:
    """Answer 401 as a server that takes only Bearer tokens: RFC 6750's challenge, with
    ``error="invalid_token"`` when a token was sent and refused, and no
    ``resource_metadata`` (there is no OAuth here to discover), so that an MCP client
    reports the refusal instead of starting an OAuth flow; the body is a JSON-RPC error,
    which the SDK's client passes on to its caller as it is."""
    if refused:
        message = (
            "invalid token: the Bearer token was refused (unknown, revoked or replaced). "
            "Send 'Authorization: Bearer <token>' with the agent's API token (create_agent "
            "prints it); this server has no OAuth."
        )
        challenge = (
            'Bearer realm="taskboard", error="invalid_token", '
            'error_description="The access token is unknown, revoked or replaced"'
        )
    else:
        message = (
            "not authenticated: send 'Authorization: Bearer <token>' with the agent's API "
            "token (create_agent prints it); this server has no OAuth."
        )
        challenge = 'Bearer realm="taskboard"'
    await _jsonrpc_error(
        send,
        401,
        message,
        data={"error": "invalid_token" if refused else "not_authenticated"},
        headers={"WWW-Authenticate": challenge},
    )


def _capture_session(send: Any, sessions: Sessions, owner: str) -> Any:
    """Wrap ``send`` to track the session that an initialize request opens, from its
    answer's ``Mcp-Session-Id``, as the token ``owner``'s."""

    async def capture(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start" and message["status"] < 300:
            for name, value in message.get("headers", []):
                if name.decode("latin-1").lower() == MCP_SESSION_ID_HEADER:
                    sessions.opened(value.decode("latin-1"), owner)
        await send(message)

    return capture


# The MCPApplication of each event loop that serves (one per server; tests run several).
_running: dict[asyncio.AbstractEventLoop, MCPApplication] = {}


@contextlib.asynccontextmanager
async def serving(app: Any) -> AsyncIterator[None]:
    """Serve ``/mcp/`` on this event loop, with ``app`` (the HTTP application) as the API
    the tools call, while in this context (taskboard.asgi's lifespan)."""
    loop = asyncio.get_running_loop()
    mcp = MCPApplication(app)
    async with mcp.run():
        _running[loop] = mcp
        try:
            yield
        finally:
            del _running[loop]


async def private_application(scope: Scope, receive: Any, send: Any) -> None:
    """The ASGI application on this process's private socket (board.mcp.forwarding): the
    requests for its sessions that other processes of this server pass on, and nothing
    else."""
    if scope["type"] == "http" and scope["path"] == forwarding.TAKE_PATH:
        await _hand_over(scope, receive, send)
        return
    if scope["type"] != "http" or scope["path"] not in PATHS:
        await send_response(send, error_response(404, "not_found", "Only /mcp/ is served here."))
        return
    if (refused := check_host(scope)) is not None:
        await send_response(send, refused)
        return
    await application(forwarding.forwarded_scope(scope), receive, send)


async def _hand_over(scope: Scope, receive: Any, send: Any) -> None:
    """Another process of this server asks for a claim of one of this one's sessions, for
    a session of the same token there (Router.take): hand it over, or 404."""
    mcp = _running.get(asyncio.get_running_loop())
    body = await read_body(receive, 4096)
    try:
        asked = json.loads(body or b"")
        owner, task_id = str(asked["owner"]), int(asked["task_id"])
    except (ValueError, TypeError, KeyError):
        await send_response(send, error_response(400, "invalid", "Expected owner and task_id."))
        return
    task = await asyncio.to_thread(mcp.sessions.take_here, owner, task_id) if mcp else None
    if task is None:
        await send_response(send, error_response(404, "not_found", "No such claim here."))
        return
    await send_response(send, JsonResponse(forwarding.claim_to_json(task)))


async def application(scope: Scope, receive: Any, send: Any) -> None:
    """The ASGI endpoint for ``/mcp/``."""
    mcp = _running.get(asyncio.get_running_loop())
    if mcp is None:  # a server run without the lifespan protocol
        response = error_response(503, "unavailable", "MCP is not being served here.")
        await send_response(send, response)
        return
    await mcp(scope, receive, send)
