"""Events by type, counted by the database (``/metrics``).

``taskboard_events_total`` must read the same from every server process of
``serve --workers N`` (a scrape reaches one of them at random) and must not fall back to
zero when a process restarts, or Prometheus would take each such step for a counter
reset. A count kept in each process by its relay would be neither; a ``count(*)`` of
task_events at each scrape would be a scan of a table that only grows. So a statement
trigger adds what each statement inserts into sharded counter rows, as queue_counters does
for tasks (migration 0008).
"""

from django.db import migrations, models

EVENT_COUNTERS = """
ALTER TABLE event_counters SET (fillfactor = 50);

-- Add p_count to one shard of p_type's counter: the first shard row no other transaction
-- holds (FOR UPDATE SKIP LOCKED), or a new one when all are held, exactly as
-- queue_counters_add (migration 0008) does, and for the same reason: concurrent claims
-- and completes never wait for each other's commit here.
CREATE FUNCTION event_counters_add(p_type text, p_count bigint) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    LOOP
        UPDATE event_counters SET count = count + p_count
        WHERE id = (SELECT id FROM event_counters
                    WHERE type = p_type ORDER BY shard LIMIT 1 FOR UPDATE SKIP LOCKED);
        IF FOUND THEN
            RETURN;
        END IF;
        -- A random shard number, as in queue_counters_add.
        INSERT INTO event_counters (type, shard, count)
        VALUES (p_type, (random() * 2147483646)::integer, p_count)
        ON CONFLICT (type, shard) DO NOTHING;
        IF FOUND THEN
            RETURN;
        END IF;
    END LOOP;
END;
$$;

CREATE FUNCTION task_events_count_types() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- In type order, so that two statements of several types take their shards in the
    -- same order (SKIP LOCKED never waits, but the insert of a new shard may).
    PERFORM event_counters_add(type, n)
    FROM (SELECT type, count(*) AS n FROM inserted_events GROUP BY type ORDER BY type) c;
    RETURN NULL;
END;
$$;

-- One call per statement: a claim of 100 tasks adds 100 to one row.
CREATE TRIGGER task_events_count_types
    AFTER INSERT ON task_events REFERENCING NEW TABLE AS inserted_events
    FOR EACH STATEMENT EXECUTE FUNCTION task_events_count_types();

-- The events already there, counted once.
INSERT INTO event_counters (type, shard, count)
SELECT type, 0, count(*) FROM task_events GROUP BY type;
"""

DROP_EVENT_COUNTERS = """
DROP TRIGGER task_events_count_types ON task_events;
DROP FUNCTION task_events_count_types();
DROP FUNCTION event_counters_add(text, bigint);
DELETE FROM event_counters;
"""


class Migration(migrations.Migration):
    dependencies = [("board", "0012_webhooks")]

    operations = [
        migrations.CreateModel(
            name="EventCounter",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("type", models.CharField(max_length=20)),
                ("shard", models.IntegerField()),
                ("count", models.BigIntegerField(default=0)),
            ],
            options={"db_table": "event_counters"},
        ),
        migrations.AddConstraint(
            model_name="eventcounter",
            constraint=models.UniqueConstraint(
                fields=("type", "shard"), name="event_counters_shard"
            ),
        ),
        migrations.RunSQL(EVENT_COUNTERS, DROP_EVENT_COUNTERS),
    ]
