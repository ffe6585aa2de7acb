-- What GET /metrics reads at each scrape (board.ops.metrics): counter rows and single index
-- steps, never a scan of tasks or task_events. The queues' counts come from queue_list
-- (queues.sql), the one GET queues/ answers from.

-- name: event_counts
-- Events ever written, by type: the shards of event_counters (schema/counters.sql) summed.
SELECT type, sum(count)::bigint AS count
FROM event_counters
GROUP BY type
ORDER BY type;

-- name: relay_behind
-- How old, by the database's clock, the oldest event past a relay's cursor is (null when
-- the relay has every event): one step up task_events_txid_id_idx. It counts committed
-- events the relay has not passed on yet, also those it holds back behind an older
-- transaction, so it grows while a relay is stuck or disconnected.
SELECT extract(epoch FROM now() - e.created_at)::float8 AS seconds
FROM task_events e
WHERE (e.txid, e.id) > (%(txid)s::xid8, %(id)s)
ORDER BY e.txid, e.id
LIMIT 1;
