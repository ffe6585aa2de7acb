-- Reading the event log in commit-safe order, for the relay and the SSE stream (board.relay).
--
-- A cursor is (txid, id): the inserting transaction's id, then the event id. Readers only
-- see events whose transaction is older than every transaction still running
-- (txid < pg_snapshot_xmin(pg_current_snapshot())). Any event not yet visible belongs to
-- a running or future transaction, whose txid is at least that horizon, so it sorts after
-- everything read so far: a cursor never skips a late commit and never repeats an event.

-- name: stream_head
-- The cursor of the last event in the stable prefix of the log (none when it is empty).
SELECT txid::text AS txid, id
FROM task_events
WHERE txid < pg_snapshot_xmin(pg_current_snapshot())
ORDER BY txid DESC, id DESC
LIMIT 1;

-- name: stream_after
-- Up to %(limit)s events after the cursor and up to the upper cursor, in stream order.
SELECT e.id, e.task_id, e.type, e.status, e.actor, e.payload, e.created_at,
       e.txid::text AS txid, t.queue, t.run_after, t.leased_until
FROM task_events e
JOIN tasks t ON t.id = e.task_id
WHERE (e.txid, e.id) > (%(txid)s::xid8, %(id)s)
  AND (e.txid, e.id) <= (%(upto_txid)s::xid8, %(upto_id)s)
  AND e.txid < pg_snapshot_xmin(pg_current_snapshot())
ORDER BY e.txid, e.id
LIMIT %(limit)s;

-- name: stream_held_back
-- Whether committed events past the cursor wait for an older transaction to finish.
SELECT EXISTS (
    SELECT 1 FROM task_events
    WHERE (txid, id) > (%(txid)s::xid8, %(id)s)
      AND txid >= pg_snapshot_xmin(pg_current_snapshot())
) AS held_back;

-- name: stream_cursor_of
-- The cursor of one event, to resume a stream from an event id.
SELECT txid::text AS txid, id FROM task_events WHERE id = %(id)s;
