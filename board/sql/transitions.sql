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
        idempotency_key, idempotency_fingerprint, assignee, requires
    )
    VALUES (
        %(title)s, %(description)s, %(payload)s, %(queue)s, %(priority)s, %(max_failures)s,
        %(run_after)s, 'pending', 0, %(actor)s, now(), now(),
        %(depends_on)s::bigint[], (SELECT count(*) FROM deps WHERE status <> 'done'),
        %(parent_id)s, %(max_attempt_seconds)s, %(idempotency_key)s,
        %(idempotency_fingerprint)s, %(assignee)s, %(requires)s::text[]
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
                       ELSE '{}'::jsonb END
               || CASE WHEN assignee IS NOT NULL
                       THEN jsonb_build_object('assignee', assignee)
                       ELSE '{}'::jsonb END
               || CASE WHEN requires <> '{}'
                       THEN jsonb_build_object('requires', to_jsonb(requires))
                       ELSE '{}'::jsonb END,
           now()
    FROM task
)
SELECT * FROM task;

-- name: created_with_key
-- The task that an earlier create by the same user made with this idempotency key.
SELECT * FROM tasks
WHERE created_by = %(actor)s AND idempotency_key = %(idempotency_key)s;

-- template: claim
-- Hand out up to :limit claimable tasks of :queues to %(actor)s, recording expired leases
-- on the way.
--
-- Locking scans, each on its own partial index, each FOR UPDATE SKIP LOCKED so that
-- concurrent claims pass over each other's rows instead of waiting for them:
--   * expired: in-progress tasks whose lease ran out (tasks_in_progress_lease_idx),
--     in claim order;
--   * overdue: questions unanswered past their deadline, escalated and never handed out;
--   * held: tasks held for this claimant after the answer to its question, first of all;
--   * pending: pending tasks that are due and that anyone may claim, in claim order
--     (tasks_pending_claim_idx or, for a queue filter, tasks_pending_queue_claim_idx);
--   * assigned and required: tasks assigned to this claimant, and tasks whose required
--     labels are among its capabilities, each in an index of their own, so that work
--     for others never stands in a claim's way.
-- The locking scans return the columns the rest of the statement needs: they see the row
-- as it is now, while a plain read of tasks here would see the statement's snapshot.
-- Each expired lease counts a strike: a task at max_failures is escalated and not handed
-- out; the others compete with the pending tasks in claim order. Expired tasks that lose
-- that competition go back to pending, their expiry recorded.
-- The queue condition (:queues) and the limit (:limit) are slots, filled by the variants
-- below, each prepared with a plan of its own.
-- Blocked tasks (open_dependencies > 0) are not in the pending indexes at all; tasks of a
-- paused queue are filtered out row by row, as the index scan in claim order meets them
-- (NOT EXISTS: the planner estimated a filter on an array of paused queue names at one
-- row and read and sorted every pending task instead of taking the first in the index).
-- An expired lease whose attempt deadline had passed (a heartbeat never extends a lease
-- beyond it) is recorded with reason "attempt_deadline", any other with "lease_expired".
WITH capabilities AS (
    -- The claimant's labels (none without a row): a task's requires must be among them.
    SELECT COALESCE((SELECT c.labels FROM user_capabilities c
                     JOIN auth_user u ON u.id = c.user_id
                     WHERE u.username = %(actor)s), '{}') AS labels
), expired AS (
    SELECT id, priority, created_at, failure_count, max_failures, leased_by, leased_until,
           open_dependencies,
           -- The holder's last claim or heartbeat of it: what GET agents/ shows as its
           -- last sighting once the task has left it (migration 0016).
           updated_at AS previous_seen,
           CASE WHEN max_attempt_seconds IS NOT NULL
                     AND leased_until >= attempt_started_at
                                         + make_interval(secs => max_attempt_seconds)
                THEN 'attempt_deadline' ELSE 'lease_expired' END AS reason,
           -- Whether this claimant may take it; if not, its expiry is recorded all the same.
           (assignee IS NULL OR assignee = %(actor)s)
               AND requires <@ (SELECT labels FROM capabilities) AS eligible
    FROM tasks
    WHERE status = 'in_progress'
      AND leased_until <= now()
      AND :queues
      AND NOT EXISTS (SELECT 1 FROM queue_states s WHERE s.name = tasks.queue AND s.paused)
    -- In claim order, so a higher-priority expired task is never passed over; expired
    -- leases are few, and the index range scan finds them all before this sort.
    ORDER BY priority DESC, created_at, id
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
), overdue AS (
    -- Questions that nobody answered by their deadline (tasks_awaiting_input_idx): they
    -- are escalated here, as an expired lease is recorded, and never handed out.
    SELECT id, answer_by
    FROM tasks
    WHERE status = 'awaiting_input'
      AND answer_by <= now()
      AND :queues
    ORDER BY answer_by
    LIMIT 100
    FOR UPDATE SKIP LOCKED
), held AS (
    -- Tasks held for this claimant, the agent that asked, after the answer came
    -- (tasks_held_for_idx): they come first in its claim.
    SELECT id, priority, created_at
    FROM tasks
    WHERE held_for = %(actor)s
      AND held_until > now()
      AND status = 'pending'
      AND open_dependencies = 0
      AND (run_after IS NULL OR run_after <= now())
      AND :queues
      AND NOT EXISTS (SELECT 1 FROM queue_states s WHERE s.name = tasks.queue AND s.paused)
    ORDER BY held_until
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
), pending AS (
    -- Tasks anyone may claim: unassigned, requiring nothing (the open claim indexes hold
    -- only those), and not held for another asker (a held task is passed over row by
    -- row: only the answers of the last TASKBOARD_ANSWER_HOLD_SECONDS are held).
    SELECT id, priority, created_at
    FROM tasks
    WHERE status = 'pending'
      AND open_dependencies = 0
      AND assignee IS NULL
      AND requires = '{}'
      AND (run_after IS NULL OR run_after <= now())
      AND (held_until IS NULL OR held_until <= now())
      AND :queues
      AND NOT EXISTS (SELECT 1 FROM queue_states s WHERE s.name = tasks.queue AND s.paused)
    ORDER BY priority DESC, created_at, id
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
), assigned AS (
    -- Tasks assigned to this claimant (tasks_pending_assigned_claim_idx), in claim order.
    SELECT id, priority, created_at
    FROM tasks
    WHERE status = 'pending'
      AND open_dependencies = 0
      AND assignee = %(actor)s
      AND requires <@ (SELECT labels FROM capabilities)
      AND (run_after IS NULL OR run_after <= now())
      AND (held_until IS NULL OR held_until <= now())
      AND :queues
      AND NOT EXISTS (SELECT 1 FROM queue_states s WHERE s.name = tasks.queue AND s.paused)
    ORDER BY priority DESC, created_at, id
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
), required AS (
    -- Unassigned tasks that require labels, all of them among the claimant's: found in
    -- tasks_pending_requires_idx (GIN) by a label they share with it, so tasks that need a
    -- label it lacks are never read; a claimant without labels reads nothing here.
    SELECT id, priority, created_at
    FROM tasks
    WHERE status = 'pending'
      AND open_dependencies = 0
      AND assignee IS NULL
      AND requires <> '{}'
      AND requires && (SELECT labels FROM capabilities)
      AND requires <@ (SELECT labels FROM capabilities)
      AND (run_after IS NULL OR run_after <= now())
      AND (held_until IS NULL OR held_until <= now())
      AND :queues
      AND NOT EXISTS (SELECT 1 FROM queue_states s WHERE s.name = tasks.queue AND s.paused)
    ORDER BY priority DESC, created_at, id
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
), candidates AS (
    -- The scans above find disjoint sets of tasks.
    SELECT id, priority, created_at, true AS was_expired,
           failure_count + 1 >= max_failures AS escalates, false AS overdue,
           leased_by AS previous_holder, leased_until AS previous_until, previous_seen, reason,
           -- A dependency was requeued since this task was claimed: its expiry sends it
           -- back to pending, blocked, not to another holder.
           open_dependencies > 0 AS blocked, eligible, false AS held
    FROM expired
    UNION ALL
    SELECT id, NULL, NULL, false, false, true, NULL, answer_by, NULL, NULL, false, false, false
    FROM overdue
    UNION ALL
    SELECT id, priority, created_at, false, false, false, NULL, NULL, NULL, NULL, false, true,
           true
    FROM held
    UNION ALL
    SELECT id, priority, created_at, false, false, false, NULL, NULL, NULL, NULL, false, true,
           false
    FROM pending
    UNION ALL
    SELECT id, priority, created_at, false, false, false, NULL, NULL, NULL, NULL, false, true,
           false
    FROM assigned
    UNION ALL
    SELECT id, priority, created_at, false, false, false, NULL, NULL, NULL, NULL, false, true,
           false
    FROM required
), chosen AS (
    SELECT id FROM candidates
    WHERE eligible AND NOT escalates AND NOT blocked
    ORDER BY held DESC, priority DESC, created_at, id
    LIMIT :limit
), updated AS (
    UPDATE tasks t SET
        status = CASE
            WHEN t.id IN (SELECT id FROM chosen) THEN 'in_progress'
            WHEN c.escalates OR c.overdue THEN 'escalated'
            ELSE 'pending' END,
        failure_count = t.failure_count + CASE WHEN c.was_expired THEN 1 ELSE 0 END,
        last_error = CASE
            WHEN c.reason = 'attempt_deadline'
                THEN 'attempt deadline passed (held by ' || c.previous_holder || ')'
            WHEN c.was_expired THEN 'lease expired (held by ' || c.previous_holder || ')'
            WHEN c.overdue
                THEN 'no answer by '
                     || to_char(c.previous_until AT TIME ZONE 'UTC',
                                'YYYY-MM-DD"T"HH24:MI:SS"Z"')
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
        -- A claimed task is held for nobody any more; an escalated question is closed.
        held_for = CASE WHEN t.id IN (SELECT id FROM chosen) THEN NULL ELSE t.held_for END,
        held_until = CASE WHEN t.id IN (SELECT id FROM chosen) THEN NULL ELSE t.held_until END,
        question = CASE WHEN c.overdue THEN NULL ELSE t.question END,
        answer_by = CASE WHEN c.overdue THEN NULL ELSE t.answer_by END,
        updated_at = now()
    FROM candidates c
    WHERE t.id = c.id AND (c.was_expired OR c.overdue OR t.id IN (SELECT id FROM chosen))
    RETURNING t.*, c.was_expired, c.escalates, c.overdue, c.previous_holder, c.previous_until,
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
                   'reason', CASE WHEN overdue THEN last_error
                                  WHEN reason = 'attempt_deadline'
                                  THEN 'attempt deadline passed'
                                       || ' ' || failure_count || ' of ' || max_failures
                                       || ' times'
                                  ELSE 'lease expired'
                                       || ' ' || failure_count || ' of ' || max_failures
                                       || ' times' END,
                   'failure_count', failure_count
               )
        FROM updated WHERE escalates OR overdue
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

-- The claim's variants. PostgreSQL keeps one plan per prepared statement, and a plan made
-- for "every queue" is not the one for "these queues"; so the queue condition is spelled
-- out in each rather than bound as a flag (bound client-side, a literal flag also let the
-- planner drop the condition, which a bound one would not). A claim of one task (the
-- usual) has its LIMIT spelled out too: a generic plan costs a bound LIMIT as a tenth of
-- the rows, which over a backlog of 100,000 pending tasks made PostgreSQL plan every claim
-- afresh; with LIMIT 1 its generic plan is the index scan. board.transitions.claim picks
-- one of the four named for a claim's queues and limit.

-- name: claim_any_queue_one
-- One task, from any queue (the usual claim).
-- from: claim
-- with :queues as true
-- with :limit as 1

-- name: claim_any_queue
-- Up to %(limit)s tasks, from any queue.
-- from: claim
-- with :queues as true
-- with :limit as %(limit)s

-- name: claim_in_queues_one
-- One task, from the queues %(queues)s.
-- from: claim
-- with :queues as queue = ANY(%(queues)s)
-- with :limit as 1

-- name: claim_in_queues
-- Up to %(limit)s tasks, from the queues %(queues)s.
-- from: claim
-- with :queues as queue = ANY(%(queues)s)
-- with :limit as %(limit)s

-- name: claim
-- The claim with its queue condition as a flag, %(all_queues)s, and its limit bound: one
-- text for whoever runs it as is (the benchmark's raw SQL side).
-- from: claim
-- with :queues as (%(all_queues)s OR queue = ANY(%(queues)s))
-- with :limit as %(limit)s

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

-- name: ask
-- The holder asks a person: the lease ends (no strike, the attempt clock stops) and the
-- task awaits input until answer_by, with the open question on the row. The "asked"
-- event's id is drawn first, so that the question on the task names its event.
WITH asked AS (
    SELECT nextval(pg_get_serial_sequence('task_events', 'id')) AS event_id,
           now() + make_interval(secs => %(answer_within)s) AS answer_by
), task AS (
    UPDATE tasks SET
        status = 'awaiting_input',
        question = jsonb_build_object(
            'event_id', (SELECT event_id FROM asked),
            'question', %(question)s::text,
            'options', %(options)s::jsonb,
            'answer_schema', %(answer_schema)s::jsonb,
            'assignee', %(assignee)s::text,
            'answer_by', (SELECT answer_by FROM asked),
            'action_digest', %(action_digest)s::text,
            'asked_by', %(actor)s::text,
            'asked_at', now()
        ),
        answer_by = (SELECT answer_by FROM asked),
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
    INSERT INTO task_events (id, task_id, type, status, actor, payload, created_at)
    SELECT (SELECT event_id FROM asked), id, 'asked', status, %(actor)s,
           question - 'event_id' - 'asked_by' - 'asked_at'
               || jsonb_build_object('answer_within', %(answer_within)s::integer),
           now()
    FROM task
)
SELECT * FROM task;

-- name: answer
-- A person answers the open question %(question_event)s (the one the answer was checked
-- against: a question asked again since is not answered by it). The task is pending
-- again, held for the agent that asked for %(hold_seconds)s seconds, and the answer joins
-- the task's answers.
WITH task AS (
    UPDATE tasks SET
        status = 'pending',
        answers = answers || jsonb_build_array(question || jsonb_build_object(
            'answer', %(answer)s::jsonb,
            'note', %(note)s::text,
            'answered_by', %(actor)s::text,
            'answered_at', now()
        )),
        held_for = question ->> 'asked_by',
        held_until = now() + make_interval(secs => %(hold_seconds)s),
        question = NULL,
        answer_by = NULL,
        updated_at = now()
    WHERE id = %(task_id)s
      AND status = 'awaiting_input'
      AND (question ->> 'event_id')::bigint = %(question_event)s
    RETURNING *
), event AS (
    INSERT INTO task_events (task_id, type, status, actor, payload, created_at)
    SELECT id, 'answered', status, %(actor)s,
           jsonb_build_object(
               'answer', %(answer)s::jsonb,
               'note', %(note)s::text,
               'question_event', %(question_event)s::bigint,
               'action_digest', answers -> -1 -> 'action_digest'
           ),
           now()
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

-- name: open_question
-- A task's status and open question (null unless awaiting input), which an answer is
-- checked against before the answer statement runs.
SELECT status, question FROM tasks WHERE id = %(task_id)s;
