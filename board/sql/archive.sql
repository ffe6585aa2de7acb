-- Reading the event log's monthly partitions for `taskboard archive` (board.ops.archive). The
-- partitions themselves are made and dropped by board.partitions (partitions.sql).

-- name: event_partitions
-- The monthly partitions of task_events (named task_events_YYYY_MM by schema/event_log.sql),
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
