"""GET /api/v1/stream/: every event as server-sent events, resumable with Last-Event-ID.

The view is async and holds no database connection while the stream is open: it
authenticates (one short query, then the connection is closed), subscribes to this
process's relay (board.relay) and writes what the relay hands it. A client that sends the
id of the last event it received (the ``Last-Event-ID`` header, which EventSource sends by
itself on reconnect, or ``?lastEventId=``) is first replayed what it missed, from the
relay's memory or from ``task_events``, then continues live: in order, none twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import psycopg
from asgiref.sync import sync_to_async
from django.db import connection
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.views.decorators.http import require_GET
from rest_framework import exceptions
from rest_framework.authentication import get_authorization_header

from board.api.authentication import BearerTokenAuthentication
from board.middleware import database_unavailable, error_response, is_database_outage
from board.relay import Cursor, Relay, get_relay

logger = logging.getLogger(__name__)

KEEPALIVE_SECONDS = 15.0
RETRY_MILLISECONDS = 1000


def _authenticate(request: HttpRequest) -> Any:
    """Return the user from a Bearer/Token header or the session, or None.

    Runs in the request's worker thread; closes that thread's database connection before
    returning, so an open stream holds none.
    """
    try:
        header = get_authorization_header(request).split()
        if header and header[0].lower() in {b"bearer", b"token"}:
            result = BearerTokenAuthentication().authenticate(request)  # type: ignore[arg-type]
            return result[0] if result else None
        user = request.user
        return user if user.is_authenticated else None
    except exceptions.AuthenticationFailed:
        return None
    finally:
        connection.close()


def _resume_id(request: HttpRequest) -> int | None:
    value = request.headers.get("Last-Event-ID") or request.GET.get("lastEventId") or ""
    value = value.strip()
    if value.isdigit() and len(value) <= 18:
        return int(value)
    return None


@require_GET
async def stream(request: HttpRequest) -> HttpResponse:
    try:
        user = await sync_to_async(_authenticate)(request)
    except Exception as exc:
        if is_database_outage(exc):
            return database_unavailable()
        raise
    if user is None:
        response = error_response(
            401, "not_authenticated", "Log in, or send 'Authorization: Bearer <token>'."
        )
        response["WWW-Authenticate"] = 'Bearer realm="taskboard"'
        return response
    request.user = user

    try:
        relay = await get_relay()
        resume_id = _resume_id(request)
        after = await relay.cursor_of(resume_id) if resume_id is not None else None
    except (TimeoutError, OSError, psycopg.Error) as exc:
        logger.warning("stream: database unavailable: %s", exc)
        return database_unavailable()

    response = StreamingHttpResponse(
        _events(relay, after), content_type="text/event-stream; charset=utf-8"
    )
    response["Cache-Control"] = "no-cache, no-transform"
    response["X-Accel-Buffering"] = "no"  # nginx: do not buffer the stream
    return response


async def _events(relay: Relay, after: Cursor | None) -> AsyncIterator[bytes]:
    """Yield the SSE byte stream: a replay after ``after`` (if given), then live events."""
    subscriber = relay.subscribe()
    try:
        yield f"retry: {RETRY_MILLISECONDS}\n: connected\n\n".encode()
        last = subscriber.start
        if after is not None and after < subscriber.start:
            async for page in relay.replay(after, subscriber.start):
                yield b"".join(event.sse for event in page)
        while True:
            if subscriber.lagging:
                # This client fell behind and its queue was dropped: replay from memory.
                upto = relay.resume(subscriber)
                async for page in relay.replay(last, upto):
                    yield b"".join(event.sse for event in page)
                last = upto
            try:
                first = await asyncio.wait_for(subscriber.queue.get(), KEEPALIVE_SECONDS)
            except TimeoutError:
                yield b": keep-alive\n\n"
                continue
            queued = [first, *subscriber.drain()]
            events = [event for event in queued if event is not None]
            chunk = b"".join(event.sse for event in events if event.cursor > last)
            if events:
                last = events[-1].cursor
            if chunk:
                yield chunk
            if len(events) < len(queued):
                return  # the relay stopped (server shutdown): the client will reconnect
    finally:
        relay.unsubscribe(subscriber)
