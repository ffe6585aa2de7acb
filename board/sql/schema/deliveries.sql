-- Webhook and email deliveries, made in the same transaction as their event.


-- For every statement that writes events, insert one delivery row per matching active
-- webhook (or the email channel), then wake the server processes' dispatchers
-- (board.notifications.deliveries) with NOTIFY webhook_deliveries, delivered at commit. A board with no
-- active webhook pays one probe of a tiny table per statement. The task's queue is read as
-- the statement left it (the trigger runs after the statement).
CREATE OR REPLACE FUNCTION task_events_deliveries() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    made bigint;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM webhooks WHERE active) THEN
        RETURN NULL;
    END IF;
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

DROP TRIGGER IF EXISTS task_events_deliveries ON task_events;
CREATE TRIGGER task_events_deliveries
    AFTER INSERT ON task_events
    REFERENCING NEW TABLE AS new_events
    FOR EACH STATEMENT EXECUTE FUNCTION task_events_deliveries();
