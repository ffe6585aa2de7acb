"""Work graphs, idempotent creates, comments, and queues and agents at a glance (contract:
"Additions to v1"): the new task columns and tables, the claim's indexes without blocked
tasks, and the triggers that keep queue and agent counters."""

import django.contrib.postgres.fields
import django.core.validators
import django.db.models.deletion
import django.db.models.functions.datetime
from django.conf import settings
from django.db import migrations, models

CLAIM_INDEXES = """
-- Blocked tasks (pending, with a dependency not done) are left out of the claim's partial
-- indexes, so a claim never walks past them: 100,000 blocked tasks ahead of the first
-- claimable one cost it nothing.
DROP INDEX tasks_pending_claim_idx;
CREATE INDEX tasks_pending_claim_idx
    ON tasks (priority DESC, created_at, id)
    WHERE status = 'pending' AND open_dependencies = 0;
DROP INDEX tasks_pending_queue_claim_idx;
CREATE INDEX tasks_pending_queue_claim_idx
    ON tasks (queue, priority DESC, created_at, id)
    WHERE status = 'pending' AND open_dependencies = 0;
DROP INDEX tasks_pending_run_after_idx;
CREATE INDEX tasks_pending_run_after_idx ON tasks (run_after)
    WHERE status = 'pending' AND open_dependencies = 0 AND run_after IS NOT NULL;

-- GET tasks/?blocked=true, and the board's blocked tasks.
CREATE INDEX tasks_blocked_idx ON tasks (id) WHERE status = 'pending' AND open_dependencies > 0;
-- GET tasks/?parent=<id>: children, newest first.
CREATE INDEX tasks_parent_idx ON tasks (parent_id, id) WHERE parent_id IS NOT NULL;
-- GET queues/: each queue's oldest unblocked pending task. The predicate is written so that
-- the claim's conditions do not imply it: the planner would otherwise take this smaller
-- index for a claim on one queue and sort, instead of reading the claim order above.
CREATE INDEX tasks_pending_queue_created_idx ON tasks (queue, created_at)
    WHERE (status = 'pending' AND open_dependencies = 0) IS TRUE;
"""

DROP_CLAIM_INDEXES = """
DROP INDEX tasks_pending_queue_created_idx;
DROP INDEX tasks_parent_idx;
DROP INDEX tasks_blocked_idx;
DROP INDEX tasks_pending_run_after_idx;
CREATE INDEX tasks_pending_run_after_idx ON tasks (run_after)
    WHERE status = 'pending' AND run_after IS NOT NULL;
DROP INDEX tasks_pending_queue_claim_idx;
CREATE INDEX tasks_pending_queue_claim_idx
    ON tasks (queue, priority DESC, created_at, id) WHERE status = 'pending';
DROP INDEX tasks_pending_claim_idx;
CREATE INDEX tasks_pending_claim_idx
    ON tasks (priority DESC, created_at, id) WHERE status = 'pending';
"""

QUEUE_COUNTERS = """
-- Queue counts kept in step with every statement that inserts or updates tasks, so that
-- GET queues/ reads a few counter rows instead of scanning tasks.
--
-- A single counter row per queue would make every transition on a queue wait for the
-- previous one's commit. Instead a queue's counts are spread over shard rows: a
-- transaction adds its changes to the first shard row no other transaction holds (FOR
-- UPDATE SKIP LOCKED), or adds a shard when all are held. Concurrent transitions never
-- wait for each other, and a queue has about as many shards as it ever had concurrent
-- writers. Readers sum the shards.
ALTER TABLE queue_counters SET (fillfactor = 50);

CREATE FUNCTION queue_counters_add(
    p_queue text, p_pending bigint, p_blocked bigint, p_in_progress bigint,
    p_escalated bigint, p_done bigint, p_cancelled bigint
) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    LOOP
        -- The first shard row of the queue that no other transaction holds.
        UPDATE queue_counters SET
            pending = pending + p_pending, blocked = blocked + p_blocked,
            in_progress = in_progress + p_in_progress, escalated = escalated + p_escalated,
            done = done + p_done, cancelled = cancelled + p_cancelled
        WHERE id = (SELECT id FROM queue_counters
                    WHERE queue = p_queue ORDER BY shard LIMIT 1 FOR UPDATE SKIP LOCKED);
        IF FOUND THEN
            RETURN;
        END IF;
        -- Every shard is held by another transaction: add one. Its number is random, not
        -- the next one: two transactions that both added "the next" shard would wait for
        -- each other's commit (and could deadlock). A number taken already (by a committed
        -- row) makes this insert do nothing, and the loop looks again.
        INSERT INTO queue_counters
            (queue, shard, pending, blocked, in_progress, escalated, done, cancelled)
        VALUES (p_queue, (random() * 2147483646)::integer, p_pending, p_blocked,
                p_in_progress, p_escalated, p_done, p_cancelled)
        ON CONFLICT (queue, shard) DO NOTHING;
        IF FOUND THEN
            RETURN;
        END IF;
    END LOOP;
END;
$$;

-- The counter a task is counted in: its status, with blocked apart from pending.
CREATE FUNCTION task_count_bucket(status text, open_dependencies integer) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN status = 'pending' AND open_dependencies > 0 THEN 'blocked'
                ELSE status END
$$;

CREATE FUNCTION tasks_count_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM queue_counters_add(
        queue,
        count(*) FILTER (WHERE bucket = 'pending'),
        count(*) FILTER (WHERE bucket = 'blocked'),
        count(*) FILTER (WHERE bucket = 'in_progress'),
        count(*) FILTER (WHERE bucket = 'escalated'),
        count(*) FILTER (WHERE bucket = 'done'),
        count(*) FILTER (WHERE bucket = 'cancelled'))
    FROM (SELECT queue, task_count_bucket(status, open_dependencies) AS bucket
          FROM inserted_tasks) t
    GROUP BY queue;
    RETURN NULL;
END;
$$;

CREATE FUNCTION tasks_count_update() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- A task's queue never changes: each change moves it from one bucket to another.
    PERFORM queue_counters_add(queue, pending, blocked, in_progress, escalated, done, cancelled)
    FROM (
        SELECT queue,
               sum(CASE bucket WHEN 'pending' THEN n ELSE 0 END) AS pending,
               sum(CASE bucket WHEN 'blocked' THEN n ELSE 0 END) AS blocked,
               sum(CASE bucket WHEN 'in_progress' THEN n ELSE 0 END) AS in_progress,
               sum(CASE bucket WHEN 'escalated' THEN n ELSE 0 END) AS escalated,
               sum(CASE bucket WHEN 'done' THEN n ELSE 0 END) AS done,
               sum(CASE bucket WHEN 'cancelled' THEN n ELSE 0 END) AS cancelled
        FROM (
            SELECT o.queue, task_count_bucket(o.status, o.open_dependencies) AS bucket,
                   -1 AS n
            FROM old_tasks o
            UNION ALL
            SELECT n.queue, task_count_bucket(n.status, n.open_dependencies), 1
            FROM new_tasks n
        ) moves
        GROUP BY queue
    ) deltas
    -- A heartbeat moves nothing: it takes no counter row.
    WHERE (pending, blocked, in_progress, escalated, done, cancelled)
          IS DISTINCT FROM (0, 0, 0, 0, 0, 0);
    RETURN NULL;
END;
$$;

CREATE TRIGGER tasks_count_insert
    AFTER INSERT ON tasks REFERENCING NEW TABLE AS inserted_tasks
    FOR EACH STATEMENT EXECUTE FUNCTION tasks_count_insert();

CREATE TRIGGER tasks_count_update
    AFTER UPDATE ON tasks REFERENCING OLD TABLE AS old_tasks NEW TABLE AS new_tasks
    FOR EACH STATEMENT EXECUTE FUNCTION tasks_count_update();

-- The counts of the tasks already there.
INSERT INTO queue_counters (queue, shard, pending, blocked, in_progress, escalated, done, cancelled)
SELECT queue, 0,
       count(*) FILTER (WHERE status = 'pending'),
       0,
       count(*) FILTER (WHERE status = 'in_progress'),
       count(*) FILTER (WHERE status = 'escalated'),
       count(*) FILTER (WHERE status = 'done'),
       count(*) FILTER (WHERE status = 'cancelled')
FROM tasks GROUP BY queue;
"""

DROP_QUEUE_COUNTERS = """
DROP TRIGGER tasks_count_update ON tasks;
DROP TRIGGER tasks_count_insert ON tasks;
DROP FUNCTION tasks_count_update();
DROP FUNCTION tasks_count_insert();
DROP FUNCTION task_count_bucket(text, integer);
DROP FUNCTION queue_counters_add(text, bigint, bigint, bigint, bigint, bigint, bigint);
DELETE FROM queue_counters;
"""

AGENT_ACTIVITY = """
-- How each agent's leases ended, per hour, and when it last ended one: kept from the events
-- a statement inserts, sharded like queue_counters so that one agent's parallel workers
-- never wait for each other. Only the events that end a lease (or record its expiry)
-- count, so claims and heartbeats write nothing here. An agent that holds tasks was seen
-- when it last claimed or heartbeat one: tasks.updated_at, which board.queues reads
-- beside this table.
ALTER TABLE agent_activity SET (fillfactor = 50);

CREATE FUNCTION agent_activity_add(
    p_agent text, p_seen timestamptz, p_completed bigint, p_failed bigint, p_expired bigint
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    h timestamptz := date_trunc('hour', now());
BEGIN
    LOOP
        -- The first shard row of this hour that no other transaction holds.
        UPDATE agent_activity SET
            last_seen_at = GREATEST(last_seen_at, p_seen),
            completed = completed + p_completed, failed = failed + p_failed,
            expired = expired + p_expired
        WHERE id = (SELECT id FROM agent_activity
                    WHERE agent = p_agent AND hour = h
                    ORDER BY shard LIMIT 1 FOR UPDATE SKIP LOCKED);
        IF FOUND THEN
            RETURN;
        END IF;
        -- A random shard number, as in queue_counters_add.
        INSERT INTO agent_activity (agent, hour, shard, last_seen_at, completed, failed, expired)
        VALUES (p_agent, h, (random() * 2147483646)::integer, p_seen, p_completed, p_failed,
                p_expired)
        ON CONFLICT (agent, hour, shard) DO NOTHING;
        IF FOUND THEN
            RETURN;
        END IF;
    END LOOP;
END;
$$;

CREATE FUNCTION task_events_count_agents() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM agent_activity_add(
        agent,
        max(created_at) FILTER (WHERE type <> 'expired'),
        count(*) FILTER (WHERE type = 'completed'),
        count(*) FILTER (WHERE type = 'failed'),
        count(*) FILTER (WHERE type = 'expired'))
    FROM (
        -- What a lease holder does to end its lease, and the expiry of a lease (recorded
        -- by the system: the agent is the holder whose lease ran out).
        SELECT CASE WHEN type = 'expired' THEN payload->>'previous_holder' ELSE actor END
                   AS agent,
               type, created_at
        FROM inserted_events
        WHERE type = 'expired'
           OR (type IN ('completed', 'failed', 'released', 'escalated') AND actor <> 'system')
    ) e
    WHERE agent IS NOT NULL
    GROUP BY agent;
    RETURN NULL;
END;
$$;

-- One call per statement, however many events it inserts (a bulk load takes one bump per
-- agent, where a row trigger took one per row, each on the same row version chain). A
-- statement of claims or heartbeats finds nothing to count and bumps nothing.
CREATE TRIGGER task_events_count_agents
    AFTER INSERT ON task_events REFERENCING NEW TABLE AS inserted_events
    FOR EACH STATEMENT EXECUTE FUNCTION task_events_count_agents();

-- The agents already there: their last sighting, and the last day by the hour.
INSERT INTO agent_activity (agent, hour, shard, last_seen_at, completed, failed, expired)
SELECT agent, date_trunc('hour', created_at), 0,
       max(created_at) FILTER (WHERE type <> 'expired'),
       count(*) FILTER (WHERE type = 'completed'),
       count(*) FILTER (WHERE type = 'failed'),
       count(*) FILTER (WHERE type = 'expired')
FROM (
    SELECT CASE WHEN type = 'expired' THEN payload->>'previous_holder' ELSE actor END
               AS agent,
           type, created_at
    FROM task_events
    WHERE (type = 'expired')
       OR (type IN ('claimed', 'heartbeat', 'completed', 'failed', 'released', 'escalated')
           AND actor <> 'system')
) e
WHERE agent IS NOT NULL
GROUP BY agent, date_trunc('hour', created_at);
"""

DROP_AGENT_ACTIVITY = """
DROP TRIGGER task_events_count_agents ON task_events;
DROP FUNCTION task_events_count_agents();
DROP FUNCTION agent_activity_add(text, timestamptz, bigint, bigint, bigint);
DELETE FROM agent_activity;
"""


class Migration(migrations.Migration):
    dependencies = [
        ("board", "0007_queue_limits"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name="AgentActivity",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("agent", models.CharField(max_length=150)),
                ("hour", models.DateTimeField()),
                ("shard", models.IntegerField()),
                ("last_seen_at", models.DateTimeField(null=True)),
                ("completed", models.BigIntegerField(default=0)),
                ("failed", models.BigIntegerField(default=0)),
                ("expired", models.BigIntegerField(default=0)),
            ],
            options={
                "verbose_name_plural": "agent activity",
                "db_table": "agent_activity",
            },
        ),
        migrations.CreateModel(
            name="QueueCounter",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("queue", models.CharField(max_length=64)),
                ("shard", models.IntegerField()),
                ("pending", models.BigIntegerField(default=0)),
                ("blocked", models.BigIntegerField(default=0)),
                ("in_progress", models.BigIntegerField(default=0)),
                ("escalated", models.BigIntegerField(default=0)),
                ("done", models.BigIntegerField(default=0)),
                ("cancelled", models.BigIntegerField(default=0)),
            ],
            options={
                "db_table": "queue_counters",
            },
        ),
        migrations.CreateModel(
            name="QueuePause",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("queue", models.CharField(max_length=64)),
                ("paused", models.BooleanField()),
                ("actor", models.CharField(max_length=150)),
                ("note", models.TextField(blank=True, default="")),
                (
                    "created_at",
                    models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
                ),
            ],
            options={
                "verbose_name": "queue pause or resume",
                "verbose_name_plural": "queue pauses and resumes",
                "db_table": "queue_pauses",
                "ordering": ["-id"],
            },
        ),
        migrations.CreateModel(
            name="QueueState",
            fields=[
                (
                    "name",
                    models.CharField(
                        max_length=64,
                        primary_key=True,
                        serialize=False,
                        validators=[
                            django.core.validators.RegexValidator(
                                "^[a-z0-9_-]{1,64}\\Z",
                                "Queue names are 1 to 64 characters of a-z, 0-9, '_' and '-'.",
                            )
                        ],
                    ),
                ),
                ("paused", models.BooleanField(default=False)),
                (
                    "changed_at",
                    models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
                ),
                ("changed_by", models.CharField(max_length=150)),
                ("note", models.TextField(blank=True, default="")),
            ],
            options={
                "verbose_name": "queue",
                "db_table": "queue_states",
            },
        ),
        migrations.CreateModel(
            name="TaskDependency",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
            ],
            options={
                "db_table": "task_dependencies",
            },
        ),
        migrations.RemoveConstraint(
            model_name="taskevent",
            name="task_events_type_valid",
        ),
        migrations.AddField(
            model_name="task",
            name="attempt_started_at",
            field=models.DateTimeField(blank=True, editable=False, null=True),
        ),
        migrations.AddField(
            model_name="task",
            name="depends_on",
            field=django.contrib.postgres.fields.ArrayField(
                base_field=models.BigIntegerField(),
                blank=True,
                db_default=[],
                default=list,
                size=None,
            ),
        ),
        migrations.AddField(
            model_name="task",
            name="idempotency_fingerprint",
            field=models.CharField(blank=True, editable=False, max_length=64, null=True),
        ),
        migrations.AddField(
            model_name="task",
            name="idempotency_key",
            field=models.CharField(blank=True, editable=False, max_length=255, null=True),
        ),
        migrations.AddField(
            model_name="task",
            name="max_attempt_seconds",
            field=models.PositiveIntegerField(
                blank=True,
                null=True,
                validators=[
                    django.core.validators.MinValueValidator(1),
                    django.core.validators.MaxValueValidator(604800),
                ],
            ),
        ),
        migrations.AddField(
            model_name="task",
            name="open_dependencies",
            field=models.PositiveIntegerField(db_default=0, default=0, editable=False),
        ),
        migrations.AddField(
            model_name="task",
            name="has_dependents",
            field=models.BooleanField(db_default=False, default=False, editable=False),
        ),
        migrations.AddField(
            model_name="task",
            name="parent",
            field=models.ForeignKey(
                blank=True,
                db_index=False,
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="children",
                to="board.task",
            ),
        ),
        migrations.AddField(
            model_name="task",
            name="progress",
            field=models.JSONField(blank=True, null=True),
        ),
        migrations.AlterField(
            model_name="taskevent",
            name="type",
            field=models.CharField(
                choices=[
                    ("created", "Created"),
                    ("claimed", "Claimed"),
                    ("heartbeat", "Heartbeat"),
                    ("completed", "Completed"),
                    ("failed", "Failed"),
                    ("expired", "Expired"),
                    ("released", "Released"),
                    ("escalated", "Escalated"),
                    ("requeued", "Requeued"),
                    ("resolved", "Resolved"),
                    ("cancelled", "Cancelled"),
                    ("commented", "Commented"),
                    ("unblocked", "Unblocked"),
                ],
                max_length=16,
            ),
        ),
        migrations.AddConstraint(
            model_name="task",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("max_attempt_seconds__gte", 1), ("max_attempt_seconds__lte", 604800)
                ),
                name="tasks_max_attempt_seconds_range",
            ),
        ),
        migrations.AddConstraint(
            model_name="task",
            constraint=models.CheckConstraint(
                condition=models.Q(("parent__lt", models.F("id"))), name="tasks_parent_is_older"
            ),
        ),
        migrations.AddConstraint(
            model_name="task",
            constraint=models.UniqueConstraint(
                condition=models.Q(("idempotency_key__isnull", False)),
                fields=("created_by", "idempotency_key"),
                name="tasks_idempotency_key_unique",
            ),
        ),
        migrations.AddConstraint(
            model_name="taskevent",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    (
                        "type__in",
                        [
                            "created",
                            "claimed",
                            "heartbeat",
                            "completed",
                            "failed",
                            "expired",
                            "released",
                            "escalated",
                            "requeued",
                            "resolved",
                            "cancelled",
                            "commented",
                            "unblocked",
                        ],
                    )
                ),
                name="task_events_type_valid",
            ),
        ),
        migrations.AddIndex(
            model_name="agentactivity",
            index=models.Index(fields=["hour"], name="agent_activity_hour_idx"),
        ),
        migrations.AddConstraint(
            model_name="agentactivity",
            constraint=models.UniqueConstraint(
                fields=("agent", "hour", "shard"), name="agent_activity_shard"
            ),
        ),
        migrations.AddConstraint(
            model_name="queuecounter",
            constraint=models.UniqueConstraint(
                fields=("queue", "shard"), name="queue_counters_shard"
            ),
        ),
        migrations.AddIndex(
            model_name="queuepause",
            index=models.Index(fields=["queue", "id"], name="queue_pauses_queue_idx"),
        ),
        migrations.AddField(
            model_name="taskdependency",
            name="depends_on",
            field=models.ForeignKey(
                on_delete=django.db.models.deletion.PROTECT,
                related_name="dependents",
                to="board.task",
            ),
        ),
        migrations.AddField(
            model_name="taskdependency",
            name="task",
            field=models.ForeignKey(
                db_index=False,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="dependencies",
                to="board.task",
            ),
        ),
        migrations.AddConstraint(
            model_name="taskdependency",
            constraint=models.UniqueConstraint(
                fields=("task", "depends_on"), name="task_dependencies_unique"
            ),
        ),
        migrations.AddConstraint(
            model_name="taskdependency",
            constraint=models.CheckConstraint(
                condition=models.Q(("depends_on__lt", models.F("task"))),
                name="task_dependencies_older",
            ),
        ),
        migrations.RunSQL(CLAIM_INDEXES, DROP_CLAIM_INDEXES),
        migrations.RunSQL(QUEUE_COUNTERS, DROP_QUEUE_COUNTERS),
        migrations.RunSQL(AGENT_ACTIVITY, DROP_AGENT_ACTIVITY),
    ]
