"""History does not slow claims: claim latency with a large history of finished tasks and
events, against a small one.

One agent claims (timed) and completes (not timed) tasks one after another with
board.transitions, first with 1,000 finished tasks in the table, then again after a bulk
load brings it to 1,000,000 finished tasks and 1,000,000 events (100,000 each with
--quick). Both phases start from the same number of pending tasks, freshly vacuumed and
analyzed, as a long-lived table would be.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.harness import (
    Database,
    ScenarioResult,
    create_agents,
    insert_tasks,
    percentile,
    ratio,
)

TITLE = "History does not slow claims (1 agent, claim latency)"
TARGET = 1.2
SMALL = 1_000
CHUNK = 100_000

# One event per finished task: the volume is what matters to the claim's indexes.
INSERT_EVENTS = """
INSERT INTO task_events (task_id, type, status, actor, payload, created_at)
SELECT id, 'completed', 'done', created_by, '{"result": {"ok": true}}'::jsonb, now()
FROM tasks
WHERE status = 'done' AND id > %(after)s
ORDER BY id
"""


def load_history(database: Database, count: int, created_by: str, progress: Any) -> None:
    """Add ``count`` finished tasks and as many events, in chunks, without a NOTIFY each
    (nothing listens here, and a million notifications would only fill the queue)."""
    with database.connect() as conn:
        conn.execute("ALTER TABLE task_events DISABLE TRIGGER task_events_notify_insert")
        try:
            loaded = 0
            while loaded < count:
                size = min(CHUNK, count - loaded)
                row = conn.execute("SELECT coalesce(max(id), 0) FROM tasks").fetchone()
                after = row[0] if row else 0
                with conn.transaction():
                    conn.execute(
                        _insert_tasks_sql(),
                        {"status": "done", "count": size, "created_by": created_by},
                    )
                    conn.execute(INSERT_EVENTS, {"after": after})
                loaded += size
                progress(f"  history: {loaded:,} of {count:,} finished tasks and events")
        finally:
            conn.execute("ALTER TABLE task_events ENABLE TRIGGER task_events_notify_insert")


def _insert_tasks_sql() -> str:
    from benchmarks.harness import INSERT_TASKS

    return INSERT_TASKS


def claim_latencies(
    actor: str, count: int, *, queues: list[str] | None = None, warm: int = 0
) -> list[float]:
    """Claim (timed) and complete ``count`` tasks one by one, after ``warm`` untimed ones
    on the same connection; return latencies in ms."""
    from django.db import connection

    from board import transitions

    latencies = []
    try:
        for number in range(warm + count):
            started = time.perf_counter()
            claims = transitions.claim(actor=actor, queues=queues, lease_seconds=300)
            if number >= warm:
                latencies.append((time.perf_counter() - started) * 1000)
            if not claims:
                raise RuntimeError("ran out of pending tasks")
            transitions.complete(
                task_id=claims[0].task.pk, actor=actor, lease_token=claims[0].lease_token
            )
    finally:
        connection.close()
    return latencies


def phase(database: Database, actor: str, claims: int, progress: Any, label: str) -> list[float]:
    insert_tasks(database, claims + 300, created_by=actor)
    database.execute("VACUUM ANALYZE tasks")
    database.execute("VACUUM ANALYZE task_events")
    claim_latencies(actor, min(200, claims // 5))  # warm up: connection, caches
    progress(f"{label}: timing {claims:,} claims")
    latencies = claim_latencies(actor, claims)
    progress(f"  p50 {percentile(latencies, 50):.2f} ms, p99 {percentile(latencies, 99):.2f} ms")
    return latencies


def run(ctx: Any, result: ScenarioResult) -> None:
    large = ctx.pick(100_000, 1_000_000)
    claims = ctx.pick(500, 3_000)
    with ctx.database("history") as database:
        actor = create_agents(1)[0][0]
        load_history(database, SMALL, actor, lambda _: None)
        small_latencies = phase(database, actor, claims, ctx.progress, f"{SMALL:,} finished")
        ctx.progress(f"loading {large:,} finished tasks and {large:,} events")
        load_history(database, large - SMALL, actor, ctx.progress)
        large_latencies = phase(database, actor, claims, ctx.progress, f"{large:,} finished")
        sizes = database.execute(
            "SELECT (SELECT count(*) FROM tasks), (SELECT count(*) FROM task_events)"
        )[0]
    small_p50, small_p99 = percentile(small_latencies, 50), percentile(small_latencies, 99)
    large_p50, large_p99 = percentile(large_latencies, 50), percentile(large_latencies, 99)
    label = f"{large // 1000:,}k" if large < 1_000_000 else f"{large // 1_000_000}M"
    result.add(f"claim p50, {SMALL:,} finished", small_p50, "ms")
    result.add(f"claim p50, {label} finished + {label} events", large_p50, "ms")
    result.add("claim p50 ratio (large / small)", ratio(large_p50, small_p50), "x", f"<= {TARGET}")
    result.add(f"claim p99, {SMALL:,} finished", small_p99, "ms")
    result.add(f"claim p99, {label} finished + {label} events", large_p99, "ms")
    result.add("claim p99 ratio (large / small)", ratio(large_p99, small_p99), "x", f"<= {TARGET}")
    result.note(
        f"{claims:,} sequential transitions.claim calls per phase (each followed by an untimed "
        f"complete); tables at the end: {sizes[0]:,} tasks, {sizes[1]:,} events"
        + ("; --quick: 100k instead of 1M" if ctx.quick else "")
    )
