-- Announcements of new events to the server processes' relays (board.live.relay).


-- Announce, once per statement that inserts events, the highest event id it wrote, on the
-- channel task_events; nothing when it wrote none (a claim that found nothing). A
-- notification only says "read task_events": one per statement, not one per row, so a
-- claim of 100 tasks wakes each listening relay once, not 100 times, and the payload stays
-- far below NOTIFY's 8000 bytes. PostgreSQL delivers notifications when the transaction
-- commits, and drops them when it rolls back.
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

DROP TRIGGER IF EXISTS task_events_notify_insert ON task_events;
CREATE TRIGGER task_events_notify_insert
    AFTER INSERT ON task_events
    REFERENCING NEW TABLE AS new_events
    FOR EACH STATEMENT EXECUTE FUNCTION task_events_notify();
