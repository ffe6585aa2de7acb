"""Blocked tasks do not slow claims: claim latency with 100,000 blocked pending tasks ahead
of the claimable ones, against the same claims with none.

Two scratch databases cloned from the same template hold the same 1,000 blockers (tasks
held for a day by another agent, or escalated: both stay unfinished) and the same supply
of claimable pending tasks (priority 0, created just before the claims). One of them also
holds 100,000 blocked pending tasks, loaded in bulk SQL: each depends on one blocker
(``open_dependencies`` 1, its edge in ``task_dependencies``), and each sits ahead of every
claimable task in claim order, half by a higher priority and half by an older
``created_at``. A claim that walked the blocked rows would pay for all of them.

One agent claims (timed) and completes (not timed) tasks one after another with
board.transitions, in rounds that alternate between the two databases (a busy neighbour
on the machine slows both alike), each round on a fresh connection warmed up by a few
untimed claims. Each round times claims on every queue (the usual claim) and claims that
name the queue (another index). At the end, every blocked task must still be pending and
the queue counters must equal a ``COUNT(*)`` of the tasks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from benchmarks.harness import (
    Database,
    ScenarioResult,
    count_label,
    create_agents,
    insert_tasks,
    percentile,
    queue_count_mismatches,
    ratio,
)
from benchmarks.history import claim_latencies

TITLE = "Blocked tasks do not slow claims (1 agent, claim latency)"
TARGET = 1.2


@dataclass(frozen=True)
class Sizes:
    blockers: int
    blocked: int
    rounds: int
    claims: int  # timed claims per round, per database and kind of claim
    warm: int  # untimed claims at the start of each round


# p99 needs samples: 3,000 timed claims per database and kind of claim (600 with --quick)
# make it the 30th (6th) slowest, not the 2nd or 3rd.
FULL = Sizes(blockers=1_000, blocked=100_000, rounds=10, claims=300, warm=20)
QUICK = Sizes(blockers=1_000, blocked=100_000, rounds=6, claims=100, warm=10)

# Half the blockers are in progress, leased for a day by another agent (so no claim finds
# their lease expired), half escalated; both are open dependencies that no claim changes.
INSERT_BLOCKERS = """
INSERT INTO tasks (
    title, description, payload, queue, priority, max_failures, status, failure_count,
    created_by, created_at, updated_at, leased_by, lease_token, leased_until, lease_seconds,
    attempt_started_at, last_error
)
SELECT 'blocker ' || g, '', '{}'::jsonb, 'default', 0, 3,
       CASE WHEN g %% 2 = 0 THEN 'in_progress' ELSE 'escalated' END,
       CASE WHEN g %% 2 = 0 THEN 0 ELSE 3 END,
       %(created_by)s, now() - interval '2 days', now(),
       CASE WHEN g %% 2 = 0 THEN %(holder)s END,
       CASE WHEN g %% 2 = 0 THEN gen_random_uuid() END,
       CASE WHEN g %% 2 = 0 THEN now() + interval '1 day' END,
       CASE WHEN g %% 2 = 0 THEN 86400 END,
       CASE WHEN g %% 2 = 0 THEN now() END,
       CASE WHEN g %% 2 = 1 THEN 'bench: failed three times' END
FROM generate_series(1, %(count)s) g
"""

# Blocked tasks, each after one blocker (round robin), all ahead of the claimable ones:
# even ones by priority (1 to 10, claimable tasks have 0), odd ones by age (a day older).
INSERT_BLOCKED = """
WITH blockers AS (
    SELECT array_agg(id ORDER BY id) AS ids
    FROM tasks
    WHERE status IN ('in_progress', 'escalated')
)
INSERT INTO tasks (
    title, description, payload, queue, priority, max_failures, status, failure_count,
    created_by, created_at, updated_at, depends_on, open_dependencies
)
SELECT 'blocked ' || g, '', '{}'::jsonb, 'default',
       CASE WHEN g %% 2 = 0 THEN 1 + (g / 2) %% 10 ELSE 0 END, 3, 'pending', 0, %(created_by)s,
       CASE WHEN g %% 2 = 0 THEN now() ELSE now() - interval '1 day' END, now(),
       ARRAY[b.ids[1 + g %% cardinality(b.ids)]], 1
FROM generate_series(1, %(count)s) g, blockers b
"""

INSERT_EDGES = """
INSERT INTO task_dependencies (task_id, depends_on_id)
SELECT t.id, d.depends_on_id
FROM tasks t, unnest(t.depends_on) AS d(depends_on_id)
WHERE t.status = 'pending' AND t.open_dependencies > 0
"""

STILL_BLOCKED = """
SELECT count(*) FROM tasks
WHERE title LIKE 'blocked %%' AND status = 'pending' AND open_dependencies > 0
"""


def load_blockers(database: Database, count: int, created_by: str, holder: str) -> None:
    database.execute(INSERT_BLOCKERS, {"count": count, "created_by": created_by, "holder": holder})


def load_blocked(database: Database, count: int, created_by: str) -> None:
    """Add ``count`` blocked tasks and their edges in one transaction."""
    with database.connect() as conn, conn.transaction():
        conn.execute(INSERT_BLOCKED, {"count": count, "created_by": created_by})
        conn.execute(INSERT_EDGES)


def run(ctx: Any, result: ScenarioResult) -> None:
    sizes: Sizes = ctx.pick(QUICK, FULL)
    supply = sizes.rounds * (sizes.claims + sizes.warm) * 2 + 300
    kinds = {"all": None, "named": ["default"]}
    latencies: dict[tuple[str, str], list[float]] = {
        (side, kind): [] for side in ("none", "blocked") for kind in kinds
    }
    with ctx.database("blocked_none") as none, ctx.database("blocked") as blocked:
        sides = {"none": none, "blocked": blocked}
        for side, database in sides.items():
            ctx.use(database)
            actor, holder = [name for name, _ in create_agents(2)]
            load_blockers(database, sizes.blockers, actor, holder)
            if side == "blocked":
                ctx.progress(f"loading {sizes.blocked:,} blocked tasks and their edges")
                load_blocked(database, sizes.blocked, actor)
            insert_tasks(database, supply, created_by=actor)
            database.execute("VACUUM ANALYZE tasks")
            database.execute("VACUUM ANALYZE task_dependencies")
        for number in range(sizes.rounds):
            # Alternate which side goes first, so that neither always follows the other.
            order = ["none", "blocked"] if number % 2 == 0 else ["blocked", "none"]
            for side in order:
                ctx.use(sides[side])
                for kind, queues in kinds.items():
                    latencies[side, kind] += claim_latencies(
                        actor, sizes.claims, queues=queues, warm=sizes.warm
                    )
            ctx.progress(
                f"round {number + 1}/{sizes.rounds}: p50 "
                + ", ".join(
                    f"{side} {percentile(latencies[side, 'all'], 50):.2f} ms" for side in sides
                )
            )
        still_blocked = blocked.execute(STILL_BLOCKED)[0][0]
        mismatches = [
            f"{side}: {line}"
            for side, database in sides.items()
            for line in queue_count_mismatches(ctx.scratch, database)
        ]
    label = f"{count_label(sizes.blocked)} blocked"
    for kind, what in (("all", "claim"), ("named", "claim naming its queue")):
        for q in (50, 99):
            none_ms = percentile(latencies["none", kind], q)
            blocked_ms = percentile(latencies["blocked", kind], q)
            result.add(f"{what} p{q}, none blocked", none_ms, "ms")
            result.add(f"{what} p{q}, {label}", blocked_ms, "ms")
            result.add(
                f"{what} p{q} ratio (blocked / none)",
                ratio(blocked_ms, none_ms),
                "x",
                f"<= {TARGET}",
            )
    result.add("blocked tasks still blocked / loaded", still_blocked / sizes.blocked, "x", ">= 1.0")
    result.note(
        f"{sizes.rounds} rounds alternating between the two databases, each of "
        f"{sizes.claims:,} claims on every queue and {sizes.claims:,} naming the queue "
        f"(after {sizes.warm} untimed), each claim followed by an untimed complete; "
        f"{sizes.blockers:,} blockers (half in progress, half escalated) in both databases"
    )
    if mismatches:
        raise RuntimeError("queue counts differ from COUNT(*): " + "; ".join(mismatches))
    result.note("GET queues/ counts equal a COUNT(*) of tasks in both databases")
