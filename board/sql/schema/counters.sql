-- Counters kept by the database in step with every statement that writes tasks or events,
-- so that GET queues/, GET agents/ and /metrics read a few counter rows instead of
-- scanning tables that only grow, and read the same from every server process.
--
-- A single counter row per key would make every transition on it wait for the previous
-- one's commit. Instead each count is spread over shard rows: a transaction adds its
-- changes to the first shard row no other transaction holds (FOR UPDATE SKIP LOCKED), or
-- adds a shard when all are held. Concurrent transitions never wait for each other, and a
-- key has about as many shards as it ever had concurrent writers. Readers sum the shards.
-- A new shard's number is random, not the next one: two transactions that both added "the
-- next" shard would wait for each other's commit (and could deadlock). A number taken
-- already (by a committed row) makes the insert do nothing, and the loop looks again.


-- Add the given moves to one shard of p_queue's task counts (queue_counters).
CREATE OR REPLACE FUNCTION queue_counters_add(
    p_queue text, p_pending bigint, p_blocked bigint, p_in_progress bigint,
    p_escalated bigint, p_done bigint, p_cancelled bigint, p_awaiting_input bigint
) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    LOOP
        -- The first shard row of the queue that no other transaction holds.
        UPDATE queue_counters SET
            pending = pending + p_pending, blocked = blocked + p_blocked,
            in_progress = in_progress + p_in_progress, escalated = escalated + p_escalated,
            done = done + p_done, cancelled = cancelled + p_cancelled,
            awaiting_input = awaiting_input + p_awaiting_input
        WHERE id = (SELECT id FROM queue_counters
                    WHERE queue = p_queue ORDER BY shard LIMIT 1 FOR UPDATE SKIP LOCKED);
        IF FOUND THEN
            RETURN;
        END IF;
        -- Every shard is held by another transaction: add one, with a random number.
        INSERT INTO queue_counters
            (queue, shard, pending, blocked, in_progress, escalated, done, cancelled,
             awaiting_input)
        VALUES (p_queue, (random() * 2147483646)::integer, p_pending, p_blocked,
                p_in_progress, p_escalated, p_done, p_cancelled, p_awaiting_input)
        ON CONFLICT (queue, shard) DO NOTHING;
        IF FOUND THEN
            RETURN;
        END IF;
    END LOOP;
END;
$$;

-- The counter a task is counted in: its status, with blocked apart from pending.
CREATE OR REPLACE FUNCTION task_count_bucket(status text, open_dependencies integer)
RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN status = 'pending' AND open_dependencies > 0 THEN 'blocked'
                ELSE status END
$$;

-- Count the tasks a statement inserts, per queue and bucket.
CREATE OR REPLACE FUNCTION tasks_count_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM queue_counters_add(
        queue,
        count(*) FILTER (WHERE bucket = 'pending'),
        count(*) FILTER (WHERE bucket = 'blocked'),
        count(*) FILTER (WHERE bucket = 'in_progress'),
        count(*) FILTER (WHERE bucket = 'escalated'),
        count(*) FILTER (WHERE bucket = 'done'),
        count(*) FILTER (WHERE bucket = 'cancelled'),
        count(*) FILTER (WHERE bucket = 'awaiting_input'))
    FROM (SELECT queue, task_count_bucket(status, open_dependencies) AS bucket
          FROM inserted_tasks) t
    GROUP BY queue;
    RETURN NULL;
END;
$$;

-- Move the tasks a statement updates from their old bucket to their new one. A task's
-- queue never changes, and a heartbeat moves nothing: it takes no counter row.
CREATE OR REPLACE FUNCTION tasks_count_update() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM queue_counters_add(queue, pending, blocked, in_progress, escalated, done, cancelled,
                               awaiting_input)
    FROM (
        SELECT queue,
               sum(CASE bucket WHEN 'pending' THEN n ELSE 0 END) AS pending,
               sum(CASE bucket WHEN 'blocked' THEN n ELSE 0 END) AS blocked,
               sum(CASE bucket WHEN 'in_progress' THEN n ELSE 0 END) AS in_progress,
               sum(CASE bucket WHEN 'escalated' THEN n ELSE 0 END) AS escalated,
               sum(CASE bucket WHEN 'done' THEN n ELSE 0 END) AS done,
               sum(CASE bucket WHEN 'cancelled' THEN n ELSE 0 END) AS cancelled,
               sum(CASE bucket WHEN 'awaiting_input' THEN n ELSE 0 END) AS awaiting_input
        FROM (
            SELECT o.queue, task_count_bucket(o.status, o.open_dependencies) AS bucket,
                   -1 AS n
            FROM old_tasks o
            UNION ALL
            SELECT n.queue, task_count_bucket(n.status, n.open_dependencies), 1
            FROM new_tasks n
        ) moves
        GROUP BY queue
    ) deltas
    WHERE (pending, blocked, in_progress, escalated, done, cancelled, awaiting_input)
          IS DISTINCT FROM (0, 0, 0, 0, 0, 0, 0);
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS tasks_count_insert ON tasks;
CREATE TRIGGER tasks_count_insert
    AFTER INSERT ON tasks REFERENCING NEW TABLE AS inserted_tasks
    FOR EACH STATEMENT EXECUTE FUNCTION tasks_count_insert();

DROP TRIGGER IF EXISTS tasks_count_update ON tasks;
CREATE TRIGGER tasks_count_update
    AFTER UPDATE ON tasks REFERENCING OLD TABLE AS old_tasks NEW TABLE AS new_tasks
    FOR EACH STATEMENT EXECUTE FUNCTION tasks_count_update();


-- Add to one shard of p_agent's row of this hour in agent_activity: how its leases ended,
-- and when it was last seen (never going back). GET agents/ reads it beside the
-- updated_at of the tasks an agent holds (board.queues).
CREATE OR REPLACE FUNCTION agent_activity_add(
    p_agent text, p_seen timestamptz, p_completed bigint, p_failed bigint, p_expired bigint
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    h timestamptz := date_trunc('hour', now());
BEGIN
    LOOP
        -- The first shard row of this hour that no other transaction holds.
        UPDATE agent_activity SET
            last_seen_at = GREATEST(last_seen_at, p_seen),
            completed = completed + p_completed, failed = failed + p_failed,
            expired = expired + p_expired
        WHERE id = (SELECT id FROM agent_activity
                    WHERE agent = p_agent AND hour = h
                    ORDER BY shard LIMIT 1 FOR UPDATE SKIP LOCKED);
        IF FOUND THEN
            RETURN;
        END IF;
        INSERT INTO agent_activity (agent, hour, shard, last_seen_at, completed, failed, expired)
        VALUES (p_agent, h, (random() * 2147483646)::integer, p_seen, p_completed, p_failed,
                p_expired)
        ON CONFLICT (agent, hour, shard) DO NOTHING;
        IF FOUND THEN
            RETURN;
        END IF;
    END LOOP;
END;
$$;

-- Count, per agent, the events of a statement that end a lease (complete, fail, release,
-- escalate by its holder) or record its expiry (by the system: the agent is the previous
-- holder, last seen when it last claimed or heartbeat the task, which the claim puts in
-- the payload as previous_holder_seen_at). Claims and heartbeats count nothing: an agent
-- that holds tasks is seen through their updated_at. One call per statement, however many
-- events it inserts.
CREATE OR REPLACE FUNCTION task_events_count_agents() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM agent_activity_add(
        agent,
        -- An expiry's sighting may be older than the agent's latest, filed under an earlier
        -- hour: GET agents/ reads the newest hour's row, which must never go back.
        GREATEST(
            max(seen_at),
            CASE WHEN bool_or(type = 'expired') THEN (
                SELECT a.last_seen_at FROM agent_activity a
                WHERE a.agent = e.agent AND a.last_seen_at IS NOT NULL
                ORDER BY a.hour DESC, a.last_seen_at DESC LIMIT 1
            ) END),
        count(*) FILTER (WHERE type = 'completed'),
        count(*) FILTER (WHERE type = 'failed'),
        count(*) FILTER (WHERE type = 'expired'))
    FROM (
        SELECT CASE WHEN type = 'expired' THEN payload->>'previous_holder' ELSE actor END
                   AS agent,
               type,
               CASE WHEN type = 'expired'
                    THEN (payload->>'previous_holder_seen_at')::timestamptz
                    ELSE created_at END AS seen_at
        FROM inserted_events
        WHERE type = 'expired'
           OR (type IN ('completed', 'failed', 'released', 'escalated') AND actor <> 'system')
    ) e
    WHERE agent IS NOT NULL
    GROUP BY agent;
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS task_events_count_agents ON task_events;
CREATE TRIGGER task_events_count_agents
    AFTER INSERT ON task_events REFERENCING NEW TABLE AS inserted_events
    FOR EACH STATEMENT EXECUTE FUNCTION task_events_count_agents();


-- Add p_count to one shard of p_type's event counter (event_counters), read by
-- taskboard_events_total on /metrics: the same from every server process, and never back
-- to zero when one restarts.
CREATE OR REPLACE FUNCTION event_counters_add(p_type text, p_count bigint) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    LOOP
        UPDATE event_counters SET count = count + p_count
        WHERE id = (SELECT id FROM event_counters
                    WHERE type = p_type ORDER BY shard LIMIT 1 FOR UPDATE SKIP LOCKED);
        IF FOUND THEN
            RETURN;
        END IF;
        INSERT INTO event_counters (type, shard, count)
        VALUES (p_type, (random() * 2147483646)::integer, p_count)
        ON CONFLICT (type, shard) DO NOTHING;
        IF FOUND THEN
            RETURN;
        END IF;
    END LOOP;
END;
$$;

-- Count the events a statement inserts, by type: a claim of 100 tasks adds 100 to one row.
CREATE OR REPLACE FUNCTION task_events_count_types() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- In type order, so that two statements of several types take their shards in the
    -- same order (SKIP LOCKED never waits, but the insert of a new shard may).
    -- Besides the types, 'unanswered' counts the escalations of questions nobody answered
    -- in time (the claim's, by system), which /metrics reports apart.
    PERFORM event_counters_add(type, n)
    FROM (
        SELECT type, count(*) AS n FROM inserted_events GROUP BY type
        UNION ALL
        SELECT 'unanswered', count(*) FROM inserted_events
        WHERE type = 'escalated' AND actor = 'system'
          AND payload ->> 'reason' LIKE 'no answer by %'
        HAVING count(*) > 0
        ORDER BY type
    ) c;
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS task_events_count_types ON task_events;
CREATE TRIGGER task_events_count_types
    AFTER INSERT ON task_events REFERENCING NEW TABLE AS inserted_events
    FOR EACH STATEMENT EXECUTE FUNCTION task_events_count_types();
