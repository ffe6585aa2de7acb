-- The task state machine's statements, one per transition, loaded by board.sql.
--
-- Every statement changes the task and writes its event rows together (a data-modifying
-- CTE), so a transition is one round trip and can never leave a task without its event.
-- Guards live in the WHERE clause: a statement that matches no row changed nothing, and
-- board.transitions then tells "no such task" from "lease lost" or "invalid transition".
-- Parameters are psycopg named placeholders; nothing is ever formatted into the SQL.
-- now() is the transaction's start, the same instant in every guard of one transition.

-- name: create
-- Insert a pending task, its dependency edges and its "created" event.
--
-- The dependencies are locked, so a dependency cannot complete between the count of those
-- not done and the commit of the edges: a complete that ran first has committed when the
-- lock is granted (and the row read here is its done version); one that runs after waits
-- for this commit. Each dependency is marked has_dependents (written only when it was not
-- yet): the complete reads the mark in its own row, the version after this commit, and
-- only then runs unblock_dependents, whose own snapshot sees the new edges.
-- The lock is FOR NO KEY UPDATE, the strength of the mark's UPDATE, taken in id order: two
-- creates that share dependencies queue for them; with a share lock upgraded by the
-- UPDATE, each would wait for the other's share lock (a deadlock).
-- With an idempotency key, a repeat of the key by the same creator inserts nothing (and
-- returns no row); board.transitions then reads the task the key created.
WITH deps AS (
    SELECT id, status, has_dependents FROM tasks
    WHERE id = ANY(%(depends_on)s::bigint[])
    ORDER BY id
    FOR NO KEY UPDATE
), marked AS (
    UPDATE tasks SET has_dependents = true
    WHERE id IN (SELECT id FROM deps WHERE NOT has_dependents)
), task AS (
    INSERT INTO tasks (
        title, description, payload, queue, priority, max_failures, run_after,
        status, failure_count, created_by, created_at, updated_at,
        depends_on, open_dependencies, parent_id, max_attempt_seconds,
        idempotency_key, idempotency_fingerprint
    )
    VALUES (
        %(title)s, %(description)s, %(payload)s, %(queue)s, %(priority)s, %(max_failures)s,
        %(run_after)s, 'pending', 0, %(actor)s, now(), now(),
        %(depends_on)s::bigint[], (SELECT count(*) FROM deps WHERE status <> 'done'),
        %(parent_id)s, %(max_attempt_seconds)s, %(idempotency_key)s,
        %(idempotency_fingerprint)s
    )
    ON CONFLICT (created_by, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING *
), edges AS (
    INSERT INTO task_dependencies (task_id, depends_on_id)
    SELECT task.id, deps.id FROM task, deps
), event AS (
    INSERT INTO task_events (task_id, type, status, actor, payload, created_at)
    SELECT id, 'created', status, %(actor)s,
           jsonb_build_object('title', title, 'queue', queue, 'priority', priority)
               || CASE WHEN cardinality(depends_on) > 0
                       THEN jsonb_build_object('depends_on', to_jsonb(depends_on),
                                               'blocked', open_dependencies > 0)
                       ELSE '{}'::jsonb END
               || CASE WHEN parent_id IS NOT NULL
                       THEN jsonb_build_object('parent_id', parent_id)
                       ELSE '{}'::jsonb END,
           now()
    FROM task
)
SELECT * FROM task;

-- name: created_with_key
-- The task that an earlier create by the same user made with this idempotency key.
SELECT * FROM tasks
WHERE created_by = %(actor)s AND idempotency_key = %(idempotency_key)s;

-- name: claim
-- Hand out up to %(limit)s claimable tasks to %(actor)s, recording expired leases on the way.
--
-- Two locking scans, each on its own partial index, each FOR UPDATE SKIP LOCKED so that
-- concurrent claims pass over each other's rows instead of waiting for them:
--   * expired: in-progress tasks whose lease ran out (tasks_in_progress_lease_idx),
--     in claim order;
--   * pending: pending tasks that are due, in claim order (tasks_pending_claim_idx or,
--     for a queue filter, tasks_pending_queue_claim_idx).
-- The locking scans return the columns the rest of the statement needs: they see the row
-- as it is now, while a plain read of tasks here would see the statement's snapshot.
-- Each expired lease counts a strike: a task at max_failures is escalated and not handed
-- out; the others compete with the pending tasks in claim order. Expired tasks that lose
-- that competition go back to pending, their expiry recorded.
-- board.transitions runs this as two statements, with the queue condition replaced by
-- "true" (any queue) or by "queue = ANY(%(queues)s)" (named queues), each prepared with a
-- plan of its own; %(all_queues)s is the condition's flag for whoever runs this text as is
-- (the benchmark's raw SQL side).
-- Blocked tasks (open_dependencies > 0) are not in the pending indexes at all; tasks of a
-- paused queue are filtered out row by row, as the index scan in claim order meets them
-- (NOT EXISTS: the planner estimated a filter on an array of paused queue names at one
-- row and read and sorted every pending task instead of taking the first in the index).
-- An expired lease whose attempt deadline had passed (a heartbeat never extends a lease
-- beyond it) is recorded with reason "attempt_deadline", any other with "lease_expired".
WITH expired AS (
    SELECT id, priority, created_at, failure_count, max_failures, leased_by, leased_until,
           open_dependencies,
           -- The holder's last claim or heartbeat of it: what GET agents/ shows as its
           -- last sighting once the task has left it (migration 0016).
           updated_at AS previous_seen,
           CASE WHEN max_attempt_seconds IS NOT NULL
                     AND leased_until >= attempt_started_at
                                         + make_interval(secs => max_attempt_seconds)
                THEN 'attempt_deadline' ELSE 'lease_expired' END AS reason
    FROM tasks
    WHERE status = 'in_progress'
      AND leased_until <= now()
      AND (%(all_queues)s OR queue = ANY(%(queues)s))
      AND NOT EXISTS (SELECT 1 FROM queue_states s WHERE s.name = tasks.queue AND s.paused)
    -- In claim order, so a higher-priority expired task is never passed over; expired
    -- leases are few, and the index range scan finds them all before this sort.
    ORDER BY priority DESC, created_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), pending AS (
    SELECT id, priority, created_at
    FROM tasks
    WHERE status = 'pending'
      AND open_dependencies = 0
      AND (run_after IS NULL OR run_after <= now())
      AND (%(all_queues)s OR queue = ANY(%(queues)s))
      AND NOT EXISTS (SELECT 1 FROM queue_states s WHERE s.name = tasks.queue AND s.paused)
    ORDER BY priority DESC, created_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), candidates AS (
    SELECT id, priority, created_at, true AS was_expired,
           failure_count + 1 >= max_failures AS escalates,
           leased_by AS previous_holder, leased_until AS previous_until, previous_seen, reason,
           -- A dependency was requeued since this task was claimed: its expiry sends it
           -- back to pending, blocked, not to another holder.
           open_dependencies > 0 AS blocked
    FROM expired
    UNION ALL
    SELECT id, priority, created_at, false, false, NULL, NULL, NULL, NULL, false
    FROM pending
), chosen AS (
    SELECT id FROM candidates
    WHERE NOT escalates AND NOT blocked
    ORDER BY priority DESC, created_at, id
    LIMIT %(limit)s
), updated AS (
    UPDATE tasks t SET
        status = CASE
            WHEN t.id IN (SELECT id FROM chosen) THEN 'in_progress'
            WHEN c.escalates THEN 'escalated'
            ELSE 'pending' END,
        failure_count = t.failure_count + CASE WHEN c.was_expired THEN 1 ELSE 0 END,
        last_error = CASE
            WHEN c.reason = 'attempt_deadline'
                THEN 'attempt deadline passed (held by ' || c.previous_holder || ')'
            WHEN c.was_expired THEN 'lease expired (held by ' || c.previous_holder || ')'
            ELSE t.last_error END,
        leased_by = CASE WHEN t.id IN (SELECT id FROM chosen) THEN %(actor)s END,
        lease_token = CASE WHEN t.id IN (SELECT id FROM chosen) THEN gen_random_uuid() END,
        -- Never past the attempt deadline, which starts now.
        leased_until = CASE WHEN t.id IN (SELECT id FROM chosen)
            THEN now() + make_interval(
                secs => LEAST(%(lease_seconds)s, COALESCE(t.max_attempt_seconds,
                                                          %(lease_seconds)s))) END,
        lease_seconds = CASE WHEN t.id IN (SELECT id FROM chosen) THEN %(lease_seconds)s END,
        attempt_started_at = CASE WHEN t.id IN (SELECT id FROM chosen) THEN now() END,
        updated_at = now()
    FROM candidates c
    WHERE t.id = c.id AND (c.was_expired OR t.id IN (SELECT id FROM chosen))
    RETURNING t.*, c.was_expired, c.escalates, c.previous_holder, c.previous_until,
              c.previous_seen, c.reason,
              t.status = 'in_progress' AS claimed
), event AS (
    INSERT INTO task_events (task_id, type, status, actor, payload, created_at)
    SELECT task_id, type, status, actor, payload, now()
    FROM (
        SELECT id AS task_id, priority, created_at, 1 AS step, 'expired' AS type,
               CASE WHEN escalates THEN 'escalated' ELSE 'pending' END AS status,
               'system' AS actor,
               jsonb_build_object(
                   'previous_holder', previous_holder,
                   'previous_holder_seen_at', previous_seen,
                   'leased_until', previous_until,
                   'reason', reason,
                   'failure_count', failure_count,
                   'max_failures', max_failures
               ) AS payload
        FROM updated WHERE was_expired
        UNION ALL
        SELECT id, priority, created_at, 2, 'escalated', 'escalated', 'system',
               jsonb_build_object(
                   'reason', CASE WHEN reason = 'attempt_deadline'
                                  THEN 'attempt deadline passed'
                                  ELSE 'lease expired' END
                             || ' ' || failure_count || ' of ' || max_failures
                             || ' times',
                   'failure_count', failure_count
               )
        FROM updated WHERE escalates
        UNION ALL
        SELECT id, priority, created_at, 3, 'claimed', 'in_progress', %(actor)s,
               jsonb_build_object(
                   'lease_until', leased_until,
                   'lease_seconds', lease_seconds,
                   'failure_count', failure_count
               ) || CASE WHEN max_attempt_seconds IS NOT NULL
                         THEN jsonb_build_object(
                             'attempt_deadline',
                             attempt_started_at + make_interval(secs => max_attempt_seconds))
                         ELSE '{}'::jsonb END
        FROM updated WHERE claimed
    ) e
    ORDER BY priority DESC, created_at, task_id, step
)
SELECT * FROM updated
ORDER BY priority DESC, created_at, id;

-- name: heartbeat
-- Push the holder's lease forward by lease_seconds (default: the length last asked for),
-- never past the attempt deadline, and keep the progress it reports on the task.
WITH task AS (
    UPDATE tasks SET
        lease_seconds = COALESCE(%(lease_seconds)s, lease_seconds),
        leased_until = LEAST(
            now() + make_interval(secs => COALESCE(%(lease_seconds)s, lease_seconds)),
            attempt_started_at + make_interval(secs => max_attempt_seconds)),
        progress = COALESCE(%(progress)s::jsonb, progress),
        updated_at = now()
    WHERE id = %(task_id)s
      AND status = 'in_progress'
      AND leased_by = %(actor)s
      AND lease_token = %(lease_token)s
      AND leased_until > now()
    RETURNING *
), event AS (
    INSERT INTO task_events (task_id, type, status, actor, payload, created_at)
    SELECT id, 'heartbeat', status, %(actor)s,
           -- progress is the agent's JSON, kept as given (nulls inside it included).
           jsonb_build_object('lease_until', leased_until)
               || CASE WHEN %(progress)s::jsonb IS NULL THEN '{}'::jsonb
                       ELSE jsonb_build_object('progress', %(progress)s::jsonb) END,
           now()
    FROM task
)
SELECT * FROM task;

-- name: complete
-- Finish the holder's task with an optional result.
-- %(alone)s is true for the usual attempt, a transaction of its own: it refuses a task that
-- something depends on (has_dependents, read in the row's latest version), which
-- board.transitions then completes in a transaction with unblock_dependents.
WITH task AS (
    UPDATE tasks SET
        status = 'done', result = %(result)s,
        leased_by = NULL, lease_token = NULL, leased_until = NULL, lease_seconds = NULL,
        attempt_started_at = NULL,
        updated_at = now()
    WHERE id = %(task_id)s
      AND status = 'in_progress'
      AND leased_by = %(actor)s
      AND lease_token = %(lease_token)s
      AND leased_until > now()
      AND NOT (has_dependents AND %(alone)s)
    RETURNING *
), event AS (
    INSERT INTO task_events (task_id, type, status, actor, payload, created_at)
    SELECT id, 'completed', status, %(actor)s, jsonb_build_object('result', result), now()
    FROM task
)
SELECT * FROM task;

-- name: fail
-- Count a strike against the holder's task: back to pending (due after retry_after seconds),
-- or escalated when it reaches max_failures, recorded as "failed" then "escalated".
WITH task AS (
    UPDATE tasks SET
        failure_count = failure_count + 1,
        status = CASE WHEN failure_count + 1 >= max_failures THEN 'escalated' ELSE 'pending' END,
        run_after = CASE
            WHEN failure_count + 1 < max_failures AND %(retry_after)s::integer IS NOT NULL
                THEN now() + make_interval(secs => %(retry_after)s::integer)
            ELSE run_after END,
        last_error = %(error)s,
        leased_by = NULL, lease_token = NULL, leased_until = NULL, lease_seconds = NULL,
        attempt_started_at = NULL,
        updated_at = now()
    WHERE id = %(task_id)s
      AND status = 'in_progress'
      AND leased_by = %(actor)s
      AND lease_token = %(lease_token)s
      AND leased_until > now()
    RETURNING *
), event AS (
    INSERT INTO task_events (task_id, type, status, actor, payload, created_at)
    SELECT id, type, status, %(actor)s, payload, now()
    FROM (
        SELECT id, 1 AS step, 'failed' AS type, status,
               jsonb_strip_nulls(jsonb_build_object(
                   'error', last_error,
                   'failure_count', failure_count,
                   'max_failures', max_failures,
                   'retry_after', %(retry_after)s::integer,
                   'run_after', CASE
                       WHEN status = 'pending' AND %(retry_after)s::integer IS NOT NULL
                           THEN run_after END
               )) AS payload
        FROM task
        UNION ALL
        SELECT id, 2, 'escalated', status,
               jsonb_build_object(
                   'reason', 'failed ' || failure_count || ' of ' || max_failures || ' times',
                   'error', last_error,
                   'failure_count', failure_count
               )
        FROM task WHERE status = 'escalated'
    ) e
    ORDER BY step
)
SELECT * FROM task;

-- name: release
-- Give the holder's task back to pending without counting a strike.
WITH task AS (
    UPDATE tasks SET
        status = 'pending',
        leased_by = NULL, lease_token = NULL, leased_until = NULL, lease_seconds = NULL,
        attempt_started_at = NULL,
        updated_at = now()
    WHERE id = %(task_id)s
      AND status = 'in_progress'
      AND leased_by = %(actor)s
      AND lease_token = %(lease_token)s
      AND leased_until > now()
    RETURNING *
), event AS (
    INSERT INTO task_events (task_id, type, status, actor, payload, created_at)
    SELECT id, 'released', status, %(actor)s, '{}'::jsonb, now()
    FROM task
)
SELECT * FROM task;

-- name: escalate
-- The holder hands its task to the human queue, with a reason.
WITH task AS (
    UPDATE tasks SET
        status = 'escalated', last_error = %(reason)s,
        leased_by = NULL, lease_token = NULL, leased_until = NULL, lease_seconds = NULL,
        attempt_started_at = NULL,
        updated_at = now()
    WHERE id = %(task_id)s
      AND status = 'in_progress'
      AND leased_by = %(actor)s
      AND lease_token = %(lease_token)s
      AND leased_until > now()
    RETURNING *
), event AS (
    INSERT INTO task_events (task_id, type, status, actor, payload, created_at)
    SELECT id, 'escalated', status, %(actor)s,
           jsonb_build_object('reason', last_error, 'failure_count', failure_count), now()
    FROM task
)
SELECT * FROM task;

-- name: requeue
-- A human puts a finished, cancelled or escalated task back to pending with its strikes reset.
-- %(from)s: the statuses it applies to (some of escalated, done and cancelled), checked
-- under the row's lock: a requeue that waited for another human's resolve sees its result.
WITH previous AS (
    SELECT id, status FROM tasks
    WHERE id = %(task_id)s AND status = ANY(%(from)s::text[])
      AND status IN ('escalated', 'done', 'cancelled')
    FOR UPDATE
), task AS (
    UPDATE tasks t SET
        status = 'pending', failure_count = 0, run_after = NULL, result = NULL,
        progress = NULL, updated_at = now()
    FROM previous p
    WHERE t.id = p.id
    RETURNING t.*, p.status AS previous_status
), event AS (
    INSERT INTO task_events (task_id, type, status, actor, payload, created_at)
    SELECT id, 'requeued', status, %(actor)s,
           jsonb_strip_nulls(jsonb_build_object(
               'note', %(note)s::text, 'previous_status', previous_status
           )),
           now()
    FROM task
)
SELECT * FROM task;

-- name: resolve
-- A human settles an escalated task as done, with a note and an optional result.
WITH task AS (
    UPDATE tasks SET status = 'done', result = %(result)s, updated_at = now()
    WHERE id = %(task_id)s AND status = 'escalated'
    RETURNING *
), event AS (
    INSERT INTO task_events (task_id, type, status, actor, payload, created_at)
    SELECT id, 'resolved', status, %(actor)s,
           jsonb_strip_nulls(jsonb_build_object('note', %(note)s::text))
               || jsonb_build_object('result', result),
           now()
    FROM task
)
SELECT * FROM task;

-- name: cancel
-- A human withdraws a pending or escalated task (%(from)s: some of those, as for requeue).
WITH previous AS (
    SELECT id, status FROM tasks
    WHERE id = %(task_id)s AND status = ANY(%(from)s::text[])
      AND status IN ('pending', 'escalated')
    FOR UPDATE
), task AS (
    UPDATE tasks t SET status = 'cancelled', updated_at = now()
    FROM previous p
    WHERE t.id = p.id
    RETURNING t.*, p.status AS previous_status
), event AS (
    INSERT INTO task_events (task_id, type, status, actor, payload, created_at)
    SELECT id, 'cancelled', status, %(actor)s,
           jsonb_strip_nulls(jsonb_build_object(
               'note', %(note)s::text, 'previous_status', previous_status
           )),
           now()
    FROM task
)
SELECT * FROM task;

-- name: unblock_dependents
-- After a task with has_dependents became done (complete, resolve): one open dependency
-- fewer for each task that depends on it, and an "unblocked" event for each pending one
-- that has none left. A statement of its own in the same transaction, after the one that
-- made the task done: its snapshot sees the edges of a create that committed while that
-- statement waited for its lock, which that statement's snapshot does not.
-- The dependents are locked in id order first: two dependencies completing at once that
-- share dependents would otherwise lock them in the join's order, which may differ
-- (a deadlock).
WITH locked AS (
    SELECT t.id FROM tasks t JOIN task_dependencies d ON d.task_id = t.id
    WHERE d.depends_on_id = %(task_id)s
    ORDER BY t.id
    FOR NO KEY UPDATE OF t
), dependents AS (
    -- Only a pending dependent changes as its API shows it (blocked): a held one's
    -- updated_at is its holder's last claim or heartbeat, which GET agents/ shows as the
    -- holder's last sighting, and must not move for what another user did.
    UPDATE tasks t SET open_dependencies = t.open_dependencies - 1,
                       updated_at = CASE WHEN t.status = 'pending' THEN now()
                                         ELSE t.updated_at END
    FROM locked l
    WHERE t.id = l.id
    RETURNING t.id, t.status, t.open_dependencies
), event AS (
    INSERT INTO task_events (task_id, type, status, actor, payload, created_at)
    SELECT id, 'unblocked', status, 'system', jsonb_build_object('after', %(task_id)s::bigint),
           now()
    FROM dependents
    WHERE open_dependencies = 0 AND status = 'pending'
    ORDER BY id
)
SELECT id FROM dependents WHERE open_dependencies = 0 AND status = 'pending';

-- name: reblock_dependents
-- A done task was requeued: it is open again for every task that depends on it (locked
-- in id order, as in unblock_dependents).
WITH locked AS (
    SELECT t.id FROM tasks t JOIN task_dependencies d ON d.task_id = t.id
    WHERE d.depends_on_id = %(task_id)s
    ORDER BY t.id
    FOR NO KEY UPDATE OF t
)
-- updated_at as in unblock_dependents: only a pending dependent's.
UPDATE tasks t SET open_dependencies = t.open_dependencies + 1,
                   updated_at = CASE WHEN t.status = 'pending' THEN now() ELSE t.updated_at END
FROM locked l
WHERE t.id = l.id
RETURNING t.id;

-- name: comment
-- Add a comment to a task's history, with the task's status at that point. The task is
-- locked (FOR SHARE) so that no transition commits between reading its status and the
-- comment's event.
WITH task AS (
    SELECT id, status FROM tasks WHERE id = %(task_id)s FOR SHARE
)
INSERT INTO task_events (task_id, type, status, actor, payload, created_at)
SELECT id, 'commented', status, %(actor)s, jsonb_build_object('body', %(body)s::text), now()
FROM task
RETURNING *;

-- name: set_queue_paused
-- Pause or resume a queue, record who did it and why, and tell every server's relay
-- (channel task_queues) so that claims waiting on the queue try again at once on resume.
WITH state AS (
    INSERT INTO queue_states (name, paused, changed_at, changed_by, note)
    VALUES (%(queue)s, %(paused)s, now(), %(actor)s, COALESCE(%(note)s::text, ''))
    ON CONFLICT (name) DO UPDATE SET
        paused = EXCLUDED.paused, changed_at = EXCLUDED.changed_at,
        changed_by = EXCLUDED.changed_by, note = EXCLUDED.note
    RETURNING *
), log AS (
    INSERT INTO queue_pauses (queue, paused, actor, note, created_at)
    SELECT name, paused, changed_by, note, changed_at FROM state
)
SELECT state.*, pg_notify('task_queues', state.name) IS NULL AS notified FROM state;

-- name: task_status
-- Read a task's current status after a guard refused, to tell 404 from 409, and whether
-- its attempt deadline has passed (the detail of the 409 says so): the current attempt's,
-- or the caller's own attempt whose expiry a later claim recorded.
SELECT status,
       (status = 'in_progress'
           AND max_attempt_seconds IS NOT NULL
           AND attempt_started_at + make_interval(secs => max_attempt_seconds) <= now())
       OR (last_error = 'attempt deadline passed (held by ' || %(actor)s || ')'
           AND (status <> 'in_progress' OR leased_by <> %(actor)s))
           AS deadline_passed
FROM tasks WHERE id = %(task_id)s;

-- The event log's monthly partitions (schema/event_log.sql defines the functions these call).

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

-- Telling humans: webhooks and their deliveries (board.notifications.deliveries sends them). The
-- deliveries themselves are made by the trigger of schema/deliveries.sql, in the statement that
-- writes their event.

-- name: create_webhook
-- Add a webhook; from the next statement that writes a matching event, it gets deliveries.
INSERT INTO webhooks (kind, url, events, queues, secret, format, active, created_by, created_at)
VALUES ('webhook', %(url)s, %(events)s, %(queues)s, %(secret)s, %(format)s, true, %(actor)s,
        now())
RETURNING *;

-- name: delete_webhook
-- Remove a webhook and its deliveries (an attempt in flight then records nothing). The
-- deliveries go only when the webhook did: a data-modifying CTE always runs, so it keys
-- on the rows the webhook's DELETE returned (the email row, or an unknown id, keeps them).
WITH gone AS (
    DELETE FROM webhooks WHERE id = %(webhook_id)s AND kind = 'webhook'
    RETURNING id
), deliveries AS (
    DELETE FROM webhook_deliveries WHERE webhook_id IN (SELECT id FROM gone)
)
SELECT id FROM gone;

-- name: set_email_channel
-- Turn the escalation emails on or off (each server says at start-up whether EMAIL_URL is
-- set): one row of kind email, matching every escalation. Turned off, the emails still
-- waiting fail (staff may retry them once it is on again): none goes out weeks later,
-- and nothing is left for the dispatchers to pass over.
WITH channel AS (
    INSERT INTO webhooks (kind, url, events, queues, secret, format, active, created_by,
                          created_at)
    VALUES ('email', '', ARRAY['escalated'], NULL, '', 'json', %(active)s, 'system', now())
    ON CONFLICT (kind) WHERE kind = 'email' DO UPDATE SET active = EXCLUDED.active
    RETURNING *
), dropped AS (
    UPDATE webhook_deliveries d SET
        status = 'failed', next_attempt_at = NULL, leased_until = NULL, lease_token = NULL,
        last_error = 'not sent: EMAIL_URL was unset'
    FROM channel c
    WHERE NOT c.active AND d.webhook_id = c.id AND d.status = 'pending'
    RETURNING d.id
), counted AS (
    INSERT INTO delivery_results AS r (result, count)
    SELECT 'failed', count(*) FROM dropped HAVING count(*) > 0
    ON CONFLICT (result) DO UPDATE SET count = r.count + EXCLUDED.count
)
SELECT * FROM channel;

-- name: queue_password_reset
-- Queue a password reset email to %(address)s, through the email row while it is active
-- (EMAIL_URL set), and wake the dispatchers. Whether the address has an account is
-- looked up only when it is sent: this statement is the same for every address.
WITH made AS (
    INSERT INTO webhook_deliveries (
        webhook_id, recipient, status, attempts, next_attempt_at, armed_at, created_at
    )
    SELECT w.id, %(address)s, 'pending', 0, now(), now(), now()
    FROM webhooks w
    WHERE w.kind = 'email' AND w.active
    RETURNING id
)
SELECT id, pg_notify('webhook_deliveries', '') IS NULL AS notified FROM made;

-- name: claim_deliveries
-- Lease up to %(limit)s due deliveries to this process, oldest due first.
--
-- As a claim of tasks: FOR UPDATE SKIP LOCKED on the partial index of pending rows, so
-- that the server processes never wait for each other nor take the same delivery. The
-- lease moves next_attempt_at to its end: a process killed mid-delivery leaves a row that
-- falls due again when the lease runs out, and another process (or the restarted one)
-- tries again. Each claim counts an attempt and draws a fresh token; only the holder of
-- the token records the outcome. The deliveries of an inactive channel (the emails, with
-- EMAIL_URL unset: a staff retry meanwhile) wait, pending, until it is active again.
WITH due AS (
    SELECT id FROM webhook_deliveries d
    WHERE status = 'pending' AND next_attempt_at <= now()
      AND EXISTS (SELECT 1 FROM webhooks w WHERE w.id = d.webhook_id AND w.active)
    ORDER BY next_attempt_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE webhook_deliveries d SET
    attempts = d.attempts + 1,
    leased_until = now() + make_interval(secs => %(lease_seconds)s),
    next_attempt_at = now() + make_interval(secs => %(lease_seconds)s),
    lease_token = gen_random_uuid()
FROM due
WHERE d.id = due.id
RETURNING d.*;

-- name: delivery_succeeded
-- Record a 2xx answer, under the lease token, and count it.
WITH done AS (
    UPDATE webhook_deliveries SET
        status = 'delivered', delivered_at = now(), last_status_code = %(status_code)s,
        last_error = NULL, leased_until = NULL, lease_token = NULL, next_attempt_at = NULL
    WHERE id = %(delivery_id)s AND lease_token = %(lease_token)s AND status = 'pending'
    RETURNING id
), counted AS (
    INSERT INTO delivery_results AS r (result, count)
    SELECT 'delivered', count(*) FROM done HAVING count(*) > 0
    ON CONFLICT (result) DO UPDATE SET count = r.count + EXCLUDED.count
)
SELECT id FROM done;

-- name: delivery_attempt_failed
-- Record a failed attempt under the lease token, and count it as retried or failed. The
-- horizon is %(horizon_seconds)s after the delivery was armed (made, or retried by staff).
-- Before it, the delivery is due again after %(retry_in)s seconds, or at the horizon when
-- that would land past it: one last attempt there, so that a receiver is tried for the
-- whole horizon, not given up on when a long backoff happens to be drawn near its end. An
-- attempt that fails at or after the horizon fails the delivery for good.
WITH outcome AS (
    UPDATE webhook_deliveries SET
        status = CASE
            WHEN now() >= armed_at + make_interval(secs => %(horizon_seconds)s)
            THEN 'failed' ELSE 'pending' END,
        next_attempt_at = CASE
            WHEN now() >= armed_at + make_interval(secs => %(horizon_seconds)s) THEN NULL
            ELSE least(now() + make_interval(secs => %(retry_in)s),
                       armed_at + make_interval(secs => %(horizon_seconds)s)) END,
        last_status_code = %(status_code)s, last_error = %(error)s,
        leased_until = NULL, lease_token = NULL
    WHERE id = %(delivery_id)s AND lease_token = %(lease_token)s AND status = 'pending'
    RETURNING id, status
), counted AS (
    INSERT INTO delivery_results AS r (result, count)
    SELECT CASE WHEN o.status = 'failed' THEN 'failed' ELSE 'retried' END, 1 FROM outcome o
    ON CONFLICT (result) DO UPDATE SET count = r.count + EXCLUDED.count
)
SELECT id, status FROM outcome;

-- name: retry_deliveries
-- Re-arm failed deliveries (staff): due now, with a new horizon, and wake the dispatchers.
-- Only those whose event is still in the log: one that `taskboard archive` took out has
-- nothing left to send. Reading task_events waits for the lock that an archive holds from
-- its check for pending deliveries of a month to the drop of that month (board.ops.archive),
-- so a retry cannot make one pending in between: it re-arms before the check, which then
-- sees it, or after the drop, when its event is gone.
WITH rearmed AS (
    UPDATE webhook_deliveries d SET
        status = 'pending', next_attempt_at = now(), armed_at = now(), attempts = 0
    WHERE d.id = ANY(%(delivery_ids)s::bigint[]) AND d.status = 'failed'
      AND EXISTS (SELECT 1 FROM task_events e WHERE e.id = d.event_id)
    RETURNING d.id
)
SELECT id, pg_notify('webhook_deliveries', '') IS NULL AS notified FROM rearmed;

-- name: next_delivery_due
-- When the next pending delivery that claim_deliveries would take falls due (a retry, or
-- a lease running out), from the partial index: the dispatcher sets its timer to it.
SELECT d.next_attempt_at AS due FROM webhook_deliveries d
WHERE d.status = 'pending'
  AND EXISTS (SELECT 1 FROM webhooks w WHERE w.id = d.webhook_id AND w.active)
ORDER BY d.next_attempt_at
LIMIT 1;
