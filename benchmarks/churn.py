"""Churn: many claim+heartbeat+complete cycles, then the size of ``tasks`` (table, TOAST
and indexes) once autovacuum has caught up, against the same rows after VACUUM FULL.

The cycles run the transitions' own statements (board/sql/transitions.sql) from a few
connections in batches: each batch creates 100 tasks (one statement, with their
"created" events), claims them (one claim of 100), then heartbeats and completes each
task (one statement each, pipelined, each its own transaction as through the API). The
sessions commit with synchronous_commit off: this scenario is about table size, not
commit latency. Nothing but autovacuum, as the migrations tune it, cleans up meanwhile.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from benchmarks.harness import Database, ScenarioResult, create_agents, ratio, run_threads

TITLE = "Churn (claim+heartbeat+complete cycles, autovacuum only)"
TARGET = 2.0
BATCH = 100
CONNECTIONS = 4

CREATE_BATCH = """
WITH task AS (
    INSERT INTO tasks (
        title, description, payload, queue, priority, max_failures, status, failure_count,
        created_by, created_at, updated_at
    )
    SELECT 'churn ' || g, '', '{"n": 1}'::jsonb, 'default', 0, 3, 'pending', 0,
           %(actor)s, now(), now()
    FROM generate_series(1, %(count)s) g
    RETURNING id, status
)
INSERT INTO task_events (task_id, type, status, actor, payload, created_at)
SELECT id, 'created', status, %(actor)s, '{}'::jsonb, now() FROM task
"""

SIZES = """
SELECT pg_total_relation_size('tasks'), pg_relation_size('tasks'), pg_indexes_size('tasks'),
       (SELECT count(*) FROM tasks)
"""


def cycles(database: Database, agents: list[str], total: int, progress: Any) -> None:
    from board.sql import QUERIES

    done = [0]
    lock = threading.Lock()
    reported = [0]

    def worker(index: int) -> None:
        actor = agents[index]
        with database.connect() as conn:
            conn.execute("SET synchronous_commit = off")
            while True:
                with lock:
                    if done[0] >= total:
                        return
                    done[0] += BATCH
                    if done[0] - reported[0] >= total // 10:
                        reported[0] = done[0]
                        progress(f"  {min(done[0], total):,} of {total:,} cycles")
                conn.execute(CREATE_BATCH, {"actor": actor, "count": BATCH})
                with conn.transaction():
                    cur = conn.execute(
                        QUERIES["claim"],
                        {
                            "actor": actor,
                            "all_queues": True,
                            "queues": [],
                            "lease_seconds": 300,
                            "limit": BATCH,
                        },
                    )
                    columns = [col.name for col in cur.description or []]
                    rows = [dict(zip(columns, row, strict=True)) for row in cur.fetchall()]
                leases = [
                    {"task_id": row["id"], "actor": actor, "lease_token": row["lease_token"]}
                    for row in rows
                    if row["claimed"]
                ]
                with conn.cursor() as cursor:
                    cursor.executemany(
                        QUERIES["heartbeat"],
                        [{**lease, "lease_seconds": None, "progress": None} for lease in leases],
                    )
                    cursor.executemany(
                        QUERIES["complete"],
                        [{**lease, "result": None, "alone": True} for lease in leases],
                    )

    run_threads(len(agents), worker)


def wait_for_autovacuum(database: Database, since: Any, timeout: float, progress: Any) -> bool:
    """Wait (bounded) until autovacuum has vacuumed ``tasks`` after ``since``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = database.execute(
            """
            SELECT last_autovacuum >= %(since)s, n_dead_tup, n_live_tup
            FROM pg_stat_user_tables WHERE relname = 'tasks'
            """,
            {"since": since},
        )[0]
        if row[0]:
            progress(f"  autovacuum done ({row[1]:,} dead, {row[2]:,} live tuples)")
            return True
        time.sleep(2)
    return False


def run(ctx: Any, result: ScenarioResult) -> None:
    total = ctx.pick(30_000, 500_000)
    with ctx.database("churn") as database:
        autovacuum = database.execute("SHOW autovacuum")[0][0]
        naptime = database.execute("SHOW autovacuum_naptime")[0][0]
        options = database.execute("SELECT reloptions FROM pg_class WHERE relname = 'tasks'")[0][0]
        if autovacuum != "on":
            result.note("autovacuum is OFF on this server: nothing cleans up but VACUUM FULL")
        agents = [name for name, _ in create_agents(CONNECTIONS)]
        ctx.progress(f"{total:,} cycles over {CONNECTIONS} connections")
        started = time.perf_counter()
        cycles(database, agents, total, ctx.progress)
        elapsed = time.perf_counter() - started
        ended_at = database.execute("SELECT now()")[0][0]
        churned = database.execute(SIZES)[0]
        ctx.progress(f"waiting for autovacuum (naptime {naptime}, at most {ctx.pick(70, 150)} s)")
        caught_up = wait_for_autovacuum(database, ended_at, ctx.pick(70, 150), ctx.progress)
        before = database.execute(SIZES)[0]
        ctx.progress("VACUUM FULL tasks")
        database.execute("VACUUM FULL tasks")
        after = database.execute(SIZES)[0]
    mb = 2**20
    result.add("cycles/s during the churn", total / elapsed, "/s")
    result.add("tasks total size after churn + autovacuum", before[0] / mb, "MB")
    result.add("  of which indexes", before[2] / mb, "MB")
    result.add("tasks total size after VACUUM FULL", after[0] / mb, "MB")
    result.add("  of which indexes", after[2] / mb, "MB")
    result.add(
        "size ratio (autovacuum / VACUUM FULL)", ratio(before[0], after[0]), "x", f"<= {TARGET}"
    )
    result.note(
        f"{total:,} cycles on {after[3]:,} task rows; autovacuum {autovacuum} "
        f"(naptime {naptime}), tasks reloptions {options}; size right after the churn "
        f"{churned[0] / mb:.0f} MB"
        + ("" if caught_up else "; autovacuum had not run again before the deadline")
    )
