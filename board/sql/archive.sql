-- Reading the event log's monthly partitions for `taskboard archive` (board.archive). The
-- partitions themselves are made and dropped by board.transitions (transitions.sql).

-- name: event_partitions
-- The monthly partitions of task_events (named task_events_YYYY_MM by migration 0011),
-- oldest first; the DEFAULT partition is not one of them.
SELECT c.relname AS name
FROM pg_inherits i
JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = 'task_events'::regclass
  AND c.relname ~ '^task_events_[0-9]{4}_[0-9]{2}$'
ORDER BY c.relname;

-- name: pending_deliveries_before
-- The deliveries still pending (neither delivered nor failed) of events dated before
-- %(before)s, per webhook: archiving their events would leave them nothing to send. Few
-- rows: the pending ones, from their partial index, each looked up in the log by id.
SELECT d.webhook_id, count(*) AS pending
FROM webhook_deliveries d
WHERE d.status = 'pending'
  AND EXISTS (SELECT 1 FROM task_events e
              WHERE e.id = d.event_id AND e.created_at < %(before)s::timestamptz)
GROUP BY d.webhook_id
ORDER BY d.webhook_id;

-- name: pending_deliveries_of_month
-- The same for the events of the month that starts at %(month)s and ends at %(next_month)s
-- (its partition only), checked again under the locks of lock_event_log.
SELECT d.webhook_id, count(*) AS pending
FROM webhook_deliveries d
WHERE d.status = 'pending'
  AND EXISTS (SELECT 1 FROM task_events e
              WHERE e.id = d.event_id
                AND e.created_at >= %(month)s::timestamptz
                AND e.created_at < %(next_month)s::timestamptz)
GROUP BY d.webhook_id
ORDER BY d.webhook_id;

-- name: lock_event_log
-- Take, first, the locks that dropping a month's partition takes (tasks, then task_events,
-- ACCESS EXCLUSIVE, in that order: migration 0011), waiting at most 200 ms for each, so
-- that this transaction's check of the month's pending deliveries still holds when the
-- partition is dropped: no event is written meanwhile (and so no delivery made), and a
-- staff retry of a failed delivery waits (retry_deliveries reads task_events). Held until
-- the transaction ends; lock_not_available is retried by the caller, as for the drop.
DO $$
BEGIN
    SET LOCAL lock_timeout = '200ms';
    LOCK TABLE tasks IN ACCESS EXCLUSIVE MODE;
    LOCK TABLE task_events IN ACCESS EXCLUSIVE MODE;
END;
$$;
