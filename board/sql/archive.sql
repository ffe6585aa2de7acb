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
