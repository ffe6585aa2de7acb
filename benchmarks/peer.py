"""In-process against a peer: board.transitions' claim+complete against procrastinate's
own fetch-and-finish, on the same database with the same concurrency.

What is compared, exactly:

- taskboard: 8 threads, each with its own Django connection, each looping
  ``transitions.claim(actor=..., lease_seconds=300)`` then ``transitions.complete(...)``
  until no task is left; every cycle writes a "claimed" and a "completed" event row.
- procrastinate: its schema applied (by its own SchemaManager) to the same scratch
  database, a pool of 8 psycopg connections, 8 coroutines each looping
  ``JobManager.fetch_job(None, worker_id)`` then ``JobManager.finish_job(job,
  succeeded, delete_job=False)``, the path its worker takes around a no-op task; its
  triggers write its own event rows.

Both start from the same number of queued items, inserted with one SQL statement each;
rounds alternate, each figure is the median of its rounds.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from benchmarks.harness import (
    Database,
    ScenarioResult,
    create_agents,
    insert_tasks,
    median,
    ratio,
    run_threads,
)

TITLE = "In-process against a peer (procrastinate, 8 workers)"
CONCURRENCY = 8

INSERT_JOBS = """
INSERT INTO procrastinate_jobs (queue_name, task_name, args)
SELECT 'default', 'noop', '{}'::jsonb FROM generate_series(1, %(count)s)
"""


def require_procrastinate() -> None:
    try:
        import procrastinate  # noqa: F401
    except ImportError:
        raise RuntimeError(
            "this scenario needs procrastinate: pip install 'taskboard[bench]'"
        ) from None


def transitions_round(agents: list[str]) -> tuple[int, float]:
    from board import transitions

    counts = [0] * len(agents)

    def worker(index: int) -> None:
        actor = agents[index]
        while True:
            claims = transitions.claim(actor=actor, lease_seconds=300)
            if not claims:
                return
            transitions.complete(
                task_id=claims[0].task.pk, actor=actor, lease_token=claims[0].lease_token
            )
            counts[index] += 1

    elapsed = run_threads(len(agents), worker)
    return sum(counts), elapsed


async def _procrastinate_round(conninfo: str, concurrency: int) -> tuple[int, float]:
    from procrastinate import PsycopgConnector
    from procrastinate.jobs import Status
    from procrastinate.manager import JobManager

    connector = PsycopgConnector(conninfo=conninfo, min_size=concurrency, max_size=concurrency)
    await connector.open_async()
    try:
        manager = JobManager(connector)
        worker_ids = [await manager.register_worker() for _ in range(concurrency)]
        count = 0

        async def worker(worker_id: int) -> None:
            nonlocal count
            while True:
                job = await manager.fetch_job(None, worker_id)
                if job is None:
                    return
                await manager.finish_job(job, Status.SUCCEEDED, delete_job=False)
                count += 1

        started = time.perf_counter()
        await asyncio.gather(*(worker(worker_id) for worker_id in worker_ids))
        elapsed = time.perf_counter() - started
        for worker_id in worker_ids:
            await manager.unregister_worker(worker_id)
        return count, elapsed
    finally:
        await connector.close_async()


def procrastinate_round(database: Database) -> tuple[int, float]:
    return asyncio.run(_procrastinate_round(database.conninfo, CONCURRENCY))


def apply_procrastinate_schema(database: Database) -> None:
    from procrastinate import PsycopgConnector
    from procrastinate.schema import SchemaManager

    async def apply() -> None:
        connector = PsycopgConnector(conninfo=database.conninfo, min_size=1, max_size=1)
        await connector.open_async()
        try:
            await SchemaManager(connector).apply_schema_async()
        finally:
            await connector.close_async()

    asyncio.run(apply())


def run(ctx: Any, result: ScenarioResult) -> None:
    require_procrastinate()
    rounds = ctx.pick(1, 2)
    count = ctx.pick(1_000, 4_000)
    ours: list[float] = []
    theirs: list[float] = []
    with ctx.database("peer") as database:
        agents = [name for name, _ in create_agents(CONCURRENCY)]
        ctx.progress("applying procrastinate's schema")
        apply_procrastinate_schema(database)
        for number in range(1, rounds + 1):
            insert_tasks(database, count, created_by=agents[0])
            database.execute(INSERT_JOBS, {"count": count})
            database.execute("ANALYZE")
            ctx.progress(f"round {number}/{rounds}: taskboard, {count:,} tasks")
            done, elapsed = transitions_round(agents)
            ours.append(done / elapsed)
            ctx.progress(f"  {done / elapsed:,.0f} cycles/s")
            ctx.progress(f"round {number}/{rounds}: procrastinate, {count:,} jobs")
            done, elapsed = procrastinate_round(database)
            theirs.append(done / elapsed)
            ctx.progress(f"  {done / elapsed:,.0f} cycles/s")
    our_rate, their_rate = median(ours), median(theirs)
    result.add("taskboard transitions claim+complete/s", our_rate, "/s")
    result.add("procrastinate fetch_job+finish_job/s", their_rate, "/s")
    result.add("taskboard / procrastinate", ratio(our_rate, their_rate), "x", ">= 1.0")
    result.note(
        f"{CONCURRENCY} threads with board.transitions vs {CONCURRENCY} coroutines on 8 "
        "connections with procrastinate's JobManager (fetch_job, finish_job succeeded); "
        f"{count:,} items per round, median of {rounds} round(s), alternating"
    )
