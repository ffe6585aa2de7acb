"""Fan-out: 1,000 open SSE streams while 50 events per second are committed.

A helper process (benchmarks.clients sse) holds the streams open; this process
creates tasks at a steady 50 per second with board.transitions.create and notes the time
each commit returned. The helper notes when each "created" event arrives on each stream;
the latency is arrival minus commit, over every (stream, event) pair. Meanwhile the
server's database connections (pg_stat_activity) and memory (RSS) are sampled.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.harness import Helper, Sampler, ScenarioResult, create_agents

TITLE = "Fan-out (SSE streams, 50 events/s)"
RATE = 50


def produce(actor: str, seconds: float, rate: float) -> dict[int, float]:
    """Create tasks at ``rate`` per second for ``seconds``; return {task id: commit time}."""
    from django.db import connection

    from board import transitions

    commits: dict[int, float] = {}
    started = time.monotonic()
    count = int(seconds * rate)
    try:
        for index in range(count):
            delay = started + index / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            task = transitions.create(actor=actor, title=f"fan-out {index}")
            commits[task.pk] = time.time()
    finally:
        connection.close()
    return commits


def deliver(ctx: Any, server: Any, helper: Helper, commits: dict[int, float]) -> dict[str, Any]:
    time.sleep(2)  # let the last events arrive
    helper.send({"commits": commits})
    return helper.read(120)


def add_delivery_figures(result: ScenarioResult, report: dict[str, Any], expected: int) -> None:
    """The figures of a fan-out: latency from commit to delivery, and what arrived."""
    result.add("commit-to-delivery p50", report["p50"], "ms")
    result.add("commit-to-delivery p99", report["p99"], "ms", "< 100")
    result.add(
        "events delivered / expected", report["count"] / expected if expected else 0, "x", ">= 1.0"
    )


def run(ctx: Any, result: ScenarioResult) -> None:
    streams = ctx.pick(500, 1_000)
    seconds = ctx.pick(5.0, 30.0)
    with ctx.database("fanout") as database:
        ((actor, token),) = create_agents(1)
        with ctx.server(database) as server:
            ctx.progress(f"opening {streams:,} streams")
            helper = Helper("sse", "--url", server.url, "--token", token, "--count", str(streams))
            try:
                ready = helper.read(180)
                ctx.progress(
                    f"{ready['ready']:,} streams open; {RATE} events/s for {seconds:.0f} s"
                )
                server.settle()
                idle_rss = server.rss_mb()
                with Sampler(server) as sampler:
                    commits = produce(actor, seconds, RATE)
                    report = deliver(ctx, server, helper, commits)
            finally:
                helper.close()
    expected = len(commits) * streams
    add_delivery_figures(result, report, expected)
    sampler.add_figures(result)
    result.note_reopened([ready])
    result.note(
        f"{streams:,} streams, {len(commits):,} events in {seconds:.0f} s; "
        f"{report['count']:,} deliveries of {expected:,}; p90 {report['p90']:.1f} ms, "
        f"max {report['max']:.1f} ms; RSS with the streams open and idle {idle_rss:.0f} MB; "
        f"connections active at once (max) {sampler.max_active}"
    )
    result.extra["latency_percentiles_ms"] = report["histogram"]
