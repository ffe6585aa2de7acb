-- The board pages' reads that the ORM cannot say (board.pages.views).

-- name: snapshot_unstable_events
-- Events this snapshot sees past the stable prefix of the log, oldest first: committed by
-- transactions at or past the horizon (stream_horizon, computed before the snapshot). A stream resumed from the stable head
-- delivers them again, so a page drawn from this snapshot must skip them.
SELECT id
FROM task_events
WHERE txid >= %(horizon)s::xid8
  AND (%(task_id)s::bigint IS NULL OR task_id = %(task_id)s::bigint)
ORDER BY id;
