"""What the ORM cannot say: the claim's partial indexes, the insert-only event log, the
NOTIFY of each event, and autovacuum settings for a table of short-lived, hot rows."""

from django.db import migrations

PARTIAL_INDEXES = """
-- Claims read only pending and in-progress rows. Partial indexes keep finished tasks out of
-- them entirely, so a claim costs the same with a million done tasks as with a hundred.

-- Pending tasks in claim order, for a claim on every queue.
CREATE INDEX tasks_pending_claim_idx
    ON tasks (priority DESC, created_at, id)
    WHERE status = 'pending';

-- Pending tasks in claim order within a queue, for a claim that names its queues.
CREATE INDEX tasks_pending_queue_claim_idx
    ON tasks (queue, priority DESC, created_at, id)
    WHERE status = 'pending';

-- Live and expired leases by deadline: the claim's scan for expired leases reads only the
-- in-progress rows whose deadline has passed.
CREATE INDEX tasks_in_progress_lease_idx
    ON tasks (leased_until)
    WHERE status = 'in_progress';

-- The API's filters on the task list.
CREATE INDEX tasks_status_id_idx ON tasks (status, id);
CREATE INDEX tasks_leased_by_idx ON tasks (leased_by) WHERE leased_by IS NOT NULL;
"""

DROP_PARTIAL_INDEXES = """
DROP INDEX tasks_pending_claim_idx;
DROP INDEX tasks_pending_queue_claim_idx;
DROP INDEX tasks_in_progress_lease_idx;
DROP INDEX tasks_status_id_idx;
DROP INDEX tasks_leased_by_idx;
"""

APPEND_ONLY = """
-- task_events is the audit log: rows are inserted, never changed or removed, by anyone.
-- Triggers fire for every role, superusers included. The error names the constraint
-- task_events_append_only, which board.exceptions turns into EventLogIsAppendOnly.
CREATE FUNCTION task_events_refuse_change() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'task_events is append-only: % is not allowed', TG_OP
        USING ERRCODE = 'restrict_violation',
              CONSTRAINT = 'task_events_append_only',
              HINT = 'Record a new event instead.';
END;
$$;

CREATE TRIGGER task_events_append_only_row
    BEFORE UPDATE OR DELETE ON task_events
    FOR EACH ROW EXECUTE FUNCTION task_events_refuse_change();

CREATE TRIGGER task_events_append_only_truncate
    BEFORE TRUNCATE ON task_events
    FOR EACH STATEMENT EXECUTE FUNCTION task_events_refuse_change();
"""

DROP_APPEND_ONLY = """
DROP TRIGGER task_events_append_only_truncate ON task_events;
DROP TRIGGER task_events_append_only_row ON task_events;
DROP FUNCTION task_events_refuse_change();
"""

NOTIFY = """
-- Each new event is announced on the channel task_events with its id only (NOTIFY payloads
-- are capped at 8000 bytes; listeners read the row). PostgreSQL delivers notifications
-- when the transaction commits, and drops them when it rolls back.
CREATE FUNCTION task_events_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('task_events', NEW.id::text);
    RETURN NULL;
END;
$$;

CREATE TRIGGER task_events_notify_insert
    AFTER INSERT ON task_events
    FOR EACH ROW EXECUTE FUNCTION task_events_notify();
"""

DROP_NOTIFY = """
DROP TRIGGER task_events_notify_insert ON task_events;
DROP FUNCTION task_events_notify();
"""

AUTOVACUUM = """
-- Every task row is rewritten several times in a few minutes (claim, heartbeats, complete),
-- and status changes touch indexed columns, so most updates leave a dead tuple and index
-- entries behind. Vacuum this table after 1% of it has changed (default: 20%), without
-- throttling, so the claim's indexes stay small; leave room on each page for new versions.
ALTER TABLE tasks SET (
    fillfactor = 80,
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 500,
    autovacuum_vacuum_insert_scale_factor = 0.05,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 0
);
"""

RESET_AUTOVACUUM = """
ALTER TABLE tasks RESET (
    fillfactor,
    autovacuum_vacuum_scale_factor,
    autovacuum_vacuum_threshold,
    autovacuum_vacuum_insert_scale_factor,
    autovacuum_analyze_scale_factor,
    autovacuum_vacuum_cost_delay
);
"""


class Migration(migrations.Migration):
    dependencies = [("board", "0001_initial")]

    operations = [
        migrations.RunSQL(PARTIAL_INDEXES, DROP_PARTIAL_INDEXES),
        migrations.RunSQL(APPEND_ONLY, DROP_APPEND_ONLY),
        migrations.RunSQL(NOTIFY, DROP_NOTIFY),
        migrations.RunSQL(AUTOVACUUM, RESET_AUTOVACUUM),
    ]
