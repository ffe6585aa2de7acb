"""Webhooks and their deliveries: telling humans.

A delivery is made in the same transaction as its event: a statement trigger on
task_events, like the NOTIFY trigger of 0009, inserts one row per matching active webhook
(or the email channel) for every statement that writes events, and then wakes the server
processes' dispatchers (NOTIFY webhook_deliveries, delivered at commit). A board with no
active webhook pays one probe of a tiny table per statement.

Depends on 0010: another helper makes 0011 and the lead rechains the two at merge.
"""

import django.contrib.postgres.fields
import django.db.models.deletion
import django.db.models.functions.datetime
from django.db import migrations, models

TRIGGER = """
CREATE FUNCTION task_events_deliveries() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    made bigint;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM webhooks WHERE active) THEN
        RETURN NULL;
    END IF;
    -- The task's queue as this statement left it (the trigger runs after the statement).
    WITH inserted AS (
        INSERT INTO webhook_deliveries (
            webhook_id, event_id, task_id, status, attempts, next_attempt_at,
            armed_at, created_at
        )
        SELECT w.id, e.id, e.task_id, 'pending', 0, now(), now(), now()
        FROM new_events e
        JOIN tasks t ON t.id = e.task_id
        JOIN webhooks w ON w.active
                       AND e.type = ANY(w.events)
                       AND (w.queues IS NULL OR t.queue = ANY(w.queues))
        ON CONFLICT (webhook_id, event_id) DO NOTHING
        RETURNING 1
    )
    SELECT count(*) INTO made FROM inserted;
    IF made > 0 THEN
        PERFORM pg_notify('webhook_deliveries', '');
    END IF;
    RETURN NULL;
END;
$$;

CREATE TRIGGER task_events_deliveries
    AFTER INSERT ON task_events
    REFERENCING NEW TABLE AS new_events
    FOR EACH STATEMENT EXECUTE FUNCTION task_events_deliveries();

INSERT INTO delivery_results (result, count)
VALUES ('delivered', 0), ('retried', 0), ('failed', 0);
"""

UNTRIGGER = """
DROP TRIGGER task_events_deliveries ON task_events;
DROP FUNCTION task_events_deliveries();
"""

EVENT_TYPES = [
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
]


class Migration(migrations.Migration):
    dependencies = [("board", "0011_partition_task_events")]

    operations = [
        migrations.CreateModel(
            name="Webhook",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                (
                    "kind",
                    models.CharField(
                        choices=[("webhook", "Webhook"), ("email", "Email")],
                        default="webhook",
                        max_length=16,
                    ),
                ),
                ("url", models.URLField(blank=True, default="", max_length=2000)),
                (
                    "events",
                    django.contrib.postgres.fields.ArrayField(
                        base_field=models.CharField(choices=EVENT_TYPES, max_length=32),
                        size=None,
                    ),
                ),
                (
                    "queues",
                    django.contrib.postgres.fields.ArrayField(
                        base_field=models.CharField(max_length=64),
                        blank=True,
                        null=True,
                        size=None,
                    ),
                ),
                ("secret", models.CharField(blank=True, default="", max_length=200)),
                (
                    "format",
                    models.CharField(
                        choices=[("json", "Json"), ("slack", "Slack")],
                        default="json",
                        max_length=16,
                    ),
                ),
                ("active", models.BooleanField(default=True)),
                ("created_by", models.CharField(max_length=150)),
                (
                    "created_at",
                    models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
                ),
            ],
            options={
                "db_table": "webhooks",
                "constraints": [
                    models.UniqueConstraint(
                        condition=models.Q(("kind", "email")),
                        fields=("kind",),
                        name="webhooks_one_email",
                    )
                ],
            },
        ),
        migrations.CreateModel(
            name="Delivery",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("event_id", models.BigIntegerField()),
                ("task_id", models.BigIntegerField()),
                (
                    "status",
                    models.CharField(
                        choices=[
                            ("pending", "Pending"),
                            ("delivered", "Delivered"),
                            ("failed", "Failed"),
                        ],
                        default="pending",
                        max_length=16,
                    ),
                ),
                ("attempts", models.IntegerField(default=0)),
                ("next_attempt_at", models.DateTimeField(blank=True, null=True)),
                ("leased_until", models.DateTimeField(blank=True, null=True)),
                ("lease_token", models.UUIDField(blank=True, null=True)),
                ("last_status_code", models.IntegerField(blank=True, null=True)),
                ("last_error", models.TextField(blank=True, null=True)),
                ("delivered_at", models.DateTimeField(blank=True, null=True)),
                (
                    "armed_at",
                    models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
                ),
                (
                    "created_at",
                    models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
                ),
                (
                    "webhook",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="deliveries",
                        to="board.webhook",
                    ),
                ),
            ],
            options={
                "verbose_name_plural": "deliveries",
                "db_table": "webhook_deliveries",
                "indexes": [
                    models.Index(
                        condition=models.Q(("status", "pending")),
                        fields=["next_attempt_at"],
                        name="deliveries_due_idx",
                    )
                ],
                "constraints": [
                    models.UniqueConstraint(fields=("webhook", "event_id"), name="deliveries_once")
                ],
            },
        ),
        migrations.CreateModel(
            name="DeliveryResult",
            fields=[
                ("result", models.CharField(max_length=16, primary_key=True, serialize=False)),
                ("count", models.BigIntegerField(default=0)),
            ],
            options={"db_table": "delivery_results"},
        ),
        migrations.RunSQL(TRIGGER, UNTRIGGER),
    ]
