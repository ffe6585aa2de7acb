-- Queues and agents at a glance (GET queues/, GET agents/, the board's panels): reads of
-- the counters that the triggers of schema/counters.sql keep, never a scan of tasks or
-- task_events.

-- name: queue_list
-- Every queue that has tasks or was ever paused, with its counts summed over the shards.
-- %(all_queues)s is a literal true or false: a user limited to queues sees only its own.
-- A page of them: the first %(limit)s (null: all) whose names sort after %(after)s (null:
-- from the first); the oldest pending task is looked up for those only.
WITH counts AS (
    SELECT queue,
           sum(pending) AS pending, sum(blocked) AS blocked,
           sum(in_progress) AS in_progress, sum(escalated) AS escalated,
           sum(done) AS done, sum(cancelled) AS cancelled,
           sum(awaiting_input) AS awaiting_input
    FROM queue_counters
    WHERE (%(all_queues)s OR queue = ANY(%(queues)s))
    GROUP BY queue
), names AS (
    SELECT queue AS name FROM counts
    WHERE pending + blocked + in_progress + escalated + done + cancelled + awaiting_input > 0
    UNION
    SELECT name FROM queue_states WHERE (%(all_queues)s OR name = ANY(%(queues)s))
)
SELECT n.name,
       COALESCE(s.paused, false) AS paused,
       COALESCE(c.pending, 0) AS pending, COALESCE(c.blocked, 0) AS blocked,
       COALESCE(c.in_progress, 0) AS in_progress, COALESCE(c.escalated, 0) AS escalated,
       COALESCE(c.done, 0) AS done, COALESCE(c.cancelled, 0) AS cancelled,
       COALESCE(c.awaiting_input, 0) AS awaiting_input,
       -- Since when its longest-waiting claimable task has been claimable (created, or
       -- due when later): one step down tasks_pending_queue_due_idx (its predicate and
       -- expression, word for word), whose first entry is claimable if its time has come.
       -- Tasks not due yet (scheduled, or failed with a retry_after) wait by design: an
       -- alert on this age must not fire for them.
       (SELECT first.since FROM (
            SELECT GREATEST(t.created_at, t.run_after) AS since FROM tasks t
            WHERE t.queue = n.name
              AND (t.status = 'pending' AND t.open_dependencies = 0) IS TRUE
            ORDER BY GREATEST(t.created_at, t.run_after) LIMIT 1
        ) first
        WHERE first.since <= now()) AS oldest_pending_at,
       s.changed_at, s.changed_by, s.note
FROM names n
LEFT JOIN counts c ON c.queue = n.name
LEFT JOIN queue_states s ON s.name = n.name
WHERE %(after)s::text IS NULL OR n.name > %(after)s::text
ORDER BY n.name
LIMIT %(limit)s;

-- name: agent_list
-- Every user that has claimed a task: the tasks it holds now (of the queues the reader
-- may see), when it was last seen (its last claim or heartbeat of a task it holds, which
-- is that task's updated_at, or its last complete, fail, release or escalate, or its last
-- claim or heartbeat of a task whose lease then expired: agent_activity), and how its
-- leases ended in the last 24 hours, counted by the hour (the current hour and the 23
-- before it).
SELECT u.username AS name,
       ARRAY(
           SELECT t.id FROM tasks t
           WHERE t.leased_by = u.username AND t.status = 'in_progress'
             AND (%(all_queues)s OR t.queue = ANY(%(queues)s))
           ORDER BY t.id
       ) AS holding,
       GREATEST(
           (SELECT max(t.updated_at) FROM tasks t
            WHERE t.leased_by = u.username AND t.status = 'in_progress'),
           (SELECT a.last_seen_at FROM agent_activity a
            WHERE a.agent = u.username AND a.last_seen_at IS NOT NULL
            ORDER BY a.hour DESC, a.last_seen_at DESC LIMIT 1)
       ) AS last_seen_at,
       COALESCE(day.completed, 0) AS completed_24h,
       COALESCE(day.failed, 0) AS failed_24h,
       COALESCE(day.expired, 0) AS expired_24h
FROM auth_user u
CROSS JOIN LATERAL (
    SELECT sum(a.completed) AS completed, sum(a.failed) AS failed, sum(a.expired) AS expired
    FROM agent_activity a
    WHERE a.agent = u.username AND a.hour > now() - interval '24 hours'
) day
WHERE EXISTS (SELECT 1 FROM agent_activity a WHERE a.agent = u.username)
   OR EXISTS (SELECT 1 FROM tasks t WHERE t.leased_by = u.username AND t.status = 'in_progress')
ORDER BY u.username;

-- name: queue_panel
-- The board's queues panel: at most %(limit)s queues, paused ones first, then the busiest
-- (most tasks pending, blocked, in progress or escalated), then by name; each as
-- queue_list has it, with how many queues there are in all (a window over every queue,
-- counted before the limit). The age of the oldest pending task, one index step each, is
-- read for the queues shown only.
WITH counts AS (
    SELECT queue,
           sum(pending) AS pending, sum(blocked) AS blocked,
           sum(in_progress) AS in_progress, sum(escalated) AS escalated,
           sum(done) AS done, sum(cancelled) AS cancelled,
           sum(awaiting_input) AS awaiting_input
    FROM queue_counters
    WHERE (%(all_queues)s OR queue = ANY(%(queues)s))
    GROUP BY queue
), names AS (
    SELECT queue AS name FROM counts
    WHERE pending + blocked + in_progress + escalated + done + cancelled + awaiting_input > 0
    UNION
    SELECT name FROM queue_states WHERE (%(all_queues)s OR name = ANY(%(queues)s))
), shown AS (
    SELECT n.name,
           COALESCE(s.paused, false) AS paused,
           COALESCE(c.pending, 0) AS pending, COALESCE(c.blocked, 0) AS blocked,
           COALESCE(c.in_progress, 0) AS in_progress, COALESCE(c.escalated, 0) AS escalated,
           COALESCE(c.done, 0) AS done, COALESCE(c.cancelled, 0) AS cancelled,
       COALESCE(c.awaiting_input, 0) AS awaiting_input,
           COALESCE(c.pending + c.blocked + c.in_progress + c.escalated, 0) AS open,
           s.changed_at, s.changed_by, s.note,
           count(*) OVER () AS queues_in_all
    FROM names n
    LEFT JOIN counts c ON c.queue = n.name
    LEFT JOIN queue_states s ON s.name = n.name
    ORDER BY paused DESC, open DESC, n.name
    LIMIT %(limit)s
)
SELECT shown.*,
       -- As in queue_list: one step down tasks_pending_queue_due_idx.
       (SELECT first.since FROM (
            SELECT GREATEST(t.created_at, t.run_after) AS since FROM tasks t
            WHERE t.queue = shown.name
              AND (t.status = 'pending' AND t.open_dependencies = 0) IS TRUE
            ORDER BY GREATEST(t.created_at, t.run_after) LIMIT 1
        ) first
        WHERE first.since <= now()) AS oldest_pending_at
FROM shown
ORDER BY paused DESC, open DESC, name;

-- name: queue_totals
-- The tasks per status over every queue the reader may see, or over one (%(queue)s): the
-- board's counts, from the counters.
SELECT COALESCE(sum(pending), 0) AS pending, COALESCE(sum(blocked), 0) AS blocked,
       COALESCE(sum(in_progress), 0) AS in_progress, COALESCE(sum(escalated), 0) AS escalated,
       COALESCE(sum(done), 0) AS done, COALESCE(sum(cancelled), 0) AS cancelled,
       COALESCE(sum(awaiting_input), 0) AS awaiting_input
FROM queue_counters
WHERE (%(all_queues)s OR queue = ANY(%(queues)s))
  AND (%(queue)s::text IS NULL OR queue = %(queue)s::text);

-- name: next_claimable_at
-- When the next task of %(queues)s (every queue when %(all_queues)s) becomes claimable, or
-- a claim has work to do, without any event to announce it: the earliest of a pending
-- task's future run_after (tasks_pending_run_after_idx), the end of a hold for an asker
-- (tasks_held_for_idx), an in-progress task's lease deadline (tasks_in_progress_lease_idx)
-- and a question's deadline (tasks_awaiting_input_idx). Paused queues are left out (their
-- resume is an event), and so are blocked tasks (their unblocking is an event). One round
-- trip for a waiting claim's empty attempt; each part its own index's scan (NOT
-- MATERIALIZED: a CTE read four times would otherwise be one scan of every task).
WITH open AS NOT MATERIALIZED (
    SELECT * FROM tasks
    WHERE (%(all_queues)s OR queue = ANY(%(queues)s))
      AND NOT EXISTS (SELECT 1 FROM queue_states s WHERE s.name = tasks.queue AND s.paused)
)
SELECT LEAST(
    (SELECT min(run_after) FROM open
     WHERE status = 'pending' AND open_dependencies = 0 AND run_after > now()),
    (SELECT min(held_until) FROM open
     WHERE status = 'pending' AND open_dependencies = 0 AND held_for IS NOT NULL
       AND held_until > now()),
    (SELECT min(leased_until) FROM open WHERE status = 'in_progress'),
    (SELECT min(answer_by) FROM open WHERE status = 'awaiting_input')
) AS at;
