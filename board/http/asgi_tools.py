"""The few ASGI pieces shared by what runs in front of Django (board.http.middleware's body
limit, board.live.stream, board.live.waiting): reading and replaying a request body, a JSON
body parsed once for Django too, sending a Django response, noticing a client that hung up,
and noticing a server shutting down.

Hand-written rather than taken from Starlette or asgiref: the endpoints in front of Django
need these five things and nothing else of a framework (about 100 lines).
"""

from __future__ import annotations

import asyncio
import json
import weakref
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from django.http import HttpResponse
from rest_framework.utils.json import strict_constant

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


# Where a body parsed in front of Django is handed to it, in the request's ASGI scope (a2wsgi
# hands the scope to Django as ``environ["asgi.scope"]``).
JSON_BODY_KEY = "taskboard.json_body"


@dataclass(frozen=True)
class JSONBody:
    """A request body parsed as JSON in front of Django, and the text encoding it was
    decoded with: the API's parser (board.api.parsers) takes it instead of parsing the
    body again, when it would decode it the same way."""

    encoding: str
    data: Any


def parse_json(body: bytes, encoding: str) -> Any:
    """Parse ``body`` as the API's parser does (DRF's, strict: no NaN or Infinity); raise
    ValueError (UnicodeDecodeError included) for what it would refuse."""
    return json.loads(body.decode(encoding), parse_constant=strict_constant)


def json_body(meta: Mapping[str, Any], encoding: str) -> JSONBody | None:
    """The body parsed in front of Django for the request whose WSGI environ is ``meta``,
    if it was decoded with ``encoding``; else None."""
    scope = meta.get("asgi.scope") or {}
    parsed = scope.get(JSON_BODY_KEY)
    if isinstance(parsed, JSONBody) and parsed.encoding == encoding:
        return parsed
    return None


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
