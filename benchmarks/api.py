"""API against the limit: claim+complete cycles per second through the HTTP API, against
the same two statements sent as raw SQL over psycopg, both with 8 concurrent agents.

The raw figure is what the database can do with these two transactions and 8
connections; the ratio is how much of it the HTTP API (uvicorn, Django, DRF, token
authentication) keeps. Rounds alternate between the two so that a busy neighbour on the
machine slows both alike; each figure is the median of its rounds.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from benchmarks.harness import (
    Database,
    ScenarioResult,
    Server,
    create_agents,
    insert_tasks,
    median,
    percentile,
    ratio,
    run_threads,
)
from board import conf

TITLE = "API against the limit (8 agents, claim+complete)"
AGENTS = 8
TARGET_RATIO = 0.40


def raw_round(
    database: Database, agents: list[tuple[str, str]], seconds: float
) -> tuple[int, bool]:
    """Claim and complete with the transitions' own statements over psycopg, for
    ``seconds``; return (cycles, whether the tasks ran out)."""
    from board.sql import QUERIES

    counts = [0] * len(agents)
    exhausted = threading.Event()

    def agent(index: int) -> None:
        actor = agents[index][0]
        claim_params = {
            "actor": actor,
            "all_queues": True,
            "queues": [],
            "lease_seconds": 300,
            "limit": 1,
        }
        with database.connect() as conn:
            deadline = time.perf_counter() + seconds
            while time.perf_counter() < deadline:
                # The claim runs in a transaction (as transitions.claim does); the
                # complete is one statement in autocommit (as Django runs it).
                with conn.transaction():
                    cur = conn.execute(QUERIES["claim"], claim_params)
                    columns = [col.name for col in cur.description or []]
                    rows = cur.fetchall()
                if not rows:
                    exhausted.set()
                    return
                row = dict(zip(columns, rows[0], strict=True))
                conn.execute(
                    QUERIES["complete"],
                    {
                        "task_id": row["id"],
                        "actor": actor,
                        "lease_token": row["lease_token"],
                        "result": None,
                        # As transitions.complete tries first: a task nothing depends on.
                        "alone": True,
                    },
                ).fetchall()
                counts[index] += 1

    run_threads(len(agents), agent)
    return sum(counts), exhausted.is_set()


def api_round(
    server: Server, agents: list[tuple[str, str]], seconds: float
) -> tuple[int, bool, list[float]]:
    """Claim and complete through the HTTP API for ``seconds``; return (cycles, whether
    the tasks ran out, request latencies in ms)."""
    import httpx

    counts = [0] * len(agents)
    latencies: list[list[float]] = [[] for _ in agents]
    exhausted = threading.Event()

    def agent(index: int) -> None:
        headers = {"Authorization": f"Bearer {agents[index][1]}"}
        with httpx.Client(base_url=server.url, headers=headers, timeout=30) as client:
            deadline = time.perf_counter() + seconds
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                response = client.post("/api/v1/tasks/claim/", json={"lease_seconds": 300})
                t1 = time.perf_counter()
                response.raise_for_status()
                tasks = response.json()["tasks"]
                if not tasks:
                    exhausted.set()
                    return
                task = tasks[0]
                done = client.post(
                    f"/api/v1/tasks/{task['id']}/complete/",
                    json={"lease_token": task["lease_token"]},
                )
                t2 = time.perf_counter()
                done.raise_for_status()
                latencies[index] += [(t1 - t0) * 1000, (t2 - t1) * 1000]
                counts[index] += 1

    run_threads(len(agents), agent)
    return sum(counts), exhausted.is_set(), [ms for each in latencies for ms in each]


def run(ctx: Any, result: ScenarioResult) -> None:
    rounds = ctx.pick(1, 3)
    seconds = ctx.pick(3.0, 10.0)
    with ctx.database("api") as database:
        agents = create_agents(AGENTS)
        creator = agents[0][0]
        with ctx.server(database) as server:
            raw_rates: list[float] = []
            api_rates: list[float] = []
            api_latencies: list[float] = []
            ctx.progress("warming up the server")
            insert_tasks(database, 2000, created_by=creator)
            api_round(server, agents, 1.0)
            guess = {"raw": 3000.0, "api": 1000.0}
            for number in range(1, rounds + 1):
                for kind in ("raw", "api"):
                    needed = int(max(guess[kind], 200) * seconds * 1.5) + 1000
                    insert_tasks(database, needed, created_by=creator)
                    database.execute("ANALYZE tasks")
                    ctx.progress(f"round {number}/{rounds}: {kind}, {seconds:.0f} s")
                    started = time.perf_counter()
                    if kind == "raw":
                        cycles, exhausted = raw_round(database, agents, seconds)
                    else:
                        cycles, exhausted, latencies = api_round(server, agents, seconds)
                        api_latencies += latencies
                    elapsed = time.perf_counter() - started
                    rate = cycles / elapsed
                    guess[kind] = max(guess[kind], rate)
                    (raw_rates if kind == "raw" else api_rates).append(rate)
                    ctx.progress(
                        f"  {rate:,.0f} cycles/s" + (" (ran out of tasks)" if exhausted else "")
                    )
    api_rate, raw_rate = median(api_rates), median(raw_rates)
    result.add("API claim+complete cycles/s", api_rate, "/s")
    result.add("raw SQL claim+complete cycles/s", raw_rate, "/s")
    result.add("API / raw SQL", ratio(api_rate, raw_rate), "x", f">= {TARGET_RATIO}")
    result.add("API request latency p50", percentile(api_latencies, 50), "ms")
    result.add("API request latency p99", percentile(api_latencies, 99), "ms")
    result.note(
        f"{AGENTS} agents; median of {rounds} round(s) of {seconds:.0f} s each, API and raw SQL "
        "alternating; raw SQL = board/sql/transitions.sql 'claim' and 'complete' over 8 psycopg "
        "connections; the server runs with its defaults (one process per CPU, "
        f"{conf.threads()} threads each), access log off"
    )
