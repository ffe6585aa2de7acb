-- The event log's monthly partitions, kept by board.partitions; schema/event_log.sql
-- defines the functions these call.

-- name: ensure_event_partition
-- Create the partition of task_events for the UTC month that holds %(at)s, unless it
-- exists (moving that month's events out of the DEFAULT partition first); return its name.
SELECT task_events_ensure_partition(%(at)s::timestamptz) AS partition;

-- name: event_partitions_supported
-- Whether task_events is partitioned yet (false while the database is before 0011).
SELECT to_regprocedure('task_events_ensure_partition(timestamptz)') IS NOT NULL AS supported;

-- name: default_event_partition_months
-- The UTC months of the events that the DEFAULT partition holds before %(before)s.
SELECT DISTINCT (task_events_month(created_at)).lower_bound AS month
FROM task_events_default
WHERE created_at < %(before)s::timestamptz
ORDER BY month;

-- name: pending_deliveries_of_month
-- The deliveries still pending (neither delivered nor failed) of the events of the month
-- that starts at %(month)s and ends at %(next_month)s (its partition only), per webhook:
-- dropping the partition would leave them nothing to send. Read under the locks of
-- lock_event_log, so that none becomes pending before the drop.
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
-- ACCESS EXCLUSIVE, in that order: schema/event_log.sql), waiting at most 200 ms for each, so
-- that this transaction's check of the month's pending deliveries still holds when the
-- partition is dropped: no event is written meanwhile (and so no delivery made), and a
-- staff retry of a failed delivery waits (retry_deliveries reads task_events). Held until
-- the transaction ends; lock_not_available makes drop_event_partition try again.
DO $$
BEGIN
    SET LOCAL lock_timeout = '200ms';
    LOCK TABLE tasks IN ACCESS EXCLUSIVE MODE;
    LOCK TABLE task_events IN ACCESS EXCLUSIVE MODE;
END;
$$;

-- name: drop_event_partition
-- Detach the partition of the month that holds %(month)s, check that it holds %(count)s
-- events whose ids sum to %(id_sum)s (the archive file's), and drop it.
SELECT task_events_drop_partition(%(month)s::timestamptz, %(count)s, %(id_sum)s) AS dropped;

