"""The few ASGI pieces shared by what runs in front of Django (board.http.middleware's body
limit, board.live.stream, board.live.waiting): reading and replaying a request body, sending a
Django response, noticing a client that hung up, and noticing a server shutting down."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from django.http import HttpResponse

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


async def read_body(receive: Receive, limit: int) -> bytes | None:
    """Read the whole request body; None if it grows past ``limit`` or the client left."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > limit:
            return None
        if not message.get("more_body", False):
            return b"".join(chunks)


def replaying(body: bytes, receive: Receive) -> Receive:
    """Return a receive() that hands over ``body`` first, then defers to ``receive``."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def send_response(send: Send, response: HttpResponse) -> None:
    """Send a (non-streaming) Django response over ASGI."""
    await send(
        {
            "type": "http.response.start",
            "status": response.status_code,
            "headers": [
                *((k.lower().encode(), v.encode()) for k, v in response.items()),
                (b"content-length", str(len(response.content)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": response.content})


async def until_disconnect(receive: Receive) -> None:
    """Return when the client hangs up."""
    while (await receive())["type"] != "http.disconnect":
        pass


_closing: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Event] = (
    weakref.WeakKeyDictionary()
)


def closing() -> asyncio.Event:
    """Return the event that is set when this server begins to shut down (taskboard.asgi).

    Open streams and waiting claims end as soon as it is set, instead of holding up the
    shutdown: both are resumed by their clients.
    """
    loop = asyncio.get_running_loop()
    event = _closing.get(loop)
    if event is None:
        event = _closing[loop] = asyncio.Event()
    return event
