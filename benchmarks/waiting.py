"""Waiting agents: 500 claims waiting with ``wait``, then tasks created one by one.

A helper process (benchmarks.clients wait) keeps 500 claims waiting (``wait``:
60 s), each on its own keep-alive connection, and sends the next waiting claim as soon as
one returns. Once the server is idle, this process creates tasks one at a time, every
100 ms, with board.transitions.create, noting when each commit returned; the helper notes
when a claim response carrying that task arrives. Wake-up latency is arrival minus commit.
"""

from __future__ import annotations

from typing import Any

from benchmarks.fanout import deliver, produce
from benchmarks.harness import Helper, Sampler, ScenarioResult, create_agents
from board import conf

TITLE = "Waiting agents (claims with wait, tasks created one by one)"
INTERVAL = 0.1


def run(ctx: Any, result: ScenarioResult) -> None:
    waiters = ctx.pick(200, 500)
    tasks = ctx.pick(30, 200)
    with ctx.database("waiting") as database:
        ((actor, token),) = create_agents(1)
        with ctx.server(database) as server:
            ctx.progress(f"sending {waiters:,} waiting claims")
            helper = Helper("wait", "--url", server.url, "--token", token, "--count", str(waiters))
            try:
                ready = helper.read(120)
                server.settle()
                ctx.progress(f"{waiters:,} claims waiting; creating {tasks} tasks one by one")
                with Sampler(server) as sampler:
                    commits = produce(actor, tasks * INTERVAL, 1 / INTERVAL)
                    report = deliver(ctx, server, helper, commits)
            finally:
                helper.close()
    result.add("wake-up latency p50", report["p50"], "ms")
    result.add("wake-up latency p99", report["p99"], "ms", "< 100")
    result.add("tasks claimed by a waiter / created", report["count"] / len(commits), "x", ">= 1.0")
    sampler.add_figures(result, rss_target="")
    result.note_reopened([ready])
    result.note(
        f"{waiters:,} waiting claims, {len(commits)} tasks created {INTERVAL * 1000:.0f} ms "
        f"apart; p90 {report['p90']:.1f} ms, max {report['max']:.1f} ms; connections active "
        f"at once (max) {sampler.max_active}; each server process runs "
        f"{conf.threads()} worker threads (the default), "
        "each keeping its connection between requests"
    )
