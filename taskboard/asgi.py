"""The ASGI application that ``manage.py serve`` runs under uvicorn.

Django serves the pages and the API as a WSGI application on a fixed pool of worker
threads (a2wsgi), so that each thread keeps its database connection across requests
(CONN_MAX_AGE) and a process never holds more connections than it has threads (and,
for a moment, the one that each GET /healthz check makes: board.ops.health). Django's
own ASGI handler would run every request on a new thread, with a new connection. In front:

- ``/api/v1/stream/`` goes to board.live.stream, a plain ASGI endpoint, so that an open stream
  holds no worker thread and no database connection;
- ``POST /api/v1/tasks/claim/`` with ``wait`` goes through board.live.waiting, which waits for
  work between claim attempts outside Django, for the same reason;
- RequestBodyLimit reads every body before the request takes a thread, refusing one over
  1 MiB (413) or slower than TASKBOARD_BODY_TIMEOUT (408), and gives chunked bodies a length;
- ``/mcp/`` goes to board.mcp.endpoint, the MCP tools over Streamable HTTP, which call this
  application in process;
- the lifespan starts the process's sender of webhooks and emails
  (board.notifications.deliveries), and behind Pushpin (GRIP_URL) its candidate publisher
  of events (board.live.grip);
- on SIGTERM or SIGINT, open streams, waiting claims and MCP sessions end at once
  (taskboard.server); the lifespan protocol then stops the sender and the event relay.

Every HTTP request's Host is checked here, once (board.http.middleware.check_host), and
Django's request takes it as checked.

Why by hand, measured: Django's own ASGI handler costs 1.48x the server's CPU per API
request of this a2wsgi pool (10.91 ms against 7.38 ms, medians of three runs of 1,200
requests: benchmarks/measurements/handler_cpu.py), since it makes a thread and borrows a
pooled connection per request; and it keeps a thread per open stream (1,000 streams: 1,009
threads against 8, benchmarks/measurements/stream_threads.py). What runs here in front of
Django costs little beside an API request: the Host check about 12 µs of CPU, the body
limit about 9 µs (benchmarks/measurements/front_cpu.py, 20,000 requests in process).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from typing import Any

import django
from a2wsgi import WSGIMiddleware
from django.core.handlers.wsgi import WSGIHandler
from django.db import connections
from django.http import HttpRequest, HttpResponseBase

from board import conf

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "taskboard.settings")
logger = logging.getLogger(__name__)


class ReleasingHandler(WSGIHandler):
    """Django's WSGI handler, which frees each request's objects when its response has
    been sent and closed.

    Django and DRF tie a request's objects together in reference cycles: the view and its
    bound handlers (``self.get = self.retrieve``), the view and DRF's request through its
    ``parser_context``, the response and its ``renderer_context`` (which holds the view, the
    request and the response itself), the request and ``request.auser`` and its message
    storages. Reference counting never frees them; only the collector's full collections
    do, and those are rare (taskboard.server.tune_garbage_collector). Each answer that
    carries a task of 0.93 MB thus kept its data and its rendered body, about 2 MB, until
    then: 300 such GETs and 150 heartbeats took a server process from 166 to 378 MiB;
    freed here, from 148 to 149 MiB (tests/test_memory.py). Once the response is
    closed (Django's request_finished has been sent) nothing reads these objects again,
    so emptying them breaks the cycles and each request's objects go when it ends.

    Here, not in the response's ``close()``: Django's test client closes the response
    before a test reads ``response.wsgi_request`` and ``response.data``.
    """

    def __init__(self) -> None:
        super().__init__()
        self._current = threading.local()

    def get_response(self, request: HttpRequest) -> HttpResponseBase:
        self._current.request = request  # for __call__, on the same thread
        return super().get_response(request)

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        try:
            response = super().__call__(environ, start_response)
            request = self._current.request
        finally:
            self._current.__dict__.clear()
        return Releasing(response, request)


class Releasing:
    """A WSGI response that, once closed, breaks the cycles among its request's objects."""

    def __init__(self, response: Any, request: HttpRequest) -> None:
        self.response = response
        self.request = request

    def __iter__(self) -> Any:
        return iter(self.response)

    def close(self) -> None:
        response, request = self.response, self.request
        del self.response, self.request
        try:
            if hasattr(response, "close"):
                response.close()
        finally:
            context = getattr(response, "renderer_context", None) or {}
            # The view and DRF's request, then Django's: each only ever served this one.
            for used in (context.get("view"), context.get("request"), request):
                if used is not None:
                    vars(used).clear()
            if context:
                response.renderer_context = None


django.setup(set_prefix=False)

from board.http.asgi_tools import closing, send_response  # noqa: E402
from board.http.middleware import CheckedHostRequest, RequestBodyLimit, check_host  # noqa: E402
from board.live import grip, stream, waiting  # noqa: E402
from board.live.relay import stop_relays  # noqa: E402
from board.mcp import endpoint as mcp_endpoint  # noqa: E402
from board.notifications import deliveries  # noqa: E402  (needs Django set up)
from taskboard.server import on_exit_signal, tune_garbage_collector  # noqa: E402

ReleasingHandler.request_class = CheckedHostRequest  # the Host is checked in front, once
django_application = WSGIMiddleware(
    ReleasingHandler(),  # type: ignore[arg-type]
    workers=conf.threads(),
)
http_application = RequestBodyLimit(waiting.WaitingClaims(django_application))  # type: ignore[arg-type]


async def application(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        await lifespan(receive, send)
        return
    if scope["type"] == "http" and (refused := check_host(scope)) is not None:
        # Once per request, for everything behind (Django takes the host as checked).
        await send_response(send, refused)
    elif scope["type"] == "http" and (
        scope["path"] == stream.PATH or scope["path"].startswith(stream.NEXT_PATH)
    ):
        await stream.application(scope, receive, send)
    elif scope["type"] == "http" and scope["path"] in mcp_endpoint.PATHS:
        await mcp_endpoint.application(scope, receive, send)
    else:
        await http_application(scope, receive, send)


async def lifespan(receive: Any, send: Any) -> None:
    mcp: asyncio.Task[None] | None = None
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            # Streams, waiting claims and MCP sessions end as soon as the server is told
            # to stop: the lifespan shutdown comes only after uvicorn has waited for them.
            on_exit_signal(closing().set)
            started = asyncio.Event()
            mcp = asyncio.create_task(serve_mcp(started))
            waiting_start = asyncio.create_task(started.wait())
            await asyncio.wait({mcp, waiting_start}, return_when=asyncio.FIRST_COMPLETED)
            waiting_start.cancel()
            if mcp.done():
                mcp.result()  # it could not start: raise why
            # Webhooks and escalation emails, sent from this process
            # (board.notifications.deliveries).
            await deliveries.start_dispatcher()
            # Behind Pushpin, the events are published to it from one process (board.live.grip).
            grip.start_publisher()
            tune_garbage_collector()  # (taskboard.server)
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            closing().set()
            if mcp is not None:
                try:
                    await mcp
                except Exception:
                    logger.exception("serving /mcp/ failed")
            await deliveries.stop_dispatcher()
            await grip.stop_publisher()
            await stream.close_database_thread_connection()
            await stop_relays()
            await close_worker_connections()
            await send({"type": "lifespan.shutdown.complete"})
            return


async def serve_mcp(started: asyncio.Event) -> None:
    """Serve ``/mcp/`` until the server begins to stop; then end its sessions."""
    async with mcp_endpoint.serving(http_application):
        started.set()
        await closing().wait()


async def close_worker_connections() -> None:
    """Close the database connection that each worker thread keeps between requests."""
    workers = conf.threads()
    barrier = threading.Barrier(workers)

    def close() -> None:
        # Every job waits for the others, so each of the pool's threads runs exactly one.
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait(timeout=5)
        connections.close_all()

    loop = asyncio.get_running_loop()
    executor = django_application.executor
    await asyncio.gather(*(loop.run_in_executor(executor, close) for _ in range(workers)))
