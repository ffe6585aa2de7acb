-- The task state machine's statements, one per transition, loaded by board.sql.
--
-- Every statement changes the task and writes its event rows together (a data-modifying
-- CTE), so a transition is one round trip and can never leave a task without its event.
-- Guards live in the WHERE clause: a statement that matches no row changed nothing, and
-- board.transitions then tells "no such task" from "lease lost" or "invalid transition".
-- Parameters are psycopg named placeholders; nothing is ever formatted into the SQL.
-- now() is the transaction's start, the same instant in every guard of one transition.

-- name: create
-- Insert a pending task and its "created" event.
WITH task AS (
    INSERT INTO tasks (
        title, description, payload, queue, priority, max_failures, run_after,
        status, failure_count, created_by, created_at, updated_at
    )
    VALUES (
        %(title)s, %(description)s, %(payload)s, %(queue)s, %(priority)s, %(max_failures)s,
        %(run_after)s, 'pending', 0, %(actor)s, now(), now()
    )
    RETURNING *
), event AS (
    INSERT INTO task_events (task_id, type, status, actor, payload, created_at)
    SELECT id, 'created', status, %(actor)s,
           jsonb_build_object('title', title, 'queue', queue, 'priority', priority),
           now()
    FROM task
)
SELECT * FROM task;

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
-- %(all_queues)s is a literal true or false (client-side binding), so the planner drops
-- the queue condition entirely when it is true.
WITH expired AS (
    SELECT id, priority, created_at, failure_count, max_failures, leased_by, leased_until
    FROM tasks
    WHERE status = 'in_progress'
      AND leased_until <= now()
      AND (%(all_queues)s OR queue = ANY(%(queues)s))
    -- In claim order, so a higher-priority expired task is never passed over; expired
    -- leases are few, and the index range scan finds them all before this sort.
    ORDER BY priority DESC, created_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), pending AS (
    SELECT id, priority, created_at
    FROM tasks
    WHERE status = 'pending'
      AND (run_after IS NULL OR run_after <= now())
      AND (%(all_queues)s OR queue = ANY(%(queues)s))
    ORDER BY priority DESC, created_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), candidates AS (
    SELECT id, priority, created_at, true AS was_expired,
           failure_count + 1 >= max_failures AS escalates,
           leased_by AS previous_holder, leased_until AS previous_until
    FROM expired
    UNION ALL
    SELECT id, priority, created_at, false, false, NULL, NULL
    FROM pending
), chosen AS (
    SELECT id FROM candidates
    WHERE NOT escalates
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
            WHEN c.was_expired THEN 'lease expired (held by ' || c.previous_holder || ')'
            ELSE t.last_error END,
        leased_by = CASE WHEN t.id IN (SELECT id FROM chosen) THEN %(actor)s END,
        lease_token = CASE WHEN t.id IN (SELECT id FROM chosen) THEN gen_random_uuid() END,
        leased_until = CASE WHEN t.id IN (SELECT id FROM chosen)
            THEN now() + make_interval(secs => %(lease_seconds)s) END,
        lease_seconds = CASE WHEN t.id IN (SELECT id FROM chosen) THEN %(lease_seconds)s END,
        updated_at = now()
    FROM candidates c
    WHERE t.id = c.id AND (c.was_expired OR t.id IN (SELECT id FROM chosen))
    RETURNING t.*, c.was_expired, c.escalates, c.previous_holder, c.previous_until,
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
                   'leased_until', previous_until,
                   'failure_count', failure_count,
                   'max_failures', max_failures
               ) AS payload
        FROM updated WHERE was_expired
        UNION ALL
        SELECT id, priority, created_at, 2, 'escalated', 'escalated', 'system',
               jsonb_build_object(
                   'reason', 'lease expired ' || failure_count || ' of '
                             || max_failures || ' times',
                   'failure_count', failure_count
               )
        FROM updated WHERE escalates
        UNION ALL
        SELECT id, priority, created_at, 3, 'claimed', 'in_progress', %(actor)s,
               jsonb_build_object(
                   'lease_until', leased_until,
                   'lease_seconds', lease_seconds,
                   'failure_count', failure_count
               )
        FROM updated WHERE claimed
    ) e
    ORDER BY priority DESC, created_at, task_id, step
)
SELECT * FROM updated
ORDER BY priority DESC, created_at, id;

-- name: heartbeat
-- Push the holder's lease forward by lease_seconds (default: the length last asked for).
WITH task AS (
    UPDATE tasks SET
        lease_seconds = COALESCE(%(lease_seconds)s, lease_seconds),
        leased_until = now() + make_interval(secs => COALESCE(%(lease_seconds)s, lease_seconds)),
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
WITH task AS (
    UPDATE tasks SET
        status = 'done', result = %(result)s,
        leased_by = NULL, lease_token = NULL, leased_until = NULL, lease_seconds = NULL,
        updated_at = now()
    WHERE id = %(task_id)s
      AND status = 'in_progress'
      AND leased_by = %(actor)s
      AND lease_token = %(lease_token)s
      AND leased_until > now()
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
WITH previous AS (
    SELECT id, status FROM tasks
    WHERE id = %(task_id)s AND status IN ('escalated', 'done', 'cancelled')
    FOR UPDATE
), task AS (
    UPDATE tasks t SET
        status = 'pending', failure_count = 0, run_after = NULL, result = NULL,
        updated_at = now()
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
-- A human withdraws a pending or escalated task.
WITH previous AS (
    SELECT id, status FROM tasks
    WHERE id = %(task_id)s AND status IN ('pending', 'escalated')
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

-- name: task_status
-- Read a task's current status after a guard refused, to tell 404 from 409.
SELECT status FROM tasks WHERE id = %(task_id)s;
