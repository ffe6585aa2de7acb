"""``/mcp/`` under ``taskboard serve --workers N``: each request for an MCP session reaches
the process that holds the session.

An MCP session lives in the memory of the process that opened it (board.mcp.endpoint: the
SDK's transport, and the heartbeats of the leases it holds), but the N processes of one
``serve`` share one listening port, so the kernel hands each new connection to any of
them, and a session's next request (a new connection, or Pushpin's) may reach another.

So, when ``serve`` runs several processes (it then names a private directory in
``TASKBOARD_SERVE_SOCKETS``):

- each process also serves ``/mcp/`` on a Unix socket of its own in that directory,
  ``<tag>.sock``, with a random ``tag`` per process (a process that uvicorn starts again
  after a crash has a new one);
- the session ids it hands out are the SDK's prefixed with that tag (``<tag>-<sdk id>``),
  and the prefix is stripped again on the way in, so the SDK sees only its own ids;
- a request naming another process's tag is passed to that process over its socket, as
  it came (the owner authenticates it, applies its limits and answers, streaming), with
  the client's address in a header that only this socket is trusted for;
- when that process is gone (no socket, or nothing listening on it: killed), the session
  is too: the answer is the SDK's ``404`` for an unknown session, after which the SDK's
  client opens a new session;
- a session that acts on a task its token claimed in a session of another process (a
  client that opens a new session for every call) asks the other processes, over their
  sockets, to hand the claim over (``TAKE_PATH``): the one that holds it stops renewing it
  and answers with it, lease token included, and the asking session renews it from then on.

This is hand-written because nothing routes MCP sessions between the processes of one
server: the SDK keeps sessions in process memory and has no store to share them, uvicorn
spreads connections at random, and a proxy in front (Pushpin included) cannot pick a
process behind one shared port. Without it, a session's request would reach the process
that holds the session with a chance of 1 in N: under ``serve --workers 2``, half of a
session's requests would be answered 404 and the session lost. The directory is made by
``serve`` with mode 0700, so only the server's own user can reach the sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
from collections.abc import AsyncIterator, MutableMapping
from dataclasses import fields
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from board.http.asgi_tools import closing, until_disconnect
from taskboard_agent.client import ClaimedTask, Task

logger = logging.getLogger(__name__)

# The client address of a forwarded request (JSON-free: "<host> <port>"), set by the
# process that forwards it; dropped from requests that come from the network.
CLIENT_HEADER = b"taskboard-forwarded-client"
# Where a forwarded request is marked in its ASGI scope (it is never forwarded again).
FORWARDED_KEY = "taskboard.forwarded"
SESSION_ID = re.compile(r"^(?P<tag>[0-9a-f]{16})-(?P<inner>[\x21-\x7e]+)$")
# Headers of one hop, which the forwarding connection sets for itself.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        CLIENT_HEADER,
    }
)
# Where a process asks another, over its socket, to hand over a claim of one of its MCP
# sessions (JSON {"owner": <token digest>, "task_id": n}): 200 with the claim, or 404.
TAKE_PATH = "/mcp/-/take"
# Seconds a process waits for each other one to answer it.
TAKE_TIMEOUT = 5.0
# Idle forwarding connections are let go well before the owner's server closes them
# (PRIVATE_KEEP_ALIVE), so that a request is never sent on a connection being closed.
KEEPALIVE_EXPIRY = 5.0
PRIVATE_KEEP_ALIVE = 30


class Gone(Exception):
    """The process that held a session is not there any more."""


class Router:
    """This process's side of the routing: its tag and socket, and forwarding."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.tag = secrets.token_hex(8)
        self._clients: dict[str, httpx.AsyncClient] = {}

    def path(self, tag: str) -> Path:
        return self.directory / f"{tag}.sock"

    def outbound(self, session_id: str) -> str:
        """The session id the client is given for the SDK's ``session_id``."""
        return f"{self.tag}-{session_id}"

    def inbound(self, value: str) -> tuple[str | None, str]:
        """(the tag of the process holding it, the SDK's id) for a session id a client
        sent; (None, value) for one that no process of this server handed out."""
        match = SESSION_ID.match(value)
        if match is None:
            return None, value
        return match["tag"], match["inner"]

    def renaming(self, send: Any, header: bytes) -> Any:
        """Wrap ``send`` so that the session ids in ``header`` of the answer carry this
        process's tag."""

        async def renamed(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = [
                    (name, self.outbound(value.decode("latin-1")).encode("latin-1"))
                    if name.lower() == header
                    else (name, value)
                    for name, value in message.get("headers", [])
                ]
            await send(message)

        return renamed

    @contextlib.asynccontextmanager
    async def listening(self, app: Any) -> AsyncIterator[None]:
        """Serve ``app`` (the private side of ``/mcp/``) on this process's socket while in
        this context."""
        config = uvicorn.Config(
            app,
            uds=str(self.path(self.tag)),
            lifespan="off",
            # The server process's logging is configured already: leave it alone.
            log_config=None,
            log_level=None,
            # The process that forwarded a request has logged it.
            access_log=False,
            proxy_headers=False,
            server_header=False,
            date_header=False,
            timeout_keep_alive=PRIVATE_KEEP_ALIVE,
            timeout_graceful_shutdown=2,
        )
        config.load()
        server = uvicorn.Server(config)
        # The two halves of uvicorn's Server.serve(), without the rest of it: serve() would
        # take over the signals of the process, which its main server handles.
        server.lifespan = config.lifespan_class(config)
        await server.startup()
        try:
            yield
        finally:
            await server.shutdown()
            await asyncio.gather(*(client.aclose() for client in self._clients.values()))
            self._clients.clear()
            with contextlib.suppress(FileNotFoundError):
                self.path(self.tag).unlink()

    def _client(self, tag: str) -> httpx.AsyncClient:
        client = self._clients.get(tag)
        if client is None:
            transport = httpx.AsyncHTTPTransport(
                uds=str(self.path(tag)),
                limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY),
            )
            # No read timeout: an MCP stream stays open as long as its client wants, and a
            # tool call may wait for work; the client's own timeouts apply as they would
            # to the owner directly.
            timeout = httpx.Timeout(None, connect=5.0)
            client = self._clients[tag] = httpx.AsyncClient(transport=transport, timeout=timeout)
        return client

    async def forward(
        self, tag: str, scope: MutableMapping[str, Any], receive: Any, send: Any
    ) -> None:
        """Pass the request to the process of ``tag`` and its answer back, streaming,
        until it ends, the client hangs up or this server stops. Raises :class:`Gone` when
        that process is not there (nothing has been answered then)."""
        client = self._client(tag)
        headers = [
            (name, value) for name, value in scope["headers"] if name.lower() not in HOP_BY_HOP
        ]
        if scope.get("client"):
            host, port = scope["client"][:2]
            headers.append((CLIENT_HEADER, f"{host} {port}".encode("latin-1")))
        has_body = any(
            name.lower() == b"transfer-encoding"
            or (name.lower() == b"content-length" and value.strip() != b"0")
            for name, value in scope["headers"]
        )
        query = scope.get("query_string", b"")
        url = f"http://taskboard{scope['path']}" + (f"?{query.decode('latin-1')}" if query else "")
        request = client.build_request(
            scope["method"], url, headers=headers, content=_body(receive) if has_body else None
        )
        try:
            response = await client.send(request, stream=True)
        except ConnectionAbortedError:
            return  # the client left while its body was being passed on: nobody to answer
        except httpx.ConnectError as exc:
            await self._forget(tag)
            raise Gone(tag) from exc
        except httpx.TransportError as exc:
            # The connection broke before an answer (the owner was killed mid-request): the
            # request may or may not have been served. A retry meets the owner, or the 404
            # of its absence.
            logger.warning("mcp: forwarding to process %s failed: %r", tag, exc)
            raise Interrupted(str(exc)) from exc
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": [
                        (name, value)
                        for name, value in response.headers.raw
                        if name.lower() not in HOP_BY_HOP
                    ],
                }
            )
            pump = asyncio.ensure_future(_pump(response, send))
            others = {
                asyncio.ensure_future(until_disconnect(receive)),
                asyncio.ensure_future(closing().wait()),
            }
            try:
                await asyncio.wait({pump, *others}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (pump, *others):
                    task.cancel()
                await asyncio.gather(pump, *others, return_exceptions=True)
            if not pump.done() or pump.cancelled() or pump.exception() is not None:
                # Ended early (the client left, the server stops, the owner died): end the
                # body here. An event stream's client reconnects.
                with contextlib.suppress(Exception):
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await response.aclose()

    async def take(self, owner: str, task_id: int) -> ClaimedTask | None:
        """The claim on ``task_id`` that a session of the token ``owner`` holds, or held
        and ended with, in another process of this server, handed over by it; or None."""
        for path in sorted(self.directory.glob("*.sock")):
            tag = path.stem
            if tag == self.tag:
                continue
            try:
                response = await self._client(tag).post(
                    f"http://taskboard{TAKE_PATH}",
                    json={"owner": owner, "task_id": task_id},
                    timeout=TAKE_TIMEOUT,
                )
            except httpx.TransportError:
                continue  # gone (its sessions with it), or not answering: not there
            if response.status_code == 200:
                return claim_from_json(response.json())
        return None

    async def _forget(self, tag: str) -> None:
        client = self._clients.pop(tag, None)
        if client is not None:
            await client.aclose()


class Interrupted(Exception):
    """The connection to the process holding a session broke before it answered."""


async def _body(receive: Any) -> AsyncIterator[bytes]:
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ConnectionAbortedError("the client left while sending its request")
        yield message.get("body", b"")
        if not message.get("more_body", False):
            return


async def _pump(response: httpx.Response, send: Any) -> None:
    async for chunk in response.aiter_raw():
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def claim_to_json(task: ClaimedTask) -> dict[str, Any]:
    """A claim as one process hands it to another (on one machine: ``claimed_at`` is on
    the monotonic clock that they share)."""
    return {"task": task.raw, "lease_seconds": task.lease_seconds, "claimed_at": task.claimed_at}


def claim_from_json(data: dict[str, Any]) -> ClaimedTask:
    task = Task.from_json(data["task"])
    return ClaimedTask(
        **{field.name: getattr(task, field.name) for field in fields(Task)},
        lease_token=data["task"]["lease_token"],
        lease_seconds=float(data["lease_seconds"]),
        claimed_at=float(data["claimed_at"]),
    )


def forwarded_scope(scope: MutableMapping[str, Any]) -> dict[str, Any]:
    """The scope of a request that came in over the private socket: with the client
    address the forwarding process saw, and marked as forwarded."""
    headers = [(name, value) for name, value in scope["headers"] if name.lower() != CLIENT_HEADER]
    given = [value for name, value in scope["headers"] if name.lower() == CLIENT_HEADER]
    client = None
    # Router.forward sends one, having dropped any that came from the network; if there
    # are several, that went wrong: trust none.
    if len(given) == 1:
        host, _, port = given[0].decode("latin-1").rpartition(" ")
        with contextlib.suppress(ValueError):
            client = (host, int(port))
    forwarded = dict(scope, headers=headers, client=client)
    forwarded[FORWARDED_KEY] = True
    return forwarded
