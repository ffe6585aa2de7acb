"""The event relay: one LISTEN connection per server process, fanning events out in-process.

Every committed transition NOTIFYs ``task_events`` with the new event's id (migration
0002). The relay holds one direct psycopg connection (not Django's) that LISTENs, and on
each notification reads the new rows from ``task_events`` and hands them to its
subscribers: the SSE streams of this process, and the claims waiting for work. While
nobody in the process listens, it reads at most once a second instead (``wanted()``), and
a stream that opens has it read what it left first (``current()``).

NOTIFY is only a wake-up call; the table is the source of truth, read in commit-safe order
(see ``board/sql/stream.sql``): the relay follows a (txid, id) cursor and reads only the
prefix of the log that can no longer change, so it never skips an event that commits late
and never delivers one twice. When the connection drops (a restart, a terminated backend)
it reconnects with backoff and catches up from its cursor, so nothing made during the gap
is lost.

It keeps the most recent events in memory, so a browser that reconnects is usually
replayed what it missed without touching the database; older gaps are read from
``task_events`` through a small pool (at most two connections) shared by all streams.
That memory is bounded in bytes (``TASKBOARD_STREAM_BUFFER_BYTES``), whatever the size of
tasks: large values are not read with the events (``stream_after``), and a streamed event
carries each of them only up to :data:`ELIDE_BYTES` (``elided`` names the others), so
that no event is over :data:`MAX_EVENT_BYTES`.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import json
import logging
import os
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Generator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

import psycopg
from asgiref.sync import sync_to_async
from django.db import connection
from django_eventstream.utils import sse_encode_event
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from board import conf
from board.sql import QUERIES

logger = logging.getLogger(__name__)
T = TypeVar("T")

CHANNEL = "task_events"
# A queue resumed (board.transitions.resume_queue): its name, for the claims waiting on it.
QUEUE_CHANNEL = "task_queues"
# Deliveries were made or re-armed (migration 0012, or a staff retry): wakes this process's
# dispatcher (board.notifications.deliveries).
DELIVERY_CHANNEL = "webhook_deliveries"
# An account's credentials changed (migration 0014): the user's id, for board.live.revocation.
CREDENTIALS_CHANNEL = "credentials_changed"
# A client address's first failed authentication of a throttle window (access.throttle):
# the address, for the throttle's memory of addresses with no failures.
AUTH_FAILURE_CHANNEL = "auth_failures"
SSE_EVENT_TYPE = "task_event"
# The advisory lock whose holder publishes the events to Pushpin (board.live.grip): any fixed
# bigint, unlikely to be used elsewhere.
LEADER_LOCK = 0x7461736B626F6172  # "taskboar"

# A value of a streamed event's task (TASK_LARGE_FIELDS) or payload larger than this, as
# JSON in the event, is sent as null and named in ``elided``: read the task for it.
ELIDE_BYTES = 8 * 1024
# What no streamed event's data exceeds: values are elided, largest first, until it fits.
MAX_EVENT_BYTES = 64 * 1024
TASK_LARGE_FIELDS = (
    "description",
    "payload",
    "result",
    "progress",
    "last_error",
    "question",
    "answers",
)
# What the relay reads of a large value (stream_after): twice ELIDE_BYTES, since the text
# PostgreSQL writes for jsonb (a space after each comma and colon, characters unescaped)
# may be longer than the event's JSON of the same value, never twice as long.
READ_BYTES = 2 * ELIDE_BYTES
# What a buffered event costs beyond its row or its encoding: the StreamEvent, its
# cursor, its datetimes and its place in the buffer.
EVENT_OVERHEAD_BYTES = 600


@dataclass(frozen=True, order=True)
class Cursor:
    """A position in the event log's commit-safe order."""

    txid: int
    id: int


START = Cursor(0, 0)
END = Cursor(2**64 - 1, 2**63 - 1)  # past any event: xid8 and bigint maxima

# A statement and its parameters, for :func:`head_below_horizon`'s caller to run; the
# statement's first row (a dict, or None) is sent back.
Statement = tuple[str, dict[str, Any]]


def head_below_horizon() -> Generator[Statement, dict[str, Any] | None, tuple[str, Cursor]]:
    """The horizon now and the cursor of the last event below it: the head of the part of
    the log that can no longer change (board/sql/stream.sql), where the relay starts, where
    a stream that names no event starts, and where a board page's stream resumes.

    The two statements, in this order, for a connection of either kind: it yields each
    and is sent its first row, by :func:`run_on_django` (the stream, the pages) or by the
    relay on its own connection (Relay._run_statements). Everything below the horizon has committed
    by the time the first statement ends, so the head is the same in any later snapshot.
    """
    horizon = yield QUERIES["stream_horizon"], {}
    assert horizon is not None
    row = yield QUERIES["stream_head"], {"horizon": str(horizon["horizon"])}
    return str(horizon["horizon"]), Cursor(int(row["txid"]), row["id"]) if row else START


def run_on_django(statements: Generator[Statement, dict[str, Any] | None, T]) -> T:
    """Run ``statements`` (:func:`head_below_horizon`) on this thread's Django connection."""
    with connection.cursor() as cursor:
        try:
            statement = next(statements)
            while True:
                cursor.execute(*statement)
                row = cursor.fetchone()
                names = [column[0] for column in cursor.description]
                statement = statements.send(dict(zip(names, row, strict=True)) if row else None)
        except StopIteration as done:
            return done.value


@dataclass(frozen=True, eq=False)
class StreamEvent:
    cursor: Cursor
    task_id: int
    type: str
    status: str
    queue: str
    # The task's run_after and leased_until when the relay read the event.
    run_after: datetime | None
    leased_until: datetime | None
    # The relay's row of the event until a stream or the publisher first asks for the SSE
    # (see :attr:`sse`), then the SSE itself.
    source: dict[str, Any] | bytes = field(repr=False)
    # What the event takes in memory (see _row_bytes), and the relay whose buffer holds
    # it, told when encoding changes that (see :attr:`sse`).
    size: int = field(default=0, repr=False)
    buffered_in: Relay | None = field(default=None, repr=False)
    # The end of its question's time (awaiting input) and of its hold for the asker.
    answer_by: datetime | None = None
    held_until: datetime | None = None
    # Whether only some claimants may take the task (an assignee, required labels, a
    # hold): a waiting claim woken for it may not be one of them.
    restricted: bool = False

    @property
    def sse(self) -> bytes:
        """The event as SSE, encoded on first use and then kept, for every stream.

        Encoded lazily: every server process's relay reads every event, but only those
        with a stream open (or publishing to Pushpin) write any. Rendering each event with
        the API's serializers was about a tenth of a server process's CPU under API load
        with no stream open (a py-spy profile with --gil).
        """
        source = self.source
        if not isinstance(source, bytes):
            source = _encode(source)
            object.__setattr__(self, "source", source)
            size = sys.getsizeof(source) + EVENT_OVERHEAD_BYTES
            change = size - self.size
            object.__setattr__(self, "size", size)
            if self.buffered_in is not None:
                self.buffered_in.resized(change)
        return source


def _row_bytes(row: dict[str, Any]) -> int:
    """What a ``stream_after`` row takes in memory: the dict, its values and their items
    (a list of dependencies), with the event around it."""
    size = sys.getsizeof(row) + EVENT_OVERHEAD_BYTES
    for value in row.values():
        size += sys.getsizeof(value)
        if isinstance(value, list):
            size += sum(sys.getsizeof(item) for item in value)
    return size


def _held(until: datetime | None) -> bool:
    """Whether a hold for an asker lasts still: held_until stays on the row after it ends,
    until the task is next claimed."""
    return until is not None and until.timestamp() > time.time()


def _stream_event(row: dict[str, Any]) -> StreamEvent:
    """Build one event of the stream from a ``stream_after`` row (encoded when first
    written: see :attr:`StreamEvent.sse`)."""
    return StreamEvent(
        cursor=Cursor(int(row["txid"]), row["event_id"]),
        task_id=row["id"],
        type=row["event_type"],
        status=row["event_status"],
        queue=row["queue"],
        run_after=row["run_after"],
        leased_until=row["leased_until"],
        answer_by=row["answer_by"],
        held_until=row["held_until"],
        restricted=bool(row["assignee"] or row["requires"] or _held(row["held_until"])),
        source=row,
        size=_row_bytes(row),
    )


def _encode(row: dict[str, Any]) -> bytes:
    """The SSE of a ``stream_after`` row: the Event, and in its ``task`` the task as it is
    after the event (None when a later event of the task has committed, which carries it
    instead).

    A large value (see ELIDE_BYTES) of the task, or of the event's payload, is null and
    named in the task's, or the event's, ``elided``; present only when not empty.
    """
    from board.api.serializers import EventSerializer, TaskSerializer, render
    from board.models import Task, TaskEvent

    event = TaskEvent(
        id=row["event_id"],
        task_id=row["id"],
        type=row["event_type"],
        status=row["event_status"],
        actor=row["actor"],
        payload=json.loads(row["event_payload"]),
        created_at=row["event_created_at"],
    )
    data = render(EventSerializer, event)
    data["task"] = None
    payload_elided = _elide(data["payload"], list(data["payload"]), list(row["payload_elided"]))
    task_elided: list[str] = []
    if row["task_is_current"]:
        # jsonb comes as its text (stream_after): the values go to the model decoded.
        columns, attnames = _task_fields()
        values = [
            _decoded(row[column]) if column in _JSONB_COLUMNS else row[column] for column in columns
        ]
        task = Task.from_db(None, attnames, values)
        if task.answers is None:  # left in the database (task_elided): a list to render
            task.answers = []
        data["task"] = render(TaskSerializer, task)
        if "answers" in row["task_elided"]:
            data["task"]["answers"] = None
        task_elided = _elide(data["task"], TASK_LARGE_FIELDS, list(row["task_elided"]))
    while True:
        if payload_elided:
            data["elided"] = [key for key in data["payload"] if key in payload_elided]
        if task_elided:
            data["task"]["elided"] = [name for name in TASK_LARGE_FIELDS if name in task_elided]
        text = _dumps(data)
        if len(text) <= MAX_EVENT_BYTES:
            break
        # Each value left is at most ELIDE_BYTES, but together (with a title written with
        # escapes, say) they may still be too many: the largest goes, until the event fits.
        candidates = [(data["payload"], key, payload_elided) for key in data["payload"]]
        if data["task"] is not None:
            candidates += [(data["task"], name, task_elided) for name in TASK_LARGE_FIELDS]
        largest = max(
            (c for c in candidates if c[0][c[1]] is not None),
            key=lambda c: len(_dumps(c[0][c[1]])),
            default=None,
        )
        if largest is None:
            break
        holder, key, elided = largest
        holder[key] = None
        elided.append(key)
    return sse_encode_event(SSE_EVENT_TYPE, text, event_id=str(row["event_id"])).encode()


_JSONB_COLUMNS = frozenset({"payload", "result", "progress", "question", "answers"})


def _decoded(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _elide(values: dict[str, Any], names: Sequence[str], elided: list[str]) -> list[str]:
    """Set to None each of ``names`` in ``values`` larger than ELIDE_BYTES as JSON; return
    them with ``elided`` (those the database left out already), in the order of ``names``."""
    for name in names:
        value = values.get(name)
        if value is not None and len(_dumps(value)) > ELIDE_BYTES:
            values[name] = None
            elided.append(name)
    return [name for name in names if name in elided]


@functools.cache
def _task_fields() -> tuple[list[str], list[str]]:
    """The tasks table's columns and the Task model's attribute names, in one order."""
    from board.models import Task

    fields = Task._meta.concrete_fields
    return [str(f.column) for f in fields], [f.attname for f in fields]


class Subscriber:
    """One consumer's pending live events. When the consumer falls too far behind, the
    relay stops adding and marks it lagging; the consumer then catches up with
    :meth:`Relay.replay` and :meth:`Relay.resume`. A None among the events means the relay
    has stopped.

    A list and one future, not an asyncio.Queue read with ``asyncio.wait_for``: with a
    thousand streams in a process, every event wakes a thousand consumers, and the task
    that ``wait_for`` makes per wait and the queue's own waiters were about a third of the
    process's CPU in a profile of the fan-out benchmark.
    """

    def __init__(self, start: Cursor, maxsize: int) -> None:
        self.start = start
        self.maxsize = maxsize
        self.pending: list[StreamEvent | None] = []
        self.lagging = False
        self._waiter: asyncio.Future[None] | None = None

    def close(self) -> None:
        self.lagging = False
        self.pending.append(None)
        self._wake()

    def offer(self, events: list[StreamEvent]) -> None:
        if self.lagging:
            return
        if len(self.pending) + len(events) > self.maxsize:
            self.lagging = True
        else:
            self.pending.extend(events)
        self._wake()

    def drain(self) -> list[StreamEvent | None]:
        events, self.pending = self.pending, []
        return events

    async def wait(self, timeout: float) -> list[StreamEvent | None]:
        """Return the events offered since the last call, waiting up to ``timeout`` seconds
        for one if there are none yet (and the subscriber is not lagging); [] if none came."""
        if not self.pending and not self.lagging:
            assert self._waiter is None, "a subscriber has one consumer"
            loop = asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            timer = loop.call_later(timeout, _release, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
        return self.drain()

    def _wake(self) -> None:
        if self._waiter is not None:
            _release(self._waiter)


def _release(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def django_conninfo(application_name: str = "taskboard-relay") -> str:
    """Return a libpq connection string for Django's default database, for direct use,
    with its sessions named ``application_name`` (over any name the settings give).

    DATABASE_LISTEN_URL, when set, is that database reached directly, where DATABASE_URL
    goes through a pooler in transaction mode (PgBouncer), which cannot carry a LISTEN.
    """
    params = connection.get_connection_params()
    if conf.database_listen_url():
        # Give up on a host that never answers as Django's connections do, unless the URL
        # says otherwise (libpq's default is to wait for ever).
        extra = {"application_name": application_name}
        given = psycopg.conninfo.conninfo_to_dict(conf.database_listen_url())
        if "connect_timeout" not in given and params.get("connect_timeout") is not None:
            extra["connect_timeout"] = params["connect_timeout"]
        return psycopg.conninfo.make_conninfo(conf.database_listen_url(), **extra)
    keywords = {option.keyword.decode() for option in psycopg.pq.Conninfo.get_defaults()}
    kept = {
        key: value
        for key, value in params.items()
        if key in keywords and isinstance(value, str | int) and value != ""
    }
    return psycopg.conninfo.make_conninfo("", **{**kept, "application_name": application_name})


class Relay:
    MIN_BACKOFF = 0.1  # seconds before the first reconnect after a loss, doubling to
    MAX_BACKOFF = 5.0
    # How often a relay that nobody listens to reads the events it was notified of.
    IDLE_READ_SECONDS = 1.0
    # How long a relay waits for a notification before it reads anyway: the read also
    # tells whether the session still answers.
    CHECK_SECONDS = 30.0
    # How long one statement of the relay's session may take before the session is given
    # up for one that stopped answering.
    QUERY_TIMEOUT_SECONDS = 10.0

    def __init__(
        self,
        conninfo: str,
        *,
        buffer_size: int = 10_000,
        buffer_bytes: int = 64 * 2**20,
        subscriber_queue: int = 1_000,
        batch: int = 1_000,
        healthy_after: float = 5.0,
        leader_key: int | None = None,
    ) -> None:
        self.conninfo = conninfo
        # The most recent events, complete for every cursor after buffer_floor: at most
        # buffer_size of them, taking at most buffer_bytes (their sizes' sum, held_bytes).
        self.buffer: deque[StreamEvent] = deque()
        self.buffer_size = buffer_size
        self.buffer_bytes = buffer_bytes
        self.held_bytes = 0
        self.buffer_floor: Cursor | None = None
        self.head: Cursor | None = None
        self.connected = asyncio.Event()
        self.subscribers: set[Subscriber] = set()
        self.listeners: set[Callable[[list[StreamEvent]], None]] = set()
        # Whether a listener needs each event as it commits (see wanted()): the waiting
        # claims, while any wait.
        self.demands: set[Callable[[], bool]] = set()
        # Notifications of events left unread (nobody wanted them yet); the next read, at
        # the latest IDLE_READ_SECONDS later or when a stream opens (current()), gets them.
        self.unread = False
        self._reading = asyncio.Lock()
        self._reading_unread: asyncio.Future[None] | None = None
        # Called with a queue's name when it was paused or resumed.
        self.queue_listeners: set[Callable[[str], None]] = set()
        # Called on each notification of new deliveries, and after each (re)connect, since
        # one may have come while the connection was down.
        self.delivery_listeners: set[Callable[[], None]] = set()
        # Called with a user's id when their token, queue limit, password or status changed;
        # after each reconnect, with None (anyone's may have changed meanwhile) and then
        # with each user whose changes were counted meanwhile (migration 0015).
        self.credential_listeners: set[Callable[[int | None], None]] = set()
        # Each user's count of changes, as read when the relay last connected.
        self.credential_changes: dict[int, int] | None = None
        # Called with a client address that failed to authenticate; with None on each
        # (re)connect, since some may have failed while the connection was down.
        self.auth_failure_listeners: set[Callable[[str | None], None]] = set()
        self.subscriber_queue = subscriber_queue
        self.batch = batch
        self.reconnects = 0
        # Seconds a connection must have lived for its loss to reset the reconnect delay.
        self.healthy_after = healthy_after
        self._listening_since: float | None = None
        self.backend_pid: int | None = None
        # This relay's earlier sessions, as (pid, backend_start), that the database may
        # still have: each new session ends them (see _end_previous_sessions).
        self._previous_sessions: set[tuple[int, datetime]] = set()
        self._task: asyncio.Task[None] | None = None
        self._pool: AsyncConnectionPool | None = None
        # Behind Pushpin (board.live.grip), the relays of every server process compete for one
        # advisory lock, taken on this LISTEN connection: its holder publishes the events.
        # A process that dies, or loses its connection, loses the lock with its session, and
        # the next relay to try takes it (within a second: see _listen). A session dropped
        # silently on the way is ended by the relay's next one (_end_previous_sessions).
        self.leader_key = leader_key
        self.leading = False
        self.leadership_listeners: set[Callable[[bool], None]] = set()

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self, timeout: float = 10) -> None:
        """Start relaying; return once the LISTEN is in place and the head is known."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="taskboard-relay")
        await asyncio.wait_for(self.connected.wait(), timeout)

    async def stop(self) -> None:
        if self._reading_unread is not None:
            self._reading_unread.cancel()
        for subscriber in self.subscribers:
            subscriber.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    async def _run(self) -> None:
        try:
            await self._run_forever()
        finally:
            # Whatever ended the relay, nobody may take it for listening any more (the
            # failed-authentication throttle trusts its memory only while it does).
            self.connected.clear()

    async def _run_forever(self) -> None:
        backoff = self.MIN_BACKOFF
        while True:
            try:
                await self._listen()
            except asyncio.CancelledError:
                raise
            except (psycopg.Error, OSError) as exc:
                self.connected.clear()
                self.reconnects += 1
                # _listen() only ever ends by an error. A connection that was up for a
                # while was healthy: this loss starts a new series of short delays rather
                # than continuing the last one's (which would leave every later loss 5 s
                # of silence).
                if (
                    self._listening_since is not None
                    and time.monotonic() - self._listening_since >= self.healthy_after
                ):
                    backoff = self.MIN_BACKOFF
                self._listening_since = None
                logger.warning("relay: connection lost (%s); reconnecting in %.1fs", exc, backoff)
                self._set_leading(False)  # the lock went with the session
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.MAX_BACKOFF)

    async def _listen(self) -> None:
        async with await psycopg.AsyncConnection.connect(
            self.conninfo, autocommit=True, row_factory=dict_row
        ) as conn:
            await self._end_previous_sessions(conn)
            # LISTEN before reading the head: nothing committed after it goes unnoticed.
            await self._execute(conn, f"LISTEN {CHANNEL}")
            await self._execute(conn, f"LISTEN {QUEUE_CHANNEL}")
            await self._execute(conn, f"LISTEN {DELIVERY_CHANNEL}")
            await self._execute(conn, f"LISTEN {CREDENTIALS_CHANNEL}")
            await self._execute(conn, f"LISTEN {AUTH_FAILURE_CHANNEL}")
            cur = await self._execute(conn, QUERIES["credential_changes"])
            changes = {row["user_id"]: row["changes"] for row in await cur.fetchall()}
            if self.head is None:
                _, self.head = await self._run_statements(conn, head_below_horizon())
                self.buffer_floor = self.head
            async with self._reading:
                self.unread = False
                held_back = await self._catch_up(conn)
            await self._lead(conn)
            self._listening_since = time.monotonic()
            self._auth_failed(None)
            self.connected.set()
            self._deliveries_made()
            if self.reconnects:
                self._credentials_changed("")
                # Without an earlier reading (the first connection failed before it was
                # kept) there is nothing to compare: "" above is all that can be said.
                before = self.credential_changes
                if before is not None:
                    for user_id, count in changes.items():
                        if before.get(user_id) != count:
                            self._credentials_changed(str(user_id))
            self.credential_changes = changes
            logger.info("relay: listening (backend %s) from %s", self.backend_pid, self.head)
            idle_until = time.monotonic() + self.IDLE_READ_SECONDS
            while True:
                # Woken by a notification; while events wait behind an older transaction
                # that may commit without notifying, look again shortly; otherwise check
                # the connection now and then.
                timeout = 0.05 if held_back else self.CHECK_SECONDS
                if self.leader_key is not None and not self.leading:
                    timeout = min(timeout, 1.0)  # try for the lock again soon
                if self.unread:
                    timeout = min(timeout, max(idle_until - time.monotonic(), 0.0))
                notified = False
                heard: list[int] = []  # users whose change of credentials was announced
                async for notify in conn.notifies(timeout=timeout, stop_after=1):
                    if notify.channel == CHANNEL:
                        notified = True
                    elif notify.channel == QUEUE_CHANNEL:
                        self._queue_changed(notify.payload)
                    elif notify.channel == DELIVERY_CHANNEL:
                        self._deliveries_made()
                    elif notify.channel == CREDENTIALS_CHANNEL:
                        self._credentials_changed(notify.payload)
                        if notify.payload.isascii() and notify.payload.isdigit():
                            heard.append(int(notify.payload))
                    elif notify.channel == AUTH_FAILURE_CHANNEL:
                        self._auth_failed(notify.payload)
                if heard:
                    await self._heard_credential_changes(conn, heard)
                if not self.wanted() and time.monotonic() < idle_until:
                    # Nobody in this process needs these events yet: leave them for the
                    # next read (see IDLE_READ_SECONDS and current()).
                    self.unread = self.unread or notified or held_back
                    held_back = False
                    continue
                if window := self.coalesce_window():
                    # Many streams: let the commits of the next few milliseconds join this
                    # read, so that each stream is written to once for all of them.
                    await asyncio.sleep(window)
                async with self._reading:
                    self.unread = False
                    held_back = await self._catch_up(conn)
                idle_until = time.monotonic() + self.IDLE_READ_SECONDS
                await self._lead(conn)

    async def _heard_credential_changes(
        self, conn: psycopg.AsyncConnection[Any], users: list[int]
    ) -> None:
        """Take the counts of changes of ``users``, whose changes were just announced and
        acted on, as known, so that the next reconnect does not act on them again. (A
        count may already include a later change: its own announcement follows.)"""
        if self.credential_changes is None:
            return
        cur = await self._execute(
            conn, QUERIES["credential_changes_of"], {"users": sorted(set(users))}
        )
        for row in await cur.fetchall():
            self.credential_changes[row["user_id"]] = row["changes"]

    async def _end_previous_sessions(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Remember this session; end this relay's earlier ones if the database still has them.

        A connection given up on (QUERY_TIMEOUT_SECONDS) may have been dropped silently on
        the way, by a NAT, a firewall or a proxy that keeps the database's side open: the
        database then sees an idle session, keeps its LISTENs and, behind Pushpin, the
        leader lock, until TCP keepalive gives up on it (about two hours by default). No
        relay could lead meanwhile. A session is matched by its start time as well as its
        pid, which the operating system may have given to another process since, and is
        forgotten only once the database no longer has it: an attempt that fails (the
        network still flaky) is made again by the next session. All are ended in one
        statement, so that a database that keeps failing does not make the list longer
        than the sessions it still has.
        """
        cur = await self._execute(
            conn,
            "SELECT pid, backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()",
        )
        row = await cur.fetchone()
        self.backend_pid = row["pid"] if row else conn.info.backend_pid
        previous = sorted(self._previous_sessions)
        # Through a pooler the server's pid is not the one the connection announced, and
        # the server connection outlives this session, lent to other clients: it must not
        # be ended later.
        if row and row["pid"] == conn.info.backend_pid:
            self._previous_sessions.add((row["pid"], row["backend_start"]))
        if not previous:
            return
        try:
            cur = await self._execute(
                conn,
                "SELECT a.pid, a.backend_start, pg_terminate_backend(a.pid) AS ended"
                " FROM pg_stat_activity a JOIN unnest(%(pids)s::int[],"
                " %(starts)s::timestamptz[]) AS s (pid, started)"
                " ON a.pid = s.pid AND a.backend_start = s.started",
                {"pids": [pid for pid, _ in previous], "starts": [t for _, t in previous]},
            )
        except psycopg.errors.InsufficientPrivilege as exc:
            logger.warning("relay: could not end its previous sessions (%s)", exc)
            self._previous_sessions.difference_update(previous)
            return
        found = await cur.fetchall()
        still = {(r["pid"], r["backend_start"]) for r in found if not r["ended"]}
        # Gone, or going (ended now): the lock goes with it.
        self._previous_sessions.difference_update(set(previous) - still)
        for r in found:
            if r["ended"]:
                logger.warning("relay: ended its previous session (backend %s)", r["pid"])

    async def _lead(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Take the leader lock if this relay competes for it and nobody holds it.

        Tried after each read, so that a new leader has delivered (to its publisher) every
        event up to its head before it starts publishing.
        """
        if self.leader_key is None or self.leading:
            return
        cur = await self._execute(
            conn, "SELECT pg_try_advisory_lock(%(key)s) AS acquired", {"key": self.leader_key}
        )
        row = await cur.fetchone()
        if row and row["acquired"]:
            logger.info("relay: leading (process %s, backend %s)", os.getpid(), self.backend_pid)
            self._set_leading(True)

    def _set_leading(self, leading: bool) -> None:
        if leading == self.leading:
            return
        self.leading = leading
        for listener in list(self.leadership_listeners):
            try:
                listener(leading)
            except Exception:
                logger.exception("relay: a leadership listener failed")

    async def _execute(
        self, conn: psycopg.AsyncConnection[Any], query: str, params: Any = None
    ) -> psycopg.AsyncCursor[Any]:
        """Run one statement, with dict rows, within QUERY_TIMEOUT_SECONDS.

        A session that stops answering without closing (a database host that hangs, a
        connection that a network path or NAT dropped without a word) would otherwise be
        waited on for as long as TCP keeps trying, about a quarter of an hour, while the
        process's streams and waiting claims hear nothing. Past the timeout the connection
        is closed (psycopg first asks the server to cancel, for at most 10 s) and the
        error ends the session like any other loss: the relay connects again and reads
        from its head, so nothing is missed.
        """
        cur = conn.cursor(row_factory=dict_row)
        try:
            async with asyncio.timeout(self.QUERY_TIMEOUT_SECONDS):
                await cur.execute(query, params)
        except TimeoutError:
            await conn.close()
            raise TimeoutError(
                f"the database did not answer within {self.QUERY_TIMEOUT_SECONDS:g} s"
            ) from None
        return cur

    async def _run_statements(
        self,
        conn: psycopg.AsyncConnection[Any],
        statements: Generator[Statement, dict[str, Any] | None, T],
    ) -> T:
        """Run ``statements`` (:func:`head_below_horizon`) on the relay's connection."""
        try:
            statement = next(statements)
            while True:
                cur = await self._execute(conn, *statement)
                statement = statements.send(await cur.fetchone())
        except StopIteration as done:
            return done.value

    async def _catch_up(self, conn: psycopg.AsyncConnection[Any]) -> bool:
        """Read and deliver everything after the head; return whether events are held back."""
        assert self.head is not None
        # The horizon is computed in its own statement, before the read: see stream.sql.
        cur = await self._execute(conn, QUERIES["stream_horizon"])
        horizon = await cur.fetchone()
        assert horizon is not None
        while True:
            events = await self._read(conn, self.head, END, horizon["horizon"])
            if events:
                self._deliver(events)
            if len(events) < self.batch:
                break
        if not horizon["in_flight"]:
            return False
        cur = await self._execute(
            conn,
            QUERIES["stream_held_back"],
            {"txid": str(self.head.txid), "id": self.head.id, "horizon": horizon["horizon"]},
        )
        row = await cur.fetchone()
        return bool(row and row["held_back"])

    def _queue_changed(self, queue: str) -> None:
        for listener in list(self.queue_listeners):
            try:
                listener(queue)
            except Exception:
                logger.exception("relay: a queue listener failed")

    def _credentials_changed(self, payload: str) -> None:
        """Tell the listeners whose credentials changed ("": anyone's may have)."""
        user_id = int(payload) if payload.isascii() and payload.isdigit() else None
        for listener in list(self.credential_listeners):
            try:
                listener(user_id)
            except Exception:
                logger.exception("relay: a credentials listener failed")

    def _auth_failed(self, address: str | None) -> None:
        for listener in list(self.auth_failure_listeners):
            try:
                listener(address)
            except Exception:
                logger.exception("relay: an authentication failure listener failed")

    def _deliveries_made(self) -> None:
        for listener in list(self.delivery_listeners):
            try:
                listener()
            except Exception:
                logger.exception("relay: a delivery listener failed")

    def wanted(self) -> bool:
        """Whether anyone in this process needs each event as soon as it commits: a stream
        open here, a claim waiting here, or this relay publishing to Pushpin.

        A relay that nobody listens to reads what it was notified of once a second
        (IDLE_READ_SECONDS) rather than on each notification. Every server process's relay
        is notified of every event, and under API load with no stream open, reading each
        one (three statements: horizon, events, held-back check) was a fifth of a server
        process's CPU and twice that many statements for PostgreSQL per transition with
        two processes.
        """
        return bool(self.subscribers) or self.leading or any(demand() for demand in self.demands)

    async def current(self) -> Cursor:
        """Read what the relay left unread, if anything; return its head.

        A stream calls this before it starts: its replay runs up to the head, and what
        commits after it reaches the stream live, since a relay with a stream open reads
        on every notification.
        """
        if self.unread:
            # One reader at a time, and only it takes a connection of the (small) pool:
            # the streams that open meanwhile find the events read when they get the lock.
            async with self._reading:
                if self.unread:
                    self.unread = False
                    try:
                        pool = await self.open_pool()
                        async with pool.connection() as conn:
                            held_back = await self._catch_up(conn)
                    except BaseException:
                        self.unread = True
                        raise
                    # Events held back behind an older transaction stay unread: the loop,
                    # which waits at most IDLE_READ_SECONDS while any are, reads them.
                    # (A notification heard during this read has set unread meanwhile.)
                    self.unread = self.unread or held_back
        assert self.head is not None
        return self.head

    async def _read_unread(self) -> None:
        try:
            await self.current()
        except Exception as exc:  # the loop reads them later, or after its reconnect
            logger.warning("relay: could not read the unread events now: %s", exc)

    def coalesce_window(self) -> float:
        """Seconds to wait for more commits before a read: none for a few subscribers, up
        to 20 ms for a thousand, where writing to every stream per event costs the most."""
        return min(0.02, len(self.subscribers) / 50_000) if len(self.subscribers) > 50 else 0.0

    def _deliver(self, events: list[StreamEvent]) -> None:
        for event in events:
            object.__setattr__(event, "buffered_in", self)
            self.held_bytes += event.size
        self.buffer.extend(events)
        self._trim()
        self.head = events[-1].cursor
        for subscriber in self.subscribers:
            subscriber.offer(events)
        for listener in list(self.listeners):
            try:
                listener(events)
            except Exception:
                logger.exception("relay: a listener failed")

    def resized(self, change: int) -> None:
        """A buffered event was encoded, and now takes ``change`` bytes more (or fewer)."""
        self.held_bytes += change
        self._trim()

    def _trim(self) -> None:
        """Forget the oldest events until the buffer is within its bounds."""
        while self.buffer and (
            len(self.buffer) > self.buffer_size or self.held_bytes > self.buffer_bytes
        ):
            oldest = self.buffer.popleft()
            object.__setattr__(oldest, "buffered_in", None)
            self.held_bytes -= oldest.size
            self.buffer_floor = oldest.cursor

    # -- consumers ------------------------------------------------------------------------

    def subscribe(self) -> Subscriber:
        """Register a subscriber to every event after the current head."""
        assert self.head is not None, "start() the relay first"
        subscriber = Subscriber(self.head, self.subscriber_queue)
        self.subscribers.add(subscriber)
        if self.unread and self._reading_unread is None:
            # Notified between the stream's current() and now, while nobody listened: read
            # it now rather than at the next idle read.
            self._reading_unread = asyncio.ensure_future(self._read_unread())
            self._reading_unread.add_done_callback(self._read_unread_done)
        return subscriber

    def _read_unread_done(self, task: asyncio.Future[None]) -> None:
        self._reading_unread = None

    def unsubscribe(self, subscriber: Subscriber) -> None:
        self.subscribers.discard(subscriber)

    def resume(self, subscriber: Subscriber) -> Cursor:
        """Queue events for a lagging subscriber again; return the head it must replay to."""
        assert self.head is not None
        subscriber.drain()
        subscriber.lagging = False
        return self.head

    async def replay(self, after: Cursor, upto: Cursor) -> AsyncIterator[list[StreamEvent]]:
        """Yield the events after ``after`` up to ``upto`` in pages, from memory when
        possible, else from the database (a pooled connection held for one page only)."""
        position = after
        while position < upto:
            page = self._from_buffer(position, upto)
            if page is None:
                page = await self._from_database(position, upto)
            if not page:
                return
            yield page
            position = page[-1].cursor

    def _from_buffer(self, after: Cursor, upto: Cursor) -> list[StreamEvent] | None:
        if self.buffer_floor is None or after < self.buffer_floor:
            return None
        events = list(self.buffer)
        cursors = [event.cursor for event in events]
        low = bisect.bisect_right(cursors, after)
        return events[low : min(bisect.bisect_right(cursors, upto), low + self.batch)]

    async def _from_database(self, after: Cursor, upto: Cursor) -> list[StreamEvent]:
        async with self.pool().connection() as conn:
            # Everything up to the relay's head was read below a horizon already.
            return await self._read(conn, after, upto, str(END.txid))

    async def _read(
        self, conn: psycopg.AsyncConnection[Any], after: Cursor, upto: Cursor, horizon: str
    ) -> list[StreamEvent]:
        """Read one page of events after ``after``, up to ``upto``, below ``horizon``."""
        cur = await self._execute(
            conn,
            QUERIES["stream_after"],
            {
                "txid": str(after.txid),
                "id": after.id,
                "upto_txid": str(upto.txid),
                "upto_id": upto.id,
                "horizon": horizon,
                "limit": self.batch,
                "read_bytes": READ_BYTES,
            },
        )
        return [_stream_event(row) for row in await cur.fetchall()]

    async def cursor_of(self, event_id: int) -> Cursor | None:
        """Return the cursor of the event ``event_id``, or None if there is no such event.

        Id 0 names the start of the log: a client that has seen nothing yet (a page drawn
        from an empty log) is replayed everything.
        """
        if event_id == 0:
            return START
        for event in reversed(self.buffer):
            if event.cursor.id == event_id:
                return event.cursor
        async with self.pool().connection() as conn:
            cur = await self._execute(conn, QUERIES["stream_cursor_of"], {"id": event_id})
            row = await cur.fetchone()
        return Cursor(int(row["txid"]), row["id"]) if row else None

    def pool(self) -> AsyncConnectionPool:
        """Return the small pool used to replay what is no longer in memory."""
        if self._pool is None:
            self._pool = AsyncConnectionPool(
                self.conninfo,
                min_size=0,
                max_size=2,
                max_idle=60,
                open=False,
                name="taskboard-replay",
            )
        return self._pool

    async def open_pool(self) -> AsyncConnectionPool:
        pool = self.pool()
        if pool.closed:
            await pool.open()
        return pool


_relays: dict[asyncio.AbstractEventLoop, Relay] = {}


# Who hears what every relay of this process hears beside events: registered once at start
# (their app's ready()), so that the relay imports none of those who listen to it.
_credential_listeners: set[Callable[[int | None], None]] = set()
_auth_failure_listeners: set[Callable[[str | None], None]] = set()


def on_credentials_changed(listener: Callable[[int | None], None]) -> None:
    """Have ``listener`` told of each announced change of an account's credentials (its
    user id; None: anyone's may have changed), by every relay started after this."""
    _credential_listeners.add(listener)


def on_auth_failure(listener: Callable[[str | None], None]) -> None:
    """Have ``listener`` told of each announced first failed authentication of an address
    in a throttle window (None: any address may have failed), by every relay started after
    this."""
    _auth_failure_listeners.add(listener)


async def get_relay() -> Relay:
    """Return this process's relay (one per event loop), starting it on first use."""
    loop = asyncio.get_running_loop()
    relay = _relays.get(loop)
    if relay is None:
        conninfo = await sync_to_async(django_conninfo)()
        # Behind Pushpin (GRIP_URL), every process's relay competes to publish (board.live.grip).
        leader_key = LEADER_LOCK if conf.grip_url() else None
        relay = _relays.get(loop)
        if relay is None:
            relay = _relays[loop] = Relay(
                conninfo,
                buffer_bytes=conf.stream_buffer_bytes(),
                leader_key=leader_key,
            )
            relay.credential_listeners.update(_credential_listeners)
            relay.auth_failure_listeners.update(_auth_failure_listeners)
    await relay.start()
    await relay.open_pool()
    return relay


def running_relays() -> list[Relay]:
    """Return the relays of this process (one per event loop), for /metrics (board.ops.metrics),
    which reads their cursor and state from a worker thread."""
    return list(_relays.values())


async def stop_relays() -> None:
    """Stop the relay of the running event loop, ending its streams (ASGI shutdown)."""
    relay = _relays.pop(asyncio.get_running_loop(), None)
    if relay is not None:
        await relay.stop()
