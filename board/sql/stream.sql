-- Reading the event log in commit-safe order, for the relay and the SSE stream (board.live.relay).
--
-- A cursor is (txid, id): the inserting transaction's id, then the event id. Readers only
-- take events whose transaction is older than a horizon that every transaction still able
-- to add events is at or past. Any event not yet visible belongs to such a transaction,
-- so it sorts after everything read so far: a cursor never skips a late commit and never
-- repeats an event. The simplest horizon is pg_snapshot_xmin(pg_current_snapshot()); the
-- relay computes a closer one (stream_horizon) so that transactions in other databases
-- of the same server do not hold it back.

-- name: stream_head
-- The cursor of the last event below the horizon (none when there is none).
-- ORDER BY names the table's column: an unqualified "txid" would be the text alias of the
-- output, which sorts '9999' after '10000' (a backward scan of task_events_txid_id_idx).
SELECT e.txid::text AS txid, e.id
FROM task_events e
WHERE e.txid < %(horizon)s::xid8
ORDER BY e.txid DESC, e.id DESC
LIMIT 1;

-- name: stream_horizon
-- The horizon for the next read, and whether any transaction of this database is running.
--
-- Only transactions of this database can add events, so the horizon is the oldest of them
-- still running in this statement's snapshot, or the snapshot's xmax when there is none.
-- The sessions are read after the snapshot was taken: a transaction that ended in between
-- is missing from them but its events are visible to the next statement's (later)
-- snapshot, which is the one that reads the events. Sessions of other roles hide their
-- backend_xid from a role without pg_read_all_stats: with any such session present, fall
-- back to the cluster-wide xmin. backend_xid is a 32-bit xid: compare its low bits.
WITH snap AS MATERIALIZED (
    SELECT pg_current_snapshot() AS s
), sessions AS MATERIALIZED (
    SELECT backend_xid, state, backend_type
    FROM pg_stat_activity
    WHERE datname = current_database() AND pid <> pg_backend_pid()
), writers AS (
    SELECT backend_xid::text::bigint AS xid FROM sessions WHERE backend_xid IS NOT NULL
    UNION ALL
    SELECT transaction::text::bigint FROM pg_prepared_xacts
    WHERE database = current_database()
), hidden AS (
    SELECT EXISTS (
        SELECT 1 FROM sessions WHERE state IS NULL AND backend_type = 'client backend'
    ) AS present
), running AS (
    SELECT min(x) AS oldest
    FROM snap, pg_snapshot_xip(snap.s) AS x
    WHERE mod(x::text::bigint, 4294967296) IN (SELECT xid FROM writers)
)
SELECT (CASE WHEN hidden.present THEN pg_snapshot_xmin(snap.s)
             ELSE COALESCE(running.oldest, pg_snapshot_xmax(snap.s)) END)::text AS horizon,
       running.oldest IS NOT NULL OR hidden.present AS in_flight
FROM snap, running, hidden;

-- name: stream_after
-- Up to %(limit)s events after the cursor, up to the upper cursor, below the horizon, in
-- stream order, each with its task and whether the task is still as the event left it:
-- no later event of the task has committed. Every transition that changes a task
-- writes an event, and a task's events take their ids while its row is locked, so when
-- no event of the task has a greater id, the row read here (in the same snapshot) is the
-- task as it is after this event; otherwise a later event, which the stream also sends,
-- carries it. The check is one probe of task_events_task_id_idx per event.
--
-- Large values are left in the database: the task's description, payload, result,
-- progress and last_error, and each value of the event's payload, are read only when
-- they take at most %(read_bytes)s bytes as PostgreSQL writes them (octet_length of a
-- text does not detoast it); a larger one is NULL here and named in task_elided (its
-- column) or payload_elided (its key). Every server process reads every event and keeps
-- the latest in memory (board.live.relay): a 1 MB description must not come with each
-- heartbeat of its task. The relay checks what it sends against the stream's own limit;
-- jsonb is read as its text, decoded only for an event that is sent. The task's columns
-- are the Task model's (board.live.relay._task_fields), each named here.
SELECT e.id AS event_id, e.type AS event_type, e.status AS event_status, e.actor,
       event.payload AS event_payload, event.elided AS payload_elided,
       e.created_at AS event_created_at,
       e.txid::text AS txid,
       NOT EXISTS (
           SELECT 1 FROM task_events later
           WHERE later.task_id = e.task_id AND later.id > e.id
       ) AS task_is_current,
       t.id, t.title,
       CASE WHEN NOT large.description THEN t.description END AS description,
       CASE WHEN NOT large.payload THEN t.payload::text END AS payload,
       t.queue, t.priority, t.max_failures, t.run_after, t.status, t.failure_count,
       t.leased_by, t.leased_until, t.lease_token, t.lease_seconds,
       CASE WHEN NOT large.result THEN t.result::text END AS result,
       CASE WHEN NOT large.last_error THEN t.last_error END AS last_error,
       t.created_by, t.created_at, t.updated_at, t.depends_on, t.open_dependencies,
       t.has_dependents, t.parent_id,
       CASE WHEN NOT large.progress THEN t.progress::text END AS progress,
       t.max_attempt_seconds, t.attempt_started_at, t.idempotency_key,
       t.idempotency_fingerprint, t.assignee, t.requires,
       CASE WHEN NOT large.question THEN t.question::text END AS question,
       t.answer_by,
       CASE WHEN NOT large.answers THEN t.answers::text END AS answers,
       t.held_for, t.held_until,
       array_remove(ARRAY[
           CASE WHEN large.description THEN 'description' END,
           CASE WHEN large.payload THEN 'payload' END,
           CASE WHEN large.result THEN 'result' END,
           CASE WHEN large.progress THEN 'progress' END,
           CASE WHEN large.last_error THEN 'last_error' END,
           CASE WHEN large.question THEN 'question' END,
           CASE WHEN large.answers THEN 'answers' END
       ], NULL) AS task_elided
FROM task_events e
JOIN tasks t ON t.id = e.task_id
CROSS JOIN LATERAL (
    SELECT octet_length(t.description) > %(read_bytes)s AS description,
           COALESCE(octet_length(t.payload::text) > %(read_bytes)s, false) AS payload,
           COALESCE(octet_length(t.result::text) > %(read_bytes)s, false) AS result,
           COALESCE(octet_length(t.progress::text) > %(read_bytes)s, false) AS progress,
           COALESCE(octet_length(t.last_error) > %(read_bytes)s, false) AS last_error,
           COALESCE(octet_length(t.question::text) > %(read_bytes)s, false) AS question,
           octet_length(t.answers::text) > %(read_bytes)s AS answers
) large
CROSS JOIN LATERAL (
    SELECT COALESCE(jsonb_object_agg(p.key, CASE WHEN NOT p.large THEN p.value END),
                    '{}')::text AS payload,
           COALESCE(array_agg(p.key ORDER BY p.key) FILTER (WHERE p.large), '{}') AS elided
    FROM (
        SELECT key, value, octet_length(value::text) > %(read_bytes)s AS large
        FROM jsonb_each(e.payload)
    ) p
) event
WHERE (e.txid, e.id) > (%(txid)s::xid8, %(id)s)
  AND (e.txid, e.id) <= (%(upto_txid)s::xid8, %(upto_id)s)
  AND e.txid < %(horizon)s::xid8
ORDER BY e.txid, e.id
LIMIT %(limit)s;

-- name: stream_held_back
-- Whether committed events past the cursor wait for an older transaction to finish.
SELECT EXISTS (
    SELECT 1 FROM task_events
    WHERE (txid, id) > (%(txid)s::xid8, %(id)s)
      AND txid >= %(horizon)s::xid8
) AS held_back;

-- name: stream_cursor_of
-- The cursor of one event, to resume a stream from an event id.
SELECT txid::text AS txid, id FROM task_events WHERE id = %(id)s;

-- name: credential_changes
-- How many changes of credentials each user has had (migration 0015): a relay that
-- connects again compares them with what it read before, to learn whose changed while it
-- could not hear the notifications.
SELECT user_id, changes FROM credential_changes;

-- name: credential_changes_of
-- The same for the users whose changes were just announced (and acted on).
SELECT user_id, changes FROM credential_changes WHERE user_id = ANY(%(users)s::bigint[]);
