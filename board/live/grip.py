"""GRIP: the event stream held open in Pushpin, and the events published to it by one
server process at a time.

Behind Pushpin (``taskboard serve --pushpin``, or ``GRIP_URL`` naming a Pushpin you run),
a stream request reaches a server process signed by Pushpin (``Grip-Sig``). The process
answers at once, with what the client missed (replayed from the relay's memory or
``task_events``) and GRIP instructions (board.live.stream): hold the response open on the
``events`` channel, the id of the last event sent as ``prev-id``. Pushpin then keeps the
connection, and no server process holds it: a process can die or restart without a single
stream ending.

The events are published by one relay at a time (:class:`Publisher`): the relays of all
processes compete for an advisory lock on their LISTEN connection (board.live.relay), and the
holder POSTs each event to Pushpin's publish endpoint with its id and the id of the event
before it (``prev-id``), in the log's commit-safe order, which every relay reads alike.
Pushpin's reliable delivery does the rest: a connection whose last event is not the
published event's ``prev-id`` (it missed one: a publish lost with a dying leader, or a
connection opened while the leader was ahead of the process that answered it) is not
sent the event; Pushpin asks the stream's ``next`` link instead, with the connection's last
id in ``Grip-Last``, and the process that answers replays what is missing. So a leader
change, a server process killed or Pushpin restarted (every client then resumes with
Last-Event-ID) never loses or repeats an event.

A change of a user's credentials (board.live.revocation) closes the user's held streams at
once, by a close published on the user's channel (:func:`close_streams_of`): each client
resumes, and is refused or streams under its new queue limit. As a backstop, the ``next``
link is requested every :func:`recheck_seconds`, so that a held stream's credentials are
checked again, as open streams are without Pushpin: a revoked token or a deactivated user
ends the stream, and the reconnection is refused.

Written here rather than taken from django-eventstream: its GRIP path names events
``<channel>:<id>``, pads and announces the stream (``stream-open``) and keeps its own event
tables, where the contract's stream has plain event ids, its own preamble, and
``task_events`` as the only log. gripcontrol (which django-eventstream uses) provides the
parsing of ``GRIP_URL``, the signature check and the channel headers.

What holding streams in Pushpin buys, measured by the fan-out benchmark (10,000 streams,
about 35,000 deliveries a second, docs/performance.md): both server processes together
used 2.1% of the machine's CPU, publishing each event once, and no process held more than
2 database connections; Pushpin's own cost was about 41 µs of CPU per delivery.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import math
import time
import weakref
from dataclasses import dataclass
from typing import Any

import httpx
import jwt
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESSIV
from gripcontrol import Channel, create_grip_channel_header, parse_grip_uri, validate_sig

from board import conf
from board.access import QueueAccess
from board.live.relay import Relay, StreamEvent

logger = logging.getLogger(__name__)

CHANNEL = "events"
# Events per POST to Pushpin, and per answer to a stream request (more follow by the
# ``next`` link).
PUBLISH_BATCH = 500
PAGE_EVENTS = 1000
CLOSE = {"action": "close"}
# A publish that fails is tried again after this long, doubling up to the second figure.
RETRY_SECONDS = (0.5, 30.0)


@dataclass(frozen=True)
class Grip:
    """Where to publish (Pushpin's publish endpoint) and how to recognise its requests."""

    publish_url: str
    publish_key: bytes | str | None
    publish_iss: str | None
    verify_key: bytes | str | None
    verify_iss: str | None


_config: dict[str, Grip | None] = {}


def config() -> Grip | None:
    """The GRIP configuration from ``GRIP_URL`` (django-grip's format), or None without it.

    ``GRIP_URL=http://127.0.0.1:5561?verify-iss=pushpin&verify-key=base64:...``: the
    publish endpoint (Pushpin's ``push_in_http_port``), and the issuer and key Pushpin
    signs its requests with (its ``sig_iss`` and ``sig_key``). ``iss`` and ``key``, if
    given, sign the publish requests.
    """
    url = conf.grip_url()
    if url not in _config:
        grip = None
        if url:
            parsed = parse_grip_uri(url)
            grip = Grip(
                publish_url=parsed["control_uri"].rstrip("/") + "/publish/",
                publish_key=parsed.get("key"),
                publish_iss=parsed.get("control_iss"),
                verify_key=parsed.get("verify_key", parsed.get("key")),
                verify_iss=parsed.get("verify_iss"),
            )
        _config[url] = grip
    return _config[url]


def proxied(headers: dict[str, str]) -> bool:
    """Whether the request came through the GRIP proxy of ``GRIP_URL``: its ``Grip-Sig``
    is valid. Anything else is served as a plain stream."""
    grip = config()
    token = headers.get("grip-sig")
    if grip is None or not token or grip.verify_key is None:
        return False
    return bool(validate_sig(token, grip.verify_key, iss=grip.verify_iss))


def last_id(headers: dict[str, str]) -> int | None:
    """The last event id Pushpin sent on the ``events`` channel (``Grip-Last``), given on
    a request of the ``next`` link; None when absent or unreadable."""
    for value in headers.get("grip-last", "").split(","):
        channel, _, params = value.strip().partition(";")
        if channel.strip() != CHANNEL:
            continue
        for param in params.split(";"):
            key, _, found = param.strip().partition("=")
            if key == "last-id" and found.strip().isascii() and found.strip().isdigit():
                return int(found.strip())
    return None


def _cipher() -> AESSIV:
    key = hashlib.sha512(b"taskboard.grip.link:" + conf.secret_key().encode()).digest()
    return AESSIV(key)


def seal(credentials: tuple[str, str], user_id: int) -> str:
    """Encrypt a stream's credentials (board.live.stream.Credentials: a token's digest, or a
    session key) and its user's id for its ``next`` link: Pushpin asks that link without
    the client's headers, and logs its URL, so the link carries them, unreadable and
    unforgeable. The user's id names the stream's user channel when it is held again.

    Deterministic (AES-SIV): every stream of one token gets the same link, and Pushpin,
    which recovers held streams ten links a second, recovers up to a hundred streams
    sharing a link at once, with one request to the board.
    """
    sealed = _cipher().encrypt(json.dumps([*credentials, user_id]).encode(), None)
    return base64.urlsafe_b64encode(sealed).decode().rstrip("=")


def unseal(sealed: str) -> tuple[tuple[str, str], int] | None:
    """The credentials and user id :func:`seal` encrypted, or None for anything else (a
    link sealed before streams had a user channel, too: that stream ends, and its client
    resumes)."""
    try:
        raw = base64.urlsafe_b64decode(sealed + "=" * (-len(sealed) % 4))
        kind, key, user_id = json.loads(_cipher().decrypt(raw, None))
    except (InvalidTag, ValueError, TypeError):
        return None
    if not isinstance(user_id, int) or isinstance(user_id, bool):
        return None
    return (str(kind), str(key)), user_id


def recheck_seconds() -> int:
    """How often Pushpin asks again for a held stream (its credentials are re-checked)."""
    return max(1, int(conf.held_stream_recheck_seconds()))


def queue_channel(queue: str) -> str:
    """The channel that marks a held stream as allowed ``queue`` (queue names are a-z, 0-9,
    ``_`` and ``-``). Nothing is published to it: each event on ``events`` requires it."""
    return f"queue-{queue}"


def user_channel(user_id: int) -> str:
    """The channel of a user's held streams, on which they are closed when the user's
    credentials change (:func:`close_streams_of`)."""
    return f"user-{user_id}"


def channels(prev_id: int, access: QueueAccess, user_id: int) -> list[Channel]:
    """The channels of a held stream of ``user_id`` whose last event is ``prev_id``.

    Every stream follows ``events``, and its user's channel (:func:`user_channel`), on
    which nothing but a close is ever published. A stream limited to queues
    (board.access) has the ``require-sub`` filter on ``events`` and a channel per allowed
    queue: Pushpin then sends it only the events published with one of those as
    ``require_sub``, and still advances its last id past the others, so that they are no
    gap.
    """
    events = Channel(CHANNEL, prev_id=str(prev_id))
    user = Channel(user_channel(user_id))
    if not access.limited:
        return [events, user]
    events.filters.append("require-sub")
    queues = [Channel(queue_channel(queue)) for queue in sorted(access.queues or ())]
    return [events, user, *queues]


def hold_headers(
    path: str,
    prev_id: int,
    credentials: tuple[str, str],
    user_id: int,
    access: QueueAccess,
    *,
    hold: bool,
    keepalive: float,
) -> list[tuple[bytes, bytes]]:
    """GRIP instructions for a stream answer whose last event (or position) is ``prev_id``.

    Held, the stream stays open in Pushpin on the ``events`` channel, with a keep-alive
    comment when quiet, and its ``next`` link asked for on a gap or every
    :func:`recheck_seconds`. Not held (more to replay), Pushpin asks the ``next`` link at
    once and appends its answer.
    """
    header = create_grip_channel_header(channels(prev_id, access, user_id))
    headers = [(b"grip-channel", header.encode())]
    # The credentials go in the link's path, not its query: Pushpin shares one request of
    # a link among the streams that ask it at once, matching links by path and Grip-Last
    # only, so streams of different credentials must never have the same path.
    link = f"{path}next/{seal(credentials, user_id)}/"
    if hold:
        keepalive_seconds = max(1, math.ceil(keepalive))  # Pushpin counts whole seconds
        headers += [
            (b"grip-hold", b"stream"),
            (
                b"grip-keep-alive",
                f": keep-alive\\n\\n; format=cstring; timeout={keepalive_seconds}".encode(),
            ),
            (
                b"grip-link",
                f"<{link}>; rel=next; timeout={recheck_seconds()}".encode(),
            ),
        ]
    else:
        headers.append((b"grip-link", f"<{link}?after={prev_id}>; rel=next".encode()))
    return headers


class Publisher:
    """Publishes the events of this process's relay to Pushpin while the relay leads.

    Every process's publisher follows the events (so that it knows each one's
    predecessor), and only the leading one sends them. One that becomes leader first
    sends the last event it knows again: a connection that the old leader left behind
    then either takes it, or (its last id is older) is recovered through the ``next``
    link, even if nothing else happens on the board.
    """

    def __init__(self, relay: Relay, grip: Grip) -> None:
        assert relay.head is not None, "start the relay first"
        self.relay = relay
        self.grip = grip
        self.prev = relay.head.id
        # The last event seen, with the id of the one before it.
        self.last: tuple[int | str, StreamEvent] | None = None
        self.pending: asyncio.Queue[list[dict[str, Any]]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._client: httpx.AsyncClient | None = None
        # What a failed publish left to send again (_again): whether events were lost,
        # and each close with when it first failed.
        self._events_lost = False
        self._closes_failed: dict[str, float] = {}
        self._retry: asyncio.TimerHandle | None = None
        self._retry_delay = RETRY_SECONDS[0]

    def start(self) -> None:
        self._client = httpx.AsyncClient(timeout=10)
        self._task = asyncio.create_task(self._run(), name="taskboard-grip-publisher")
        self.relay.listeners.add(self.on_events)
        self.relay.leadership_listeners.add(self.on_leadership)

    async def stop(self) -> None:
        self.relay.listeners.discard(self.on_events)
        self.relay.leadership_listeners.discard(self.on_leadership)
        if self._retry is not None:
            self._retry.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._client is not None:
            await self._client.aclose()

    def on_events(self, events: list[StreamEvent]) -> None:
        if not events:
            return
        if not self.relay.leading:
            # A follower only keeps what a new leader sends first: the last event and the
            # id before it (the relay's hot path builds no message it will not send).
            before = events[-2].cursor.id if len(events) > 1 else self.prev
            self.last = (before, events[-1])
            self.prev = events[-1].cursor.id
            return
        items = []
        for event in events:
            items.append(_item(self.prev, event))
            self.prev = event.cursor.id
        self.last = (items[-1]["prev-id"], events[-1])
        self.pending.put_nowait(items)

    def close_streams_of(self, user_id: int) -> None:
        """End the user's held streams: their credentials changed (board.live.revocation).
        Each client reconnects and resumes after its last event: refused (401) if revoked,
        under its new queue limit if that changed.

        Sent by every process, leading or not: each hears the change, and one left to the
        leader alone would be lost with a leader that changes at that moment. A close sent
        twice at most ends a stream that its client had just opened again, which then
        resumes again.
        """
        item = {"channel": user_channel(user_id), "formats": {"http-stream": CLOSE}}
        self.pending.put_nowait([item])

    def on_leadership(self, leading: bool) -> None:
        if leading and self.last is not None:
            self.pending.put_nowait([_item(*self.last)])
        elif not leading:
            # Another process publishes events from now on; what is queued here may be
            # sent twice otherwise. (Sent twice it would not be delivered twice: Pushpin
            # drops a message whose prev-id is not a connection's last id.) Closes stay:
            # every process sends its own, leading or not.
            closes = []
            while not self.pending.empty():
                closes += [i for i in self.pending.get_nowait() if i["channel"] != CHANNEL]
            if closes:
                self.pending.put_nowait(closes)

    async def _run(self) -> None:
        while True:
            items = await self.pending.get()
            while not self.pending.empty() and len(items) < PUBLISH_BATCH:
                items += self.pending.get_nowait()
            try:
                sent = await self._publish(items)
            except Exception:
                logger.exception("grip: publishing %d items failed", len(items))
                sent = False
            self._published(items, sent)

    def _published(self, items: list[dict[str, Any]], sent: bool) -> None:
        """Note what a publish did, and send again later what it failed to send.

        Events: the latest event is sent again, once the publish endpoint answers. A
        stream whose last id is older then sees the gap and is recovered through its
        ``next`` link; without it, a quiet board left such a stream without the lost events
        until its re-check. Closes: each is sent again until it goes through, for as long
        as it can matter; after :func:`recheck_seconds` every held stream has had its
        credentials checked again anyway.
        """
        events = any(item["channel"] == CHANNEL for item in items)
        closes = [item["channel"] for item in items if item["channel"] != CHANNEL]
        if sent:
            self._retry_delay = RETRY_SECONDS[0]
            self._events_lost = self._events_lost and not events
            for channel in closes:
                self._closes_failed.pop(channel, None)
            return
        now = time.monotonic()
        self._events_lost = self._events_lost or events
        for channel in closes:
            self._closes_failed.setdefault(channel, now)
        if self._retry is None:
            self._retry = asyncio.get_running_loop().call_later(self._retry_delay, self._again)
            self._retry_delay = min(self._retry_delay * 2, RETRY_SECONDS[1])

    def _again(self) -> None:
        """Queue again what failed to publish (:meth:`_published`)."""
        self._retry = None
        items = []
        if self._events_lost and self.relay.leading and self.last is not None:
            items.append(_item(*self.last))
        self._events_lost = False  # sent again now, or no longer this process's to send
        given_up = time.monotonic() - recheck_seconds()
        for channel, failed_at in list(self._closes_failed.items()):
            if failed_at < given_up:
                del self._closes_failed[channel]
            else:
                items.append({"channel": channel, "formats": {"http-stream": CLOSE}})
        if items:
            self.pending.put_nowait(items)

    async def _publish(self, items: list[dict[str, Any]]) -> bool:
        """Send ``items`` to Pushpin; whether it took them."""
        assert self._client is not None
        headers = {}
        if self.grip.publish_key:
            claims: dict[str, Any] = {"exp": int(time.time()) + 3600}
            if self.grip.publish_iss:
                claims["iss"] = self.grip.publish_iss
            headers["Authorization"] = "Bearer " + jwt.encode(claims, self.grip.publish_key)
        try:
            response = await self._client.post(
                self.grip.publish_url, json={"items": items}, headers=headers
            )
            response.raise_for_status()
        except httpx.HTTPError as exc:
            # Pushpin is down or restarting (its connections are gone with it, and their
            # clients resume with Last-Event-ID), or failed to take them: sent again later.
            logger.warning("grip: could not publish %d items: %s", len(items), exc)
            return False
        return True


def _item(prev_id: int | str, event: StreamEvent) -> dict[str, Any]:
    """The publish item of ``event``, which follows the event ``prev_id``."""
    return {
        "channel": CHANNEL,
        "id": str(event.cursor.id),
        "prev-id": str(prev_id),
        "meta": {"require_sub": queue_channel(event.queue)},
        "formats": {"http-stream": {"content": event.sse.decode()}},
    }


_publishers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Publisher] = (
    weakref.WeakKeyDictionary()
)
_starting: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Task[None]] = (
    weakref.WeakKeyDictionary()
)
DATABASE_RETRY_SECONDS = 1.0


def start_publisher() -> None:
    """Start this process's publisher when ``GRIP_URL`` is set (ASGI lifespan startup): in
    the background, once its relay is connected (it waits for the database)."""
    if config() is None:
        return
    loop = asyncio.get_running_loop()
    if loop not in _starting:
        _starting[loop] = loop.create_task(_start(), name="taskboard-grip-start")


async def _start() -> None:
    from board.live.relay import get_relay

    grip = config()
    assert grip is not None
    while True:
        try:
            relay = await get_relay()
            break
        except Exception as exc:  # psycopg's or Django's errors, or a timeout
            logger.warning("grip: no relay yet (%s); trying again", exc)
            await asyncio.sleep(DATABASE_RETRY_SECONDS)
    publisher = _publishers[asyncio.get_running_loop()] = Publisher(relay, grip)
    publisher.start()


def close_streams_of(user_id: int) -> None:
    """End ``user_id``'s streams held in Pushpin: their credentials changed."""
    with contextlib.suppress(RuntimeError):  # no event loop: no publisher either
        publisher = _publishers.get(asyncio.get_running_loop())
        if publisher is not None:
            publisher.close_streams_of(user_id)


async def stop_publisher() -> None:
    """Stop this process's publisher (ASGI lifespan shutdown)."""
    loop = asyncio.get_running_loop()
    starting = _starting.pop(loop, None)
    if starting is not None:
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
    publisher = _publishers.pop(loop, None)
    if publisher is not None:
        await publisher.stop()
