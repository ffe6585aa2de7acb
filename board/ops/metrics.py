"""``GET /metrics``: the board in Prometheus' text format, with the official client library.

Two kinds of figures, and where each comes from:

- **The board's** (tasks by queue and status, each queue's oldest pending task, events by
  type) are read from the database at each scrape, from the counters that the triggers
  keep in step with every transition (board/sql/queues.sql, the same rows ``GET queues/``
  sums; ``event_counters``, migration 0013): a few counter rows and one index step per
  queue, never a scan of tasks or of the event log. They are the whole board's, so every
  server process answers the same, whichever one a scrape reaches.
- **The server processes'**: claim latency is observed in the process that made each
  claim; under ``serve --workers N`` (a scrape reaches one process of N) the workers add
  it up through prometheus_client's multiprocess mode (taskboard.server), so any worker
  answers for all. Waiting claims, open streams and relay lag describe the process that
  answers (docs/reference/metrics.md says so). Events by type are counted by the database (migration
  0013), not by each process's relay, so that they too are the same from every process.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from django.db import connection
from django.http import HttpResponse
from django.utils.dateparse import parse_datetime
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from rest_framework.permissions import BasePermission
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.request import Request
from rest_framework.views import APIView

from board import conf
from board import queues as board_queues
from board.notifications.deliveries import delivery_counts
from board.sql import QUERIES

# Observed by the claim's view (board.api.views), which every claim comes through: the API,
# a waiting claim's attempts, MCP tools, the board's pages. Claims are a few milliseconds
# when the database is well; the buckets reach into seconds for when it is not.
CLAIM_SECONDS = Histogram(
    "taskboard_claim_duration_seconds",
    "Time to make one claim (every round of its statement), in seconds.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)


# Observed by the answer's view: from the question to its answer, in seconds. People answer
# in minutes to days.
ANSWER_SECONDS = Histogram(
    "taskboard_question_answer_seconds",
    "Time from an agent's question to a person's answer, in seconds.",
    buckets=(10, 30, 60, 300, 900, 1800, 3600, 4 * 3600, 12 * 3600, 86400, 3 * 86400, 7 * 86400),
)

# The event counters' key for escalations of questions nobody answered in time
# (board/sql/schema/counters.sql), reported apart from the event types.
UNANSWERED = "unanswered"


def observe_answer(answered: dict[str, Any]) -> None:
    """Count one answer's time to answer (an entry of a task's ``answers``)."""
    asked, answered_at = (
        parse_datetime(str(answered.get(key) or "")) for key in ("asked_at", "answered_at")
    )
    if asked is not None and answered_at is not None:
        ANSWER_SECONDS.observe(max((answered_at - asked).total_seconds(), 0.0))


@dataclass
class RelayState:
    connected: bool
    lag_seconds: float


@dataclass
class Snapshot:
    """Everything one scrape reports, read before any of it is written out, so that a
    database outage answers 503 rather than half a page."""

    queues: list[dict[str, object]]
    event_counts: dict[str, int]
    now: float
    relays: list[RelayState] = field(default_factory=list)
    waiting_claims: int = 0
    open_streams: int = 0
    deliveries: dict[str, int] = field(default_factory=dict)


def _relay_states() -> list[RelayState]:
    """The relay of each event loop of this process (one, under ``serve``), if started.

    This runs in a worker thread while the relay runs on the event loop: it only reads
    the relay's cursor (one reference, replaced whole on each delivery) and its flag.
    """
    from board.live.relay import running_relays

    states = []
    for relay in running_relays():
        head = relay.head
        if head is None:
            continue
        with connection.cursor() as cursor:
            cursor.execute(QUERIES["relay_behind"], {"txid": str(head.txid), "id": head.id})
            row = cursor.fetchone()
        lag = float(row[0]) if row and row[0] is not None else 0.0
        states.append(RelayState(relay.connected.is_set(), max(lag, 0.0)))
    return states


def _waiting_claims() -> int:
    from board.live.relay import running_relays

    total = 0
    for relay in running_relays():
        room = getattr(relay, "waiting_room", None)
        if room is not None:
            total += len(room.waiters)
    return total


def _open_streams() -> int:
    from board.live.stream import open_stream_count

    return open_stream_count()


def snapshot() -> Snapshot:
    """Read what a scrape reports: the counters from the database, the rest in memory."""
    queues = board_queues.queue_list()
    with connection.cursor() as cursor:
        cursor.execute(QUERIES["event_counts"])
        event_counts = {str(type_): int(count) for type_, count in cursor.fetchall()}
    return Snapshot(
        queues=queues,
        event_counts=event_counts,
        now=time.time(),
        relays=_relay_states(),
        waiting_claims=_waiting_claims(),
        open_streams=_open_streams(),
        deliveries=delivery_counts(),
    )


def webhook_delivery_families(counts: dict[str, int]) -> Iterable[Metric]:
    """Webhook and email deliveries by result: attempts delivered, retried (failed, to be
    tried again) and failed (given up after the horizon) as a counter, and the deliveries
    waiting now as a gauge (board.notifications.deliveries.delivery_counts: a three-row table
    and the partial index of pending deliveries)."""
    results = CounterMetricFamily(
        "taskboard_webhook_deliveries",
        "Webhook and email delivery attempts by result: delivered, retried (failed, tried "
        "again later) or failed (given up after the horizon).",
        labels=["result"],
    )
    for result in ("delivered", "retried", "failed"):
        results.add_metric([result], counts.get(result, 0))
    yield results
    yield GaugeMetricFamily(
        "taskboard_webhook_deliveries_pending",
        "Webhook and email deliveries waiting to be made (due now or retried later).",
        value=counts.get("pending", 0),
    )


class BoardCollector(Collector):
    """The figures of one :class:`Snapshot`, as metric families."""

    def __init__(self, snap: Snapshot) -> None:
        self.snap = snap

    def describe(self) -> Iterable[Metric]:
        return ()

    def collect(self) -> Iterable[Metric]:
        snap = self.snap
        tasks = GaugeMetricFamily(
            "taskboard_tasks",
            "Tasks by queue and status (blocked: pending but waiting for a dependency), "
            "as GET /api/v1/queues/ counts them.",
            labels=["queue", "status"],
        )
        oldest = GaugeMetricFamily(
            "taskboard_oldest_pending_task_age_seconds",
            "Age of each queue's oldest claimable pending task (0 when it has none).",
            labels=["queue"],
        )
        paused = GaugeMetricFamily(
            "taskboard_queue_paused", "1 when the queue is paused, else 0.", labels=["queue"]
        )
        for queue in snap.queues:
            name = str(queue["name"])
            counts = queue["counts"]
            assert isinstance(counts, dict)
            for status, count in counts.items():
                tasks.add_metric([name, status], count)
            since = queue["oldest_pending_at"]
            age = snap.now - since.timestamp() if since is not None else 0.0  # type: ignore[attr-defined]
            oldest.add_metric([name], max(age, 0.0))
            paused.add_metric([name], 1.0 if queue["paused"] else 0.0)
        yield from (tasks, oldest, paused)

        events = CounterMetricFamily(
            "taskboard_events",
            "Events written to the task log, by type (kept by the database: the same "
            "from every server process).",
            labels=["type"],
        )
        for type_, count in sorted(snap.event_counts.items()):
            if type_ != UNANSWERED:
                events.add_metric([type_], count)
        yield events
        yield CounterMetricFamily(
            "taskboard_questions_unanswered",
            "Questions escalated because nobody answered them by their deadline.",
            value=snap.event_counts.get(UNANSWERED, 0),
        )
        questions = GaugeMetricFamily(
            "taskboard_questions_open",
            "Tasks awaiting a person's answer, by queue.",
            labels=["queue"],
        )
        for queue in snap.queues:
            counts = queue["counts"]
            assert isinstance(counts, dict)
            questions.add_metric([str(queue["name"])], counts.get("awaiting_input", 0))
        yield questions

        yield GaugeMetricFamily(
            "taskboard_waiting_claims",
            "Claims with wait waiting for work in this server process.",
            value=snap.waiting_claims,
        )
        yield GaugeMetricFamily(
            "taskboard_open_streams",
            "Open event streams (GET /api/v1/stream/) in this server process.",
            value=snap.open_streams,
        )
        connected = GaugeMetricFamily(
            "taskboard_relay_connected",
            "1 when this process's event relay holds its LISTEN connection (absent until "
            "the relay has started, with the server).",
        )
        lag = GaugeMetricFamily(
            "taskboard_relay_lag_seconds",
            "Age of the oldest committed event that this process's relay has not passed on "
            "to streams and waiting claims yet (0 when it is up to date). A relay with no "
            "stream or waiting claim in its process reads once a second: up to a second "
            "there is normal.",
        )
        for relay in snap.relays[:1]:
            connected.add_metric([], 1.0 if relay.connected else 0.0)
            lag.add_metric([], relay.lag_seconds)
        yield from (connected, lag)
        yield from webhook_delivery_families(snap.deliveries)


class _Scrape(Collector):
    """The processes' own metrics (the claim histogram; in one process, also the library's
    process and platform collectors) and the board's, as one registry for generate_latest.

    Under ``serve --workers N`` (taskboard.server sets PROMETHEUS_MULTIPROC_DIR), every
    worker keeps its histogram in a file of that directory, and this sums them: whichever
    worker a scrape reaches, it counts every worker's claims.
    """

    def __init__(self, snap: Snapshot) -> None:
        self.board = BoardCollector(snap)

    def collect(self) -> Iterable[Metric]:
        if conf.prometheus_multiproc_dir():
            shared = CollectorRegistry()
            multiprocess.MultiProcessCollector(shared)  # type: ignore[no-untyped-call]
            yield from shared.collect()
        else:
            yield from REGISTRY.collect()
        yield from self.board.collect()


def exposition() -> bytes:
    """Return the whole scrape in Prometheus' text format (a database error propagates)."""
    return generate_latest(_Scrape(snapshot()))


class MayScrape(BasePermission):
    """Staff, or anyone when TASKBOARD_METRICS_PUBLIC is set (a scraper inside a private
    network, where handing Prometheus a staff token is more trouble than it is worth)."""

    message = (
        "Only staff not limited to queues may read the metrics "
        "(or set TASKBOARD_METRICS_PUBLIC=true)."
    )

    def has_permission(self, request: Request, view: Any) -> bool:
        from board.access import queue_access

        if conf.metrics_public():
            return True
        # The metrics count every queue's tasks: staff limited to queues do not see the
        # others' (board.access).
        user = request.user
        return bool(user.is_authenticated and user.is_staff and not queue_access(user).limited)


class MetricsView(APIView):
    """``GET /metrics``: authenticated as the API is (a Bearer token, or a staff session),
    refused with the API's JSON 401 and 403, and 503 while the database is away."""

    permission_classes = [MayScrape]
    schema = None  # outside /api/v1/: not part of the API's OpenAPI document

    def perform_content_negotiation(
        self, request: Request, force: bool = False
    ) -> tuple[BaseRenderer, str]:
        """Answer whatever the scraper accepts: the scrape is always Prometheus' text format
        (written by prometheus_client) and a refusal always the API's JSON. DRF would
        otherwise answer 406 to ``Accept: text/plain; version=0.0.4`` (which Prometheus
        sends, with ``*/*`` only as a fallback, and other scrapers send alone)."""
        renderer = JSONRenderer()
        return renderer, renderer.media_type

    def get(self, request: Request) -> HttpResponse:
        return HttpResponse(exposition(), content_type=CONTENT_TYPE_LATEST)
