"""Claims that wait for work: ``POST /api/v1/tasks/claim/`` with ``wait`` > 0.

A waiting claim must not cost a thread or a database connection while it waits, so that
hundreds of idle agents can wait on one small server: 200 claims waiting at once hold no
connection beyond those the server's worker threads keep anyway, and no thread
(tests/test_waiting.py), where under Django's handler each would keep a thread of its own
for as long as it waits (as a stream does: board.live.stream). The waiting therefore happens here,
in ASGI middleware in front of Django, between claim attempts that each go through Django
as an ordinary, short request (authentication, validation, the claim statement):

1. The claim is attempted at once. If it returns tasks, fails, or has no ``wait``, that is
   the answer.
2. Otherwise the request waits in this process's :class:`WaitingRoom` until it is woken or
   its time is up, then tries again. It is woken by the relay (board.live.relay), which reads
   every committed event after its NOTIFY: an event that leaves a task pending (created,
   released, failed, requeued, expired, unblocked) wakes the longest-waiting claim for that
   queue. A queue that is resumed (its own notification) wakes every claim waiting on it.
   One new task wakes one waiter, the others keep waiting; a waiter that finds the task
   gone (another agent was faster) waits again at its place in line.
3. Work can also become claimable without an event: a ``run_after`` coming due, or a
   lease running out. An empty attempt reports when that next happens for its queues,
   and the waiter wakes itself then. While claims wait, the room also sets a timer for
   each lease and ``run_after`` that the relay reports.

4. An agent limited to queues (board.access) waits only for its own: an empty attempt
   reports the queues the claim took from, and the waiter is woken for those alone, so
   that it never takes a wake-up meant for a claim that may have the task.

What travels between the waiter and the claim view does so once, in the request's ASGI
scope (a2wsgi hands it to Django as ``environ["asgi.scope"]``), as objects in the process,
never headers on the wire:

- the body, parsed here once (:class:`~board.http.asgi_tools.JSONBody`), which the API's
  parser takes instead of parsing it again at each attempt;
- the Host, checked once in front of everything (taskboard.asgi), which Django's request
  takes as checked (board.http.middleware.CheckedHostRequest);
- back from the view, a :class:`ClaimReport` per attempt: whether it claimed nothing, and
  then (3) and (4). A claim that no waiter sent (no report) reports nothing and costs no
  query for it.

The waiter joins the room before its first attempt, so a task committed while an attempt
runs still wakes it: no wake-up is lost between an empty attempt and the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings

from board import conf
from board.http.asgi_tools import (
    JSON_BODY_KEY,
    JSONBody,
    Message,
    Receive,
    Scope,
    Send,
    closing,
    parse_json,
    read_body,
    replaying,
    until_disconnect,
)
from board.live.relay import Relay, StreamEvent, get_relay

logger = logging.getLogger(__name__)

CLAIM_PATH = "/api/v1/tasks/claim/"
SCOPE_KEY = "taskboard.claim_report"
# Events after which the task is pending (and so possibly claimable) again.
RETURNS_TO_PENDING = {
    "created",
    "released",
    "failed",
    "requeued",
    "expired",
    "unblocked",
    "answered",
}
LEASE_EVENTS = {"claimed", "heartbeat"}

_sequence = itertools.count()


@dataclass
class ClaimReport:
    """What the claim view reports to the waiter about one attempt."""

    # Whether it claimed nothing (then the fields below are filled in).
    empty: bool = False
    # When work next becomes claimable in its queues without an event (a time.time()).
    next_claimable: float | None = None
    # The queues the claim took from, when its agent is limited to queues.
    queues: frozenset[str] | None = None


def claim_report(request: Any) -> ClaimReport | None:
    """The waiter's ClaimReport for this claim request, or None when no waiter sent it."""
    scope = getattr(request, "scope", None) or request.META.get("asgi.scope") or {}
    report = scope.get(SCOPE_KEY)
    return report if isinstance(report, ClaimReport) else None


@dataclass(eq=False)
class Waiter:
    queues: frozenset[str] | None  # None: every queue
    seq: int = field(default_factory=lambda: next(_sequence))
    woken: asyncio.Event = field(default_factory=asyncio.Event)
    woken_for: str | None = None

    def wants(self, queue: str) -> bool:
        return self.queues is None or queue in self.queues


class WaitingRoom:
    """The claims waiting in this process, in arrival order, and what wakes them."""

    def __init__(self, relay: Relay) -> None:
        self.waiters: list[Waiter] = []
        self._timers: dict[tuple[int, float], asyncio.TimerHandle] = {}
        relay.listeners.add(self.on_events)
        relay.demands.add(self.waiting)
        relay.queue_listeners.add(self.wake_all)

    def waiting(self) -> bool:
        """Whether a claim waits here: the relay then reads each event as it commits."""
        return bool(self.waiters)

    def enter(self, queues: frozenset[str] | None) -> Waiter:
        waiter = Waiter(queues)
        self.waiters.append(waiter)
        return waiter

    def leave(self, waiter: Waiter) -> None:
        with contextlib.suppress(ValueError):
            self.waiters.remove(waiter)
        if waiter.woken.is_set() and waiter.woken_for is not None:
            # Woken for a task it did not take: pass the wake-up on.
            self.wake_one(waiter.woken_for)

    async def wait(self, waiter: Waiter, until: float) -> None:
        """Wait until woken or ``until`` (a time.time()), whichever comes first."""
        timeout = until - time.time()
        if timeout > 0 and not waiter.woken.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waiter.woken.wait(), timeout)
        waiter.woken.clear()
        waiter.woken_for = None

    def narrow(self, waiter: Waiter, queues: frozenset[str]) -> None:
        """Wake ``waiter`` only for ``queues`` from now on: the queues its claim takes from.

        An agent limited to queues (board.access) may ask without naming any; Django's
        answer to its first attempt says which it gets. A wake-up that came in for another
        queue before then is passed on, not lost.
        """
        waiter.queues = queues
        if waiter.woken_for is not None and not waiter.wants(waiter.woken_for):
            queue, waiter.woken_for = waiter.woken_for, None
            waiter.woken.clear()
            self.wake_one(queue)

    def wake_one(self, queue: str) -> None:
        """Wake the longest-waiting claim that wants ``queue`` and is not awake already."""
        for waiter in self.waiters:
            if waiter.wants(queue) and not waiter.woken.is_set():
                waiter.woken_for = queue
                waiter.woken.set()
                return

    def wake_all(self, queue: str) -> None:
        """Wake every claim waiting for ``queue`` (it was resumed): each tries again."""
        for waiter in self.waiters:
            if waiter.wants(queue) and not waiter.woken.is_set():
                waiter.woken_for = queue
                waiter.woken.set()

    def on_events(self, events: list[StreamEvent]) -> None:
        """Relay listener: wake waiters for work that became (or will become) claimable."""
        if not self.waiters:
            return
        now = time.time()
        for event in events:
            if event.type in RETURNS_TO_PENDING and event.status == "pending":
                due = event.run_after.timestamp() if event.run_after else now
                # A task that only some may claim wakes every waiter of its queue: the
                # longest-waiting one may not be among them.
                self._at(due, event.task_id, event.queue, every=event.restricted)
                if event.held_until is not None and event.held_until.timestamp() > due:
                    # When the hold for the asker ends, anyone may claim it.
                    self._at(event.held_until.timestamp(), event.task_id, event.queue, every=True)
            elif event.type in LEASE_EVENTS and event.leased_until is not None:
                self._at(event.leased_until.timestamp(), event.task_id, event.queue)
            elif event.type == "asked" and event.answer_by is not None:
                # Unanswered by then, the question is escalated by the claim this wakes.
                self._at(event.answer_by.timestamp(), event.task_id, event.queue)

    def _at(self, when: float, task_id: int, queue: str, *, every: bool = False) -> None:
        wake = self.wake_all if every else self.wake_one
        delay = when - time.time()
        if delay <= 0:
            wake(queue)
            return
        key = (task_id, when)
        if key in self._timers:
            return
        loop = asyncio.get_running_loop()

        def fire() -> None:
            self._timers.pop(key, None)
            wake(queue)

        # A lease timer may find the lease extended by then: the woken claim finds nothing
        # and waits again, at its place in line.
        self._timers[key] = loop.call_later(delay + 0.01, fire)


async def waiting_room() -> WaitingRoom:
    relay = await get_relay()
    room: WaitingRoom | None = getattr(relay, "waiting_room", None)
    if room is None:
        room = WaitingRoom(relay)
        relay.waiting_room = room  # type: ignore[attr-defined]
    return room


def parse_wait(data: Any) -> tuple[float, frozenset[str] | None] | None:
    """Return (wait seconds, queues) if the parsed body asks to wait, else None.

    Only the two fields that matter here are read; Django validates the whole body on each
    attempt and answers 400 for anything wrong, which ends the wait.
    """
    if not isinstance(data, dict):
        return None
    wait, queues = data.get("wait", 0), data.get("queues")
    if isinstance(wait, bool) or not isinstance(wait, int | float) or wait <= 0:
        return None
    if queues is not None and not (
        isinstance(queues, list) and all(isinstance(q, str) for q in queues)
    ):
        return None
    return min(float(wait), conf.MAX_WAIT_SECONDS), (frozenset(queues) if queues else None)


@dataclass
class CapturedResponse:
    start: Message
    body: bytes

    @property
    def status(self) -> int:
        return int(self.start["status"])

    async def send_to(self, send: Send) -> None:
        await send(self.start)
        await send({"type": "http.response.body", "body": self.body})


class WaitingClaims:
    """ASGI middleware: hold claims with ``wait`` > 0 between attempts, without a thread."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not (
            scope["type"] == "http" and scope["method"] == "POST" and scope["path"] == CLAIM_PATH
        ):
            await self.app(scope, receive, send)
            return
        # A foreign Host was refused in front (taskboard.asgi), before the claim could join
        # the room or start the relay. RequestBodyLimit, in front, has read the body
        # already: this returns it at once.
        body = await read_body(receive, conf.MAX_BODY_BYTES)
        if body is None:
            return
        try:
            parsed = JSONBody(settings.DEFAULT_CHARSET, parse_json(body, settings.DEFAULT_CHARSET))
        except (ValueError, RecursionError):
            # Django answers why (400), parsing it as it parses any body.
            await self.app(scope, replaying(body, receive), send)
            return
        scope = {**scope, JSON_BODY_KEY: parsed}
        request = parse_wait(parsed.data)
        if request is None:
            await self.app(scope, replaying(body, receive), send)
            return
        wait, queues = request
        deadline = time.time() + wait
        try:
            room = await waiting_room()
        except Exception as exc:  # no relay (database down): claim once, without waiting
            logger.warning("waiting claims: relay unavailable (%s); not waiting", exc)
            await self.app(scope, replaying(body, receive), send)
            return

        waiter = room.enter(queues)
        disconnected = asyncio.ensure_future(until_disconnect(receive))
        # A server shutting down answers what it has (nothing) at once: the agent claims
        # again, from another server or this one restarted.
        shutdown = asyncio.ensure_future(closing().wait())
        try:
            while True:
                report = ClaimReport()
                response = await self._attempt({**scope, SCOPE_KEY: report}, body)
                if report.queues is not None:
                    room.narrow(waiter, report.queues)
                claimed_nothing = response.status == 200 and report.empty
                if not claimed_nothing or time.time() >= deadline or shutdown.done():
                    await response.send_to(send)
                    return
                until = deadline
                if report.next_claimable is not None:
                    until = min(until, report.next_claimable + 0.01)
                waiting = asyncio.ensure_future(room.wait(waiter, until))
                await asyncio.wait(
                    {waiting, disconnected, shutdown}, return_when=asyncio.FIRST_COMPLETED
                )
                if disconnected.done():
                    waiting.cancel()
                    return
                if shutdown.done():
                    waiting.cancel()
                    await response.send_to(send)
                    return
        finally:
            disconnected.cancel()
            shutdown.cancel()
            room.leave(waiter)

    async def _attempt(self, scope: Scope, body: bytes) -> CapturedResponse:
        """Run one claim through Django and capture its response."""
        start: Message = {}
        chunks: list[bytes] = []

        async def capture(message: Message) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.app(scope, replaying(body, _never), capture)
        return CapturedResponse(start, b"".join(chunks))


async def _never() -> Message:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")
