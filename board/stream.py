"""GET /api/v1/stream/: every event as server-sent events, resumable with Last-Event-ID.

This is a plain ASGI endpoint (taskboard/asgi.py routes the path here, in front of
Django's handler) so that an open stream costs neither a thread nor a database
connection: Django's handler keeps a worker thread for each request until its response
ends, which for a stream is never. Authentication (a token, or the session cookie) is one
short query in a shared worker thread, whose connection is closed straight after.

The stream subscribes to this process's relay (board.relay) and writes what it hands
over. A client that sends the id of the last event it received (``Last-Event-ID``, which
EventSource sends by itself on reconnect, or ``?lastEventId=``) is first replayed what it
missed, from the relay's memory or from ``task_events``, then continues live: in order,
none twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator
from http.cookies import SimpleCookie
from importlib import import_module
from typing import Any
from urllib.parse import parse_qs

import psycopg
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import DatabaseError, connection

from board.asgi_tools import Receive, Scope, Send, send_response, until_disconnect
from board.middleware import database_unavailable, error_response
from board.relay import Cursor, Relay, get_relay

logger = logging.getLogger(__name__)

PATH = "/api/v1/stream/"
KEEPALIVE_SECONDS = 15.0
RETRY_MILLISECONDS = 1000


def authenticate(headers: dict[str, str]) -> Any:
    """Return the active user named by a Bearer/Token header or the session cookie, or None.

    Runs in a worker thread and closes that thread's database connection before returning.
    """
    from django.contrib.auth import get_user
    from django.http import HttpRequest
    from rest_framework.authtoken.models import Token

    try:
        keyword, _, key = headers.get("authorization", "").partition(" ")
        if keyword.lower() in {"bearer", "token"}:
            token = Token.objects.select_related("user").filter(key=key.strip()).first()
            return token.user if token and token.user.is_active else None
        cookies = SimpleCookie(headers.get("cookie", ""))
        morsel = cookies.get(settings.SESSION_COOKIE_NAME)
        if morsel is None:
            return None
        request = HttpRequest()
        request.session = import_module(settings.SESSION_ENGINE).SessionStore(morsel.value)
        user = get_user(request)
        return user if user.is_authenticated else None
    finally:
        connection.close()


def resume_ids(scope: Scope) -> list[str]:
    """Every ``lastEventId`` of the query string (the schema allows one)."""
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
    return query.get("lastEventId", [])


def resume_id(scope: Scope, headers: dict[str, str]) -> int | None:
    value = (headers.get("last-event-id") or (resume_ids(scope) or [""])[-1]).strip()
    # ASCII digits only: str.isdigit() also takes "²", which int() refuses (a 500).
    if RESUME_ID.fullmatch(value):
        return int(value)
    return None


RESUME_ID = re.compile(r"[0-9]{1,18}")


async def unavailable(send: Send) -> None:
    await send_response(send, database_unavailable())


async def application(scope: Scope, receive: Receive, send: Send) -> None:
    """The ASGI endpoint for GET /api/v1/stream/."""
    if scope["method"] not in {"GET", "HEAD"}:
        response = error_response(405, "method_not_allowed", "Use GET.")
        response["Allow"] = "GET"
        await send_response(send, response)
        return
    headers = {
        name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]
    }
    try:
        user = await sync_to_async(authenticate, thread_sensitive=False)(headers)
    except DatabaseError as exc:
        logger.warning("stream: database unavailable: %s", exc)
        await unavailable(send)
        return
    if user is None:
        response = error_response(
            401, "not_authenticated", "Log in, or send 'Authorization: Bearer <token>'."
        )
        response["WWW-Authenticate"] = 'Bearer realm="taskboard"'
        await send_response(send, response)
        return
    if len(resume_ids(scope)) > 1:
        fields = {"lastEventId": ["Give this parameter once."]}
        detail = "Invalid request: lastEventId: Give this parameter once."
        await send_response(send, error_response(400, "invalid", detail, fields=fields))
        return
    try:
        relay = await get_relay()
        event_id = resume_id(scope, headers)
        after = await relay.cursor_of(event_id) if event_id is not None else None
    except (TimeoutError, OSError, psycopg.Error) as exc:
        logger.warning("stream: database unavailable: %s", exc)
        await unavailable(send)
        return

    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache, no-transform"),
                (b"x-accel-buffering", b"no"),  # nginx: do not buffer the stream
            ],
        }
    )
    if scope["method"] == "HEAD":
        await send({"type": "http.response.body", "body": b""})
        return

    async def write() -> None:
        async for chunk in events(relay, after):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    writer = asyncio.create_task(write())
    listener = asyncio.create_task(until_disconnect(receive))
    try:
        await asyncio.wait({writer, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (writer, listener):
            task.cancel()
        for task in (writer, listener):
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await task


async def events(relay: Relay, after: Cursor | None) -> AsyncIterator[bytes]:
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
            live = [event for event in queued if event is not None]
            chunk = b"".join(event.sse for event in live if event.cursor > last)
            if live:
                last = live[-1].cursor
            if chunk:
                yield chunk
            if len(live) < len(queued):
                return  # the relay stopped (server shutdown): the client will reconnect
    finally:
        relay.unsubscribe(subscriber)
