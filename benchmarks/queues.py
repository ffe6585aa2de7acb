"""Queue counts do not scan finished tasks: ``GET /api/v1/queues/`` latency with 1,000,000
finished tasks, against the same request with 10.

Two scratch databases cloned from the same template hold the same five queues, each with
a few pending tasks (so that every queue has an oldest pending task to report) and two
finished ones. One of them then gets 1,000,000 finished tasks more (100,000 with
--quick), done and cancelled, spread over the same queues and loaded in bulk SQL in chunks;
the queue counters, kept by statement triggers on ``tasks``, count them as they are
inserted. Both are vacuumed and analyzed, as a long-lived table would be.

A ``taskboard serve`` runs on each database. One client sends ``GET queues/`` through
the HTTP API, one request at a time on a keep-alive connection to each server, alternating
between the two servers request by request (a busy neighbour on the machine slows both
alike), after warming both up. At the end, each server's answer must equal a ``COUNT(*)``
of its tasks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from benchmarks.harness import (
    Database,
    ScenarioResult,
    count_label,
    create_agents,
    percentile,
    queue_count_mismatches,
    ratio,
)

TITLE = "Queue counts do not scan finished tasks (GET queues/ latency)"
TARGET = 1.2
QUEUES = ["default", "email", "images", "reports", "billing"]
PENDING = 4  # per queue
SMALL = 2  # finished tasks per queue in both databases: 10 in all
CHUNK = 100_000


@dataclass(frozen=True)
class Sizes:
    finished: int
    requests: int  # timed requests per server
    warm: int  # untimed requests per server first


FULL = Sizes(finished=1_000_000, requests=2_000, warm=100)
QUICK = Sizes(finished=100_000, requests=400, warm=50)

# ``count`` tasks with the given status, round robin over the queues (``finished``: one in
# ten cancelled, in every queue, the others done).
INSERT_TASKS = """
INSERT INTO tasks (
    title, description, payload, queue, priority, max_failures, status, failure_count,
    created_by, created_at, updated_at, result
)
SELECT 'bench ' || g, '', '{}'::jsonb, q.names[1 + g %% cardinality(q.names)], 0, 3,
       s.status, 0, %(created_by)s, now(), now(),
       CASE WHEN s.status = 'done' THEN '{"ok": true}'::jsonb END
FROM generate_series(1, %(count)s) g,
     (SELECT %(queues)s::text[] AS names) q,
     LATERAL (SELECT CASE
         WHEN %(status)s <> 'finished' THEN %(status)s
         WHEN (g / 5) %% 10 = 0 THEN 'cancelled'
         ELSE 'done' END AS status) s
"""


def load(database: Database, count: int, status: str, created_by: str, progress: Any) -> None:
    """Insert ``count`` tasks spread over QUEUES in chunks (``finished``: one in ten
    cancelled, the others done)."""
    loaded = 0
    while loaded < count:
        size = min(CHUNK, count - loaded)
        database.execute(
            INSERT_TASKS,
            {"queues": QUEUES, "count": size, "status": status, "created_by": created_by},
        )
        loaded += size
        if count >= CHUNK:
            progress(f"  {loaded:,} of {count:,} finished tasks")


def run(ctx: Any, result: ScenarioResult) -> None:
    import httpx

    sizes: Sizes = ctx.pick(QUICK, FULL)
    with ctx.database("queues_small") as small, ctx.database("queues_large") as large:
        sides = {"small": small, "large": large}
        tokens = {}
        for side, database in sides.items():
            ctx.use(database)
            ((actor, tokens[side]),) = create_agents(1)
            load(database, PENDING * len(QUEUES), "pending", actor, ctx.progress)
            load(database, SMALL * len(QUEUES), "finished", actor, ctx.progress)
            if side == "large":
                ctx.progress(f"loading {sizes.finished:,} finished tasks")
                load(database, sizes.finished, "finished", actor, ctx.progress)
            database.execute("VACUUM ANALYZE tasks")
            database.execute("VACUUM ANALYZE queue_counters")
        ctx.scratch.release()
        latencies: dict[str, list[float]] = {side: [] for side in sides}
        with ctx.server(small) as small_server, ctx.server(large) as large_server:
            servers = {"small": small_server, "large": large_server}
            clients = {
                side: httpx.Client(
                    base_url=servers[side].url,
                    headers={"Authorization": f"Bearer {tokens[side]}"},
                    timeout=30,
                )
                for side in sides
            }
            try:
                ctx.progress(f"timing {sizes.requests:,} requests to each server, alternating")
                for number in range(sizes.warm + sizes.requests):
                    # Alternate which server goes first, so that neither always follows.
                    order = ["small", "large"] if number % 2 == 0 else ["large", "small"]
                    for side in order:
                        started = time.perf_counter()
                        response = clients[side].get("/api/v1/queues/")
                        elapsed = (time.perf_counter() - started) * 1000
                        response.raise_for_status()
                        if number >= sizes.warm:
                            latencies[side].append(elapsed)
                listed = {side: len(clients[side].get("/api/v1/queues/").json()) for side in sides}
            finally:
                for client in clients.values():
                    client.close()
        mismatches = [
            f"{side}: {line}"
            for side, database in sides.items()
            for line in queue_count_mismatches(ctx.scratch, database)
        ]
        tasks = large.execute("SELECT count(*) FROM tasks")[0][0]
    label = count_label(sizes.finished)
    small_finished = SMALL * len(QUEUES)
    for q in (50, 99):
        small_ms = percentile(latencies["small"], q)
        large_ms = percentile(latencies["large"], q)
        result.add(f"GET queues/ p{q}, {small_finished} finished", small_ms, "ms")
        result.add(f"GET queues/ p{q}, {label} finished", large_ms, "ms")
        result.add(
            f"GET queues/ p{q} ratio (large / small)",
            ratio(large_ms, small_ms),
            "x",
            f"<= {TARGET}",
        )
    result.note(
        f"{sizes.requests:,} requests to each server (after {sizes.warm} untimed), one at a "
        f"time, alternating; {len(QUEUES)} queues listed by each (small {listed['small']}, "
        f"large {listed['large']}), each with {PENDING} pending tasks; {tasks:,} tasks in the "
        "large database" + (f"; --quick: {label} instead of 1M" if ctx.quick else "")
    )
    if mismatches:
        raise RuntimeError("queue counts differ from COUNT(*): " + "; ".join(mismatches))
    result.note("GET queues/ counts equal a COUNT(*) of tasks in both databases")
