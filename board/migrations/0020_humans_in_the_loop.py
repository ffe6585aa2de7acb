"""Humans in the loop (contract: "Additions to v1 (second round)"): questions and answers,
assigned tasks and capabilities.

The claim's open indexes now hold only the tasks anyone may claim (unassigned, requiring
no label), so that tasks for someone else cost a claim nothing however many there are;
a claimant finds its own assigned tasks in one index and the tasks whose labels it may
have in a GIN index, by the labels they share with its capabilities.
"""

import django.contrib.postgres.fields
import django.core.validators
import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models

from board.sql.schema import ApplySchema

INDEXES = """
DROP INDEX tasks_pending_claim_idx;
CREATE INDEX tasks_pending_claim_idx ON tasks (priority DESC, created_at, id)
    WHERE status = 'pending' AND open_dependencies = 0 AND assignee IS NULL
      AND requires = '{}';
DROP INDEX tasks_pending_queue_claim_idx;
CREATE INDEX tasks_pending_queue_claim_idx ON tasks (queue, priority DESC, created_at, id)
    WHERE status = 'pending' AND open_dependencies = 0 AND assignee IS NULL
      AND requires = '{}';
-- A claimant's own assigned tasks, in claim order.
CREATE INDEX tasks_pending_assigned_claim_idx
    ON tasks (assignee, priority DESC, created_at, id)
    WHERE status = 'pending' AND open_dependencies = 0 AND assignee IS NOT NULL;
-- Unassigned tasks that require labels, found by a label they share with the claimant.
CREATE INDEX tasks_pending_requires_idx ON tasks USING gin (requires)
    WHERE status = 'pending' AND open_dependencies = 0 AND assignee IS NULL
      AND requires <> '{}';
-- Tasks held for the agent that asked, after the answer.
CREATE INDEX tasks_held_for_idx ON tasks (held_for, held_until) WHERE held_for IS NOT NULL;
-- Open questions by deadline: the claim escalates the overdue ones, waiting claims wake
-- at the nearest.
CREATE INDEX tasks_awaiting_input_idx ON tasks (answer_by) WHERE status = 'awaiting_input';
-- GET tasks/?assignee= and ?requires=.
CREATE INDEX tasks_assignee_idx ON tasks (assignee, id) WHERE assignee IS NOT NULL;
CREATE INDEX tasks_requires_idx ON tasks USING gin (requires) WHERE requires <> '{}';
CREATE INDEX tasks_question_assignee_idx ON tasks ((question -> 'assignee'))
    WHERE question IS NOT NULL;
-- The counters' function takes the new bucket; the schema files define it anew.
DROP FUNCTION IF EXISTS queue_counters_add(text, bigint, bigint, bigint, bigint, bigint, bigint);
"""

UNDO_INDEXES = """
-- The counters as they were (board/sql/schema/counters.sql before this migration), before
-- the column they now count is dropped.
CREATE OR REPLACE FUNCTION queue_counters_add(
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
        -- Every shard is held by another transaction: add one, with a random number.
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

CREATE OR REPLACE FUNCTION tasks_count_insert() RETURNS trigger
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

CREATE OR REPLACE FUNCTION tasks_count_update() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
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
    WHERE (pending, blocked, in_progress, escalated, done, cancelled)
          IS DISTINCT FROM (0, 0, 0, 0, 0, 0);
    RETURN NULL;
END;
$$;

CREATE OR REPLACE FUNCTION task_events_count_types() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- In type order, so that two statements of several types take their shards in the
    -- same order (SKIP LOCKED never waits, but the insert of a new shard may).
    PERFORM event_counters_add(type, n)
    FROM (SELECT type, count(*) AS n FROM inserted_events GROUP BY type ORDER BY type) c;
    RETURN NULL;
END;
$$;
DROP FUNCTION IF EXISTS queue_counters_add(
    text, bigint, bigint, bigint, bigint, bigint, bigint, bigint);
DROP INDEX tasks_question_assignee_idx;
DROP INDEX tasks_requires_idx;
DROP INDEX tasks_assignee_idx;
DROP INDEX tasks_awaiting_input_idx;
DROP INDEX tasks_held_for_idx;
DROP INDEX tasks_pending_requires_idx;
DROP INDEX tasks_pending_assigned_claim_idx;
DROP INDEX tasks_pending_queue_claim_idx;
CREATE INDEX tasks_pending_queue_claim_idx ON tasks (queue, priority DESC, created_at, id)
    WHERE status = 'pending' AND open_dependencies = 0;
DROP INDEX tasks_pending_claim_idx;
CREATE INDEX tasks_pending_claim_idx ON tasks (priority DESC, created_at, id)
    WHERE status = 'pending' AND open_dependencies = 0;
"""


class Migration(migrations.Migration):
    dependencies = [
        ("auth", "0012_alter_user_first_name_max_length"),
        ("board", "0019_schema_from_files"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name="Capabilities",
            fields=[
                (
                    "user",
                    models.OneToOneField(
                        on_delete=django.db.models.deletion.CASCADE,
                        primary_key=True,
                        related_name="capabilities",
                        serialize=False,
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
                (
                    "labels",
                    django.contrib.postgres.fields.ArrayField(
                        base_field=models.CharField(
                            max_length=64,
                            validators=[
                                django.core.validators.RegexValidator(
                                    "^[a-z0-9][a-z0-9:._-]{0,63}\\Z",
                                    "Labels are 1 to 64 characters of a-z, 0-9, ':', '.', '_' and '-', starting with a-z or 0-9.",
                                )
                            ],
                        ),
                        blank=True,
                        default=list,
                        help_text="Comma-separated labels, e.g. gpu,python.",
                        size=None,
                    ),
                ),
            ],
            options={
                "verbose_name": "capabilities",
                "verbose_name_plural": "capabilities",
                "db_table": "user_capabilities",
            },
        ),
        migrations.AlterModelOptions(
            name="task",
            options={
                "ordering": ["-id"],
                "permissions": [("answer_task", "Can answer the questions agents ask")],
            },
        ),
        migrations.RemoveConstraint(
            model_name="task",
            name="tasks_status_valid",
        ),
        migrations.RemoveConstraint(
            model_name="taskevent",
            name="task_events_type_valid",
        ),
        migrations.AddField(
            model_name="queuecounter",
            name="awaiting_input",
            field=models.BigIntegerField(db_default=0, default=0),
        ),
        migrations.AddField(
            model_name="task",
            name="answer_by",
            field=models.DateTimeField(blank=True, editable=False, null=True),
        ),
        migrations.AddField(
            model_name="task",
            name="answers",
            field=models.JSONField(blank=True, db_default=[], default=list, editable=False),
        ),
        migrations.AddField(
            model_name="task",
            name="assignee",
            field=models.ForeignKey(
                blank=True,
                db_column="assignee",
                db_index=False,
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="+",
                to=settings.AUTH_USER_MODEL,
                to_field="username",
            ),
        ),
        migrations.AddField(
            model_name="task",
            name="held_for",
            field=models.CharField(blank=True, editable=False, max_length=150, null=True),
        ),
        migrations.AddField(
            model_name="task",
            name="held_until",
            field=models.DateTimeField(blank=True, editable=False, null=True),
        ),
        migrations.AddField(
            model_name="task",
            name="question",
            field=models.JSONField(blank=True, editable=False, null=True),
        ),
        migrations.AddField(
            model_name="task",
            name="requires",
            field=django.contrib.postgres.fields.ArrayField(
                base_field=models.CharField(
                    max_length=64,
                    validators=[
                        django.core.validators.RegexValidator(
                            "^[a-z0-9][a-z0-9:._-]{0,63}\\Z",
                            "Labels are 1 to 64 characters of a-z, 0-9, ':', '.', '_' and '-', starting with a-z or 0-9.",
                        )
                    ],
                ),
                blank=True,
                db_default=[],
                default=list,
                size=20,
            ),
        ),
        migrations.AlterField(
            model_name="task",
            name="status",
            field=models.CharField(
                choices=[
                    ("pending", "Pending"),
                    ("in_progress", "In Progress"),
                    ("done", "Done"),
                    ("escalated", "Escalated"),
                    ("cancelled", "Cancelled"),
                    ("awaiting_input", "Awaiting Input"),
                ],
                default="pending",
                max_length=16,
            ),
        ),
        migrations.AlterField(
            model_name="taskevent",
            name="status",
            field=models.CharField(
                choices=[
                    ("pending", "Pending"),
                    ("in_progress", "In Progress"),
                    ("done", "Done"),
                    ("escalated", "Escalated"),
                    ("cancelled", "Cancelled"),
                    ("awaiting_input", "Awaiting Input"),
                ],
                max_length=16,
            ),
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
                    ("asked", "Asked"),
                    ("answered", "Answered"),
                ],
                max_length=16,
            ),
        ),
        migrations.AlterField(
            model_name="webhook",
            name="events",
            field=django.contrib.postgres.fields.ArrayField(
                base_field=models.CharField(
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
                        ("asked", "Asked"),
                        ("answered", "Answered"),
                    ],
                    max_length=32,
                ),
                size=None,
            ),
        ),
        migrations.AddConstraint(
            model_name="task",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    (
                        "status__in",
                        [
                            "pending",
                            "in_progress",
                            "done",
                            "escalated",
                            "cancelled",
                            "awaiting_input",
                        ],
                    )
                ),
                name="tasks_status_valid",
            ),
        ),
        migrations.AddConstraint(
            model_name="task",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    models.Q(
                        ("answer_by__isnull", False),
                        ("question__isnull", False),
                        ("status", "awaiting_input"),
                    ),
                    models.Q(
                        models.Q(("status", "awaiting_input"), _negated=True),
                        ("answer_by__isnull", True),
                        ("question__isnull", True),
                    ),
                    _connector="OR",
                ),
                name="tasks_question_iff_awaiting_input",
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
                            "asked",
                            "answered",
                        ],
                    )
                ),
                name="task_events_type_valid",
            ),
        ),
        migrations.RunSQL(INDEXES, UNDO_INDEXES),
        ApplySchema("ea21ffe87ff29924"),
    ]
