"""GET /api/v1/stream/: every event as server-sent events, resumable with Last-Event-ID.

This is a plain ASGI endpoint (taskboard/asgi.py routes the path here, in front of
Django's handler) so that an open stream costs neither a thread nor a database
connection: Django's handler keeps a worker thread for each request until its response
ends, which for a stream is never. Measured with 1,000 open streams on one server process
(benchmarks/measurements/stream_threads.py): the smallest streaming async view under
Django's ASGI handler took the process from 5 to 1,009 threads and +87 MB, this endpoint
from 7 to 8 threads and +20 MB. Authentication (board.api.authentication.authenticate: a
token, or the session cookie) is at most one short query on the stream's database thread.

The stream subscribes to this process's relay (board.live.relay) and writes what it hands
over. A client that sends the id of the last event it received (``Last-Event-ID``, which
EventSource sends by itself on reconnect, or ``?lastEventId=``) is first replayed what it
missed, from the relay's memory or from ``task_events``, then continues live: in order,
none twice. An agent limited to queues (board.access) is sent only its own queues' events,
live and replayed.

Behind Pushpin (``GRIP_URL``), a request that Pushpin signed is answered at once instead,
with the replay and GRIP instructions to hold the stream in Pushpin (:func:`hold`, and
board.live.grip for the channels and the publishing): no server process keeps it open then.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import time
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.cookies import SimpleCookie
from typing import Any, TypeVar
from urllib.parse import parse_qs

import psycopg
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import DatabaseError, connection
from django.http import HttpResponse
from django.http.cookie import parse_cookie

from access import throttle
from board import conf
from board.access import EVERY_QUEUE, QueueAccess, queue_access
from board.api import authentication
from board.api.authentication import Authenticated, Refused
from board.http.asgi_tools import Receive, Scope, Send, closing, send_response, until_disconnect
from board.http.middleware import database_unavailable, error_response, is_database_outage
from board.live import grip
from board.live.relay import (
    Cursor,
    Relay,
    StreamEvent,
    get_relay,
    head_below_horizon,
    run_on_django,
)
from board.models import QueueLimit

logger = logging.getLogger(__name__)
T = TypeVar("T")

PATH = "/api/v1/stream/"
# Where Pushpin asks a held stream's next link (board.live.grip): only Pushpin's requests.
NEXT_PATH = PATH + "next/"
KEEPALIVE_SECONDS = 15.0
RETRY_MILLISECONDS = 1000
STREAM_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache, no-transform"),
    (b"x-accel-buffering", b"no"),  # nginx: do not buffer the stream
]


def authorize(headers: dict[str, str], address: str = "") -> tuple[Any, QueueAccess] | Refused:
    """The active user named by a Bearer/Token header or the session cookie, and the
    queues it may see; or why not (board.api.authentication.authenticate, with the
    failed-authentication throttle applied to ``address``). Runs on the stream's database
    thread (:func:`on_database_thread`).
    """
    session_key = parse_cookie(headers.get("cookie", "")).get(settings.SESSION_COOKIE_NAME, "")
    result = authentication.authenticate(
        headers.get("authorization", ""), session_key, address=address
    )
    if isinstance(result, Refused):
        return result
    return result.user, queue_access(result.user)


def committed_head() -> Cursor:
    """The cursor of the last event committed now (relay.head_below_horizon): where a
    stream that names no event starts, even if this process's relay has not read the
    newest commits yet (a client that made an event and then opens a stream must not be
    sent it). Runs on the stream's database thread."""
    _, head = run_on_django(head_below_horizon())
    return head


# A stream's credentials, as it is re-checked: ("token", the token's digest) or
# ("session", the session key). No plain token is kept.
Credentials = tuple[str, str]


@dataclass(eq=False)
class OpenStream:
    """A stream's credentials and what they allow now: re-checked while it is open, so a
    rotated or deleted token, a deactivated user or a changed queue limit reaches open
    streams as it reaches the API, within TASKBOARD_TOKEN_CACHE_SECONDS."""

    credentials: Credentials
    access: QueueAccess
    revoked: asyncio.Event = field(default_factory=asyncio.Event)

    def allows(self, queue: str) -> bool:
        return self.access.allows(queue)


def credentials_of(headers: dict[str, str]) -> Credentials:
    from access import tokens

    keyword, _, key = headers.get("authorization", "").partition(" ")
    if keyword.lower() in {"bearer", "token"}:
        return "token", tokens.digest(key.strip())
    morsel = SimpleCookie(headers.get("cookie", "")).get(settings.SESSION_COOKIE_NAME)
    return "session", morsel.value if morsel else ""


def reauthorize(
    credentials: set[Credentials], *, close: bool = True
) -> dict[Credentials, QueueAccess]:
    """Return what each of ``credentials`` allows now; those no longer valid are absent.

    Tokens are looked up together (one query, and one for their users' queue limits);
    each session on its own. Runs in a worker thread, on one connection closed before
    returning. Nothing here counts as a failed authentication: these credentials were
    valid.
    """
    from access.models import ApiToken

    allowed: dict[Credentials, QueueAccess] = {}
    try:
        digests = [key for kind, key in credentials if kind == "token"]
        found = ApiToken.objects.filter(digest__in=digests, user__is_active=True)
        users = dict(found.values_list("digest", "user_id"))
        limits = dict(
            QueueLimit.objects.filter(user_id__in=users.values()).values_list("user_id", "queues")
        )
        for digest, user_id in users.items():
            queues = limits.get(user_id)
            allowed["token", digest] = (
                EVERY_QUEUE if queues is None else QueueAccess(frozenset(queues))
            )
        for kind, key in credentials:
            if kind == "session" and key:
                result = authentication.authenticate("", key)
                if isinstance(result, Authenticated):
                    allowed[kind, key] = queue_access(result.user)
    finally:
        if close:
            connection.close()
    return allowed


# The open streams of each event loop (server process), and the task that re-checks them.
_open_streams: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, set[OpenStream]] = (
    weakref.WeakKeyDictionary()
)
_rechecking: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Task[None]] = (
    weakref.WeakKeyDictionary()
)


def open_stream_count() -> int:
    """Return how many streams this process has open (for /metrics, board.ops.metrics)."""
    return sum(len(streams) for streams in list(_open_streams.values()))


def recheck_seconds() -> float:
    return max(1.0, float(conf.token_cache_seconds()))


def open_stream(credentials: Credentials, access: QueueAccess) -> OpenStream:
    """Register a stream for re-checking; the caller unregisters it with close_stream()."""
    loop = asyncio.get_running_loop()
    stream = OpenStream(credentials, access)
    _open_streams.setdefault(loop, set()).add(stream)
    task = _rechecking.get(loop)
    if task is None or task.done():
        _rechecking[loop] = loop.create_task(_recheck_open_streams(), name="stream-recheck")
    return stream


def close_stream(stream: OpenStream) -> None:
    loop = asyncio.get_running_loop()
    streams = _open_streams.get(loop, set())
    streams.discard(stream)
    if not streams and (task := _rechecking.pop(loop, None)) is not None:
        task.cancel()  # nothing left to re-check; the next stream starts it again


# Set when credentials changed (board.live.revocation): the open streams are re-checked now.
_recheck_wanted: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Event] = (
    weakref.WeakKeyDictionary()
)


def recheck_now() -> None:
    """Credentials changed (board.live.revocation): re-check this process's open streams now,
    and look held streams' credentials up again when Pushpin next asks."""
    _rechecked.clear()
    with contextlib.suppress(RuntimeError):  # no event loop: no open stream either
        loop = asyncio.get_running_loop()
        if _open_streams.get(loop):
            _recheck_wanted.setdefault(loop, asyncio.Event()).set()


async def _recheck_open_streams() -> None:
    """Every recheck_seconds(), or at once when credentials changed (recheck_now), look up
    the credentials of this process's open streams together (each distinct token or
    session once): revoked ones end their streams, which the client then reopens and gets
    401; the rest take up their current queue limit."""
    loop = asyncio.get_running_loop()
    streams = _open_streams[loop]
    wanted = _recheck_wanted.setdefault(loop, asyncio.Event())
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wanted.wait(), recheck_seconds())
        wanted.clear()
        batch = list(streams)
        try:
            allowed = await sync_to_async(reauthorize, thread_sensitive=False)(
                {stream.credentials for stream in batch}
            )
        except Exception as exc:
            # A database outage, or a bug: keep the streams, and try again next time.
            if is_database_outage(exc):
                logger.warning(
                    "stream: could not re-check the credentials of open streams: %s", exc
                )
            else:
                logger.exception("stream: could not re-check the credentials of open streams")
            continue
        for stream in batch:
            access = allowed.get(stream.credentials)
            if access is None:
                stream.revoked.set()
            else:
                stream.access = access


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
    """The ASGI endpoint for GET /api/v1/stream/ (its Host checked in front: taskboard.asgi)."""
    if scope["method"] not in {"GET", "HEAD"}:
        response = error_response(405, "method_not_allowed", "Use GET.")
        response["Allow"] = "GET"
        await send_response(send, response)
        return
    headers = {
        name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]
    }
    # Pushpin's request (its signature checked once: a burst of streams opening pays it).
    proxied = grip.proxied(headers)
    if scope["path"] != PATH:
        # A next link (NEXT_PATH): asked by Pushpin only, signed.
        if proxied and scope["method"] == "GET" and next_link_query(scope):
            await next_link(scope, headers, send)
        else:
            await send_response(send, error_response(404, "not_found", "Not found."))
        return
    if proxied and parse_qs(scope.get("query_string", b"").decode("latin-1")).get("link") == [
        "next"
    ]:
        # A next link with its credentials in the query (which Pushpin leaves out when it
        # shares a request among streams), as a stream held across an upgrade may still
        # ask: end the stream, whose client resumes with Last-Event-ID and is held again
        # with a link whose credentials are sealed in it (not a 401, counted against
        # Pushpin's address by the failed-authentication throttle).
        await send_response(send, HttpResponse(status=204))
        return
    client = scope.get("client")
    address = str(client[0]) if client else ""
    generation = authentication.generation()
    try:
        authorized = await on_database_thread(authorize, headers, address)
    except DatabaseError as exc:
        logger.warning("stream: database unavailable: %s", exc)
        await unavailable(send)
        return
    if isinstance(authorized, Refused) and authorized.throttled_for is not None:
        await send_response(send, throttle.throttled(authorized.throttled_for))
        return
    if isinstance(authorized, Refused):
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
    user, access = authorized
    # Behind Pushpin, answer at once and let Pushpin hold the stream (board.live.grip).
    held = scope["method"] == "GET" and proxied
    try:
        relay = await get_relay()
        await relay.current()
        event_id = resume_id(scope, headers)
        after = await relay.cursor_of(event_id) if event_id is not None else None
        if event_id is None:
            # A new stream starts after what is committed now, wherever this process's
            # relay has got to.
            head = await on_database_thread(committed_head)
            after = head if relay.head is None or head > relay.head else None
        if held:
            await hold(
                send,
                relay,
                after,
                credentials_of(headers),
                user.pk,
                access,
                preamble=True,
                generation=generation,
            )
            return
    except (DatabaseError, TimeoutError, OSError, psycopg.Error) as exc:
        logger.warning("stream: database unavailable: %s", exc)
        await unavailable(send)
        return

    await send({"type": "http.response.start", "status": 200, "headers": STREAM_HEADERS})
    if scope["method"] == "HEAD":
        await send({"type": "http.response.body", "body": b""})
        return

    stream = open_stream(credentials_of(headers), access)

    async def write() -> None:
        async for chunk in events(relay, after, stream):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    writer = asyncio.create_task(write())
    listener = asyncio.create_task(until_disconnect(receive))
    shutdown = asyncio.create_task(closing().wait())
    revoked = asyncio.create_task(stream.revoked.wait())
    outcomes: Sequence[object] = ()
    try:
        done, _ = await asyncio.wait(
            {writer, listener, shutdown, revoked}, return_when=asyncio.FIRST_COMPLETED
        )
        # The server is shutting down, or the credentials were revoked, while the stream
        # is open (and the client still there).
        ending = not done & {writer, listener}
    finally:
        close_stream(stream)
        for task in (writer, listener, shutdown, revoked):
            task.cancel()
        outcomes = await asyncio.gather(writer, listener, shutdown, revoked, return_exceptions=True)
    failure = outcomes[0]
    if isinstance(failure, DatabaseError | TimeoutError | psycopg.Error):
        # A replay the database could not answer (in time): end the response as below,
        # and the client resumes after its last event.
        logger.warning("stream: ended, the database failed: %s", failure)
        ending = True
    elif isinstance(failure, Exception) and not isinstance(failure, OSError):
        raise failure  # a defect: as any view's, for the server's log
    if ending:
        # End the response: the client reconnects (to another server, or to this one
        # restarted) after RETRY_MILLISECONDS, and resumes after its last event; with
        # revoked credentials, it is refused then.
        with contextlib.suppress(OSError):
            await send({"type": "http.response.body", "body": b""})


def next_link_query(scope: Scope) -> dict[str, str] | None:
    """The parameters of a request of a held stream's ``next`` link (board.live.grip), its
    sealed credentials as ``auth`` (from the path, NEXT_PATH + sealed + "/"), or None for
    any other request."""
    path = scope["path"]
    if not (path.startswith(NEXT_PATH) and path.endswith("/")):
        return None
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    return {
        **{name: values[-1] for name, values in query.items()},
        "auth": path[len(NEXT_PATH) : -1],
    }


# What the stream asks the database (authentication, where a new stream starts, and the
# re-checks of held streams' credentials, board.live.grip) runs on one thread, on a connection
# kept open between calls: opening one per stream would cost more than the query, and a
# burst of a thousand streams opening (or of Pushpin's next links) would open as many.
# With the token cache, most calls make no query at all.
_database_thread = ThreadPoolExecutor(1, thread_name_prefix="taskboard-stream-db")


async def on_database_thread(function: Callable[..., T], *args: Any) -> T:
    """Run ``function(*args)`` on the stream's database thread."""
    return await asyncio.get_running_loop().run_in_executor(
        _database_thread, functools.partial(_with_connection, function, *args)
    )


def _with_connection(function: Callable[..., T], *args: Any) -> T:
    connection.close_if_unusable_or_obsolete()
    try:
        return function(*args)
    except DatabaseError:
        connection.close()  # broken, or the server restarted: the next call reconnects
        raise


async def close_database_thread_connection() -> None:
    """Close the connection the stream's database thread keeps (ASGI lifespan shutdown)."""
    await asyncio.get_running_loop().run_in_executor(_database_thread, _close_connection)


def _close_connection() -> None:
    connection.close()  # this thread's (``connection`` is looked up in the calling thread)


# What each held stream's credentials allowed when last checked, for
# TASKBOARD_TOKEN_CACHE_SECONDS, as the API caches a token's lookup: a burst of next-link
# requests (every stream, a second after it was held or after a publisher change) costs
# one lookup per agent, not one per stream. Read and written on the stream's database
# thread; emptied from the event loop when credentials change (recheck_now).
_rechecked: dict[Credentials, tuple[float, QueueAccess | None]] = {}


def _still_allowed(credentials: Credentials) -> QueueAccess | None:
    now = time.monotonic()
    checked = _rechecked.get(credentials)
    if checked is not None and now - checked[0] < conf.token_cache_seconds():
        return checked[1]
    started = authentication.generation()
    access = reauthorize({credentials}, close=False).get(credentials)
    if len(_rechecked) >= 10_000:
        _rechecked.clear()
    if authentication.generation() == started:  # else it may predate a revocation
        _rechecked[credentials] = (now, access)
    return access


async def next_link(scope: Scope, headers: dict[str, str], send: Send) -> None:
    """Answer Pushpin's request of a held stream's ``next`` link: on a gap (a published
    event did not follow the connection's last one), every grip.recheck_seconds(), and
    for the next page of a long replay. The stream's credentials, sealed in the link, are
    checked again; still valid, it is sent what it missed after its last event
    (``Grip-Last``) and held again. Otherwise it is not held again, and Pushpin ends it:
    the client's reconnection is then refused (401)."""
    query = next_link_query(scope) or {}
    sealed = grip.unseal(query.get("auth", ""))
    generation = authentication.generation()
    try:
        access = None
        if sealed is not None:
            access = await on_database_thread(_still_allowed, sealed[0])
        if sealed is None or access is None:
            await send_response(send, HttpResponse(status=204))
            return
        relay = await get_relay()
        await relay.current()
        event_id = grip.last_id(headers)
        if event_id is None and RESUME_ID.fullmatch(query.get("after", "")):
            event_id = int(query["after"])
        after = await relay.cursor_of(event_id) if event_id is not None else None
        await hold(send, relay, after, *sealed, access, preamble=False, generation=generation)
    except (DatabaseError, TimeoutError, OSError, psycopg.Error) as exc:
        # Pushpin asks again a little later.
        logger.warning("stream: database unavailable: %s", exc)
        await unavailable(send)


async def hold(
    send: Send,
    relay: Relay,
    after: Cursor | None,
    credentials: Credentials,
    user_id: int,
    access: QueueAccess,
    *,
    preamble: bool,
    generation: int,
) -> None:
    """Answer a stream request from Pushpin: what the client missed after ``after`` (at
    most a page; Pushpin asks for the rest), then GRIP instructions to hold the stream on
    the events published after the last one sent (board.live.grip).

    ``generation`` is authentication.generation() from before the credentials were
    checked. If credentials changed since (anyone's), the close that board.live.revocation
    published may have reached Pushpin before this answer subscribes the user's channel:
    the stream is not held then. A new stream ends after what it was sent, and its client
    resumes; a held one (its next link) is ended (204) and resumes. Either way the
    credentials are looked up again."""
    upto = relay.head
    assert upto is not None
    position = after if after is not None else upto
    chunks = [preamble_of(position)] if preamble else []
    sent = 0
    if after is not None and after < upto:
        async for page in relay.replay(after, upto):
            chunks += [event.sse for event in page if access.allows(event.queue)]
            position = page[-1].cursor
            sent += len(page)
            if sent >= grip.PAGE_EVENTS:
                break
    more = position < upto
    if authentication.generation() != generation:
        if not preamble:
            await send_response(send, HttpResponse(status=204))
            return
        await send({"type": "http.response.start", "status": 200, "headers": STREAM_HEADERS})
        await send({"type": "http.response.body", "body": b"".join(chunks)})
        return
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                *STREAM_HEADERS,
                *grip.hold_headers(
                    PATH,
                    position.id,
                    credentials,
                    user_id,
                    access,
                    hold=not more,
                    keepalive=KEEPALIVE_SECONDS,
                ),
            ],
        }
    )
    await send({"type": "http.response.body", "body": b"".join(chunks)})


def preamble_of(position: Cursor) -> bytes:
    """The start of a stream that begins after ``position``: the reconnection delay, and
    the position as an ``id:`` without data, which sets EventSource's lastEventId and
    dispatches nothing. A client whose connection drops before its first event (Pushpin
    restarted, a server process killed) then resumes from where its stream started,
    instead of from whatever is new when it reconnects."""
    return f"retry: {RETRY_MILLISECONDS}\nid: {position.id}\n: connected\n\n".encode()


async def events(
    relay: Relay, after: Cursor | None, access: QueueAccess | OpenStream = EVERY_QUEUE
) -> AsyncIterator[bytes]:
    """Yield the SSE byte stream: a replay after ``after`` (if given), then live events,
    of the queues ``access`` allows."""

    def sse(batch: list[StreamEvent]) -> bytes:
        return b"".join(event.sse for event in batch if access.allows(event.queue))

    subscriber = relay.subscribe()
    try:
        yield preamble_of(after if after is not None else subscriber.start)
        # When the client was last written to: a limited client may see nothing of a busy
        # board for a long time, and still needs a keep-alive on time.
        written = time.monotonic()
        last = subscriber.start
        if after is not None and after < subscriber.start:
            async for page in relay.replay(after, subscriber.start):
                if chunk := sse(page):
                    yield chunk
                    written = time.monotonic()
        elif after is not None:
            # This process's relay is behind the client (it was paused, or is catching up
            # after a lost connection): what it delivers up to ``after`` was sent already.
            last = after
        while True:
            if subscriber.lagging:
                # This client fell behind and its queue was dropped: replay from memory.
                upto = relay.resume(subscriber)
                async for page in relay.replay(last, upto):
                    if chunk := sse(page):
                        yield chunk
                        written = time.monotonic()
                last = max(last, upto)
            quiet = written + KEEPALIVE_SECONDS - time.monotonic()
            queued = await subscriber.wait(max(quiet, 0.0))
            if not queued:
                if time.monotonic() - written >= KEEPALIVE_SECONDS:
                    yield b": keep-alive\n\n"
                    written = time.monotonic()
                continue  # (or lagging: replayed at the top)
            live = [event for event in queued if event is not None]
            chunk = sse([event for event in live if event.cursor > last])
            if live:
                last = max(last, live[-1].cursor)
            if chunk:
                yield chunk
                written = time.monotonic()
            if len(live) < len(queued):
                return  # the relay stopped (server shutdown): the client will reconnect
    finally:
        relay.unsubscribe(subscriber)
