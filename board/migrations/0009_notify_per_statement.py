"""One NOTIFY per statement that writes events, not one per event row.

A claim of 100 tasks wrote 100 notifications into PostgreSQL's notify queue (each with its
own payload, so none were folded together), and woke every listening relay 100 times, each
to read the same rows. The relay never used the payloads: a notification only says "read
task_events". Now each INSERT into task_events notifies once, with the highest event id it
wrote, and not at all when it wrote none (a claim that found nothing).
"""

from django.db import migrations

PER_STATEMENT = """
CREATE OR REPLACE FUNCTION task_events_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    last_id bigint;
BEGIN
    SELECT max(id) INTO last_id FROM new_events;
    IF last_id IS NOT NULL THEN
        PERFORM pg_notify('task_events', last_id::text);
    END IF;
    RETURN NULL;
END;
$$;

DROP TRIGGER task_events_notify_insert ON task_events;
CREATE TRIGGER task_events_notify_insert
    AFTER INSERT ON task_events
    REFERENCING NEW TABLE AS new_events
    FOR EACH STATEMENT EXECUTE FUNCTION task_events_notify();
"""

PER_ROW = """
CREATE OR REPLACE FUNCTION task_events_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('task_events', NEW.id::text);
    RETURN NULL;
END;
$$;

DROP TRIGGER task_events_notify_insert ON task_events;
CREATE TRIGGER task_events_notify_insert
    AFTER INSERT ON task_events
    FOR EACH ROW EXECUTE FUNCTION task_events_notify();
"""


class Migration(migrations.Migration):
    dependencies = [("board", "0008_work_graphs")]

    operations = [migrations.RunSQL(PER_STATEMENT, PER_ROW)]
