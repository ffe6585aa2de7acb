-- The event log, task_events: append-only, partitioned by month of created_at (UTC).
--
-- Partitions are named task_events_YYYY_MM, plus a DEFAULT partition, task_events_default,
-- so that an insert never fails for lack of a partition. board.partitions makes the
-- current and next month's at most once per process per month, before a transition writes
-- events, and every `migrate` the next three (board.apps); only task_events_drop_partition(), called by `taskboard archive`
-- (board/ops/archive.py), removes events, a whole verified month at a time.
--
-- Locks. Making, detaching or dropping a partition takes task_events' ACCESS EXCLUSIVE lock
-- and, for the partitions' foreign key to tasks, a SHARE ROW EXCLUSIVE (make, detach) or
-- ACCESS EXCLUSIVE (drop) lock on tasks, while transitions lock tasks and task_events in
-- the other order, or in one statement. Taken as they come, the two orders deadlock. So
-- these functions take every lock they will need first, tasks then task_events, before any
-- slow step, and wait at most lock_timeout = 200 ms for each: shorter than
-- deadlock_timeout (1 s by default), so in a deadlock it is always this side that gives up
-- (with lock_not_available, which the callers retry), never a transition.


-- Refuse any change to a recorded event. task_events is the audit log: rows are inserted,
-- never changed or removed, by anyone; triggers fire for every role, superusers included.
-- The error names the constraint task_events_append_only, which board.exceptions turns
-- into EventLogIsAppendOnly.
CREATE OR REPLACE FUNCTION task_events_refuse_change() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'task_events is append-only: % is not allowed', TG_OP
        USING ERRCODE = 'restrict_violation',
              CONSTRAINT = 'task_events_append_only',
              HINT = 'Record a new event instead.';
END;
$$;

-- The bounds of the UTC month that holds p_at, and its partition's name.
CREATE OR REPLACE FUNCTION task_events_month(p_at timestamptz, OUT lower_bound timestamptz,
                                  OUT upper_bound timestamptz, OUT partition_name text)
LANGUAGE sql STABLE AS $$
    SELECT date_trunc('month', p_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC',
           (date_trunc('month', p_at AT TIME ZONE 'UTC') + interval '1 month')
               AT TIME ZONE 'UTC',
           'task_events_' || to_char(p_at AT TIME ZONE 'UTC', 'YYYY_MM')
$$;

-- Create the partition of the month that holds p_at, unless it exists; return its name.
--
-- Creating a partition while the DEFAULT partition holds rows of its month is refused by
-- PostgreSQL, so then the default is emptied first: detached, every month it holds gets
-- its partition, its rows are copied into them (straight into the partitions, so no
-- trigger of the parent fires again: no second NOTIFY, no second agent count; ids and
-- txids are copied as they are), a fresh default is attached and the old one dropped.
-- Nothing is updated or deleted. Creators are serialized by a transaction-level advisory
-- lock; CREATE TABLE ... PARTITION OF and DETACH take task_events' ACCESS EXCLUSIVE lock,
-- so inserts wait for this transaction (milliseconds when the default is empty).
CREATE OR REPLACE FUNCTION task_events_ensure_partition(p_at timestamptz) RETURNS text
LANGUAGE plpgsql SET lock_timeout = '200ms' AS $$
DECLARE
    month record;
    held record;
    default_holds_month boolean := false;
BEGIN
    SELECT * INTO month FROM task_events_month(p_at);
    IF to_regclass(month.partition_name) IS NOT NULL THEN
        RETURN month.partition_name;
    END IF;
    PERFORM pg_advisory_xact_lock(hashtext('task_events_ensure_partition'));
    IF to_regclass(month.partition_name) IS NOT NULL THEN
        RETURN month.partition_name;  -- another process made it while we waited
    END IF;
    IF to_regclass('task_events_default') IS NOT NULL THEN
        -- (A separate statement: it cannot be planned before the default exists.)
        SELECT EXISTS (
            SELECT 1 FROM task_events_default
            WHERE created_at >= month.lower_bound AND created_at < month.upper_bound
        ) INTO default_holds_month;
    END IF;
    IF default_holds_month THEN
        -- The old default is dropped below, which drops its foreign key: ACCESS EXCLUSIVE
        -- on tasks. (LOCK TABLE task_events also locks every partition.)
        LOCK TABLE tasks IN ACCESS EXCLUSIVE MODE;
        LOCK TABLE task_events IN ACCESS EXCLUSIVE MODE;
        ALTER TABLE task_events DETACH PARTITION task_events_default;
        ALTER TABLE task_events_default RENAME TO task_events_default_emptied;
        FOR held IN
            SELECT DISTINCT (task_events_month(created_at)).* FROM task_events_default_emptied
        LOOP
            PERFORM task_events_create_partition(held.partition_name, held.lower_bound,
                                                 held.upper_bound);
        END LOOP;
        PERFORM task_events_create_partition(month.partition_name, month.lower_bound,
                                             month.upper_bound);
        PERFORM task_events_create_partition('task_events_default', NULL, NULL);
        FOR held IN
            SELECT DISTINCT (task_events_month(created_at)).* FROM task_events_default_emptied
        LOOP
            EXECUTE format(
                'INSERT INTO %I SELECT * FROM task_events_default_emptied'
                ' WHERE created_at >= $1 AND created_at < $2',
                held.partition_name
            ) USING held.lower_bound, held.upper_bound;
        END LOOP;
        DROP TABLE task_events_default_emptied;
    ELSE
        PERFORM task_events_create_partition(month.partition_name, month.lower_bound,
                                             month.upper_bound);
    END IF;
    RETURN month.partition_name;
END;
$$;

-- Create one partition (the DEFAULT one when the bounds are null) with its own TRUNCATE
-- trigger: PostgreSQL clones the parent's row triggers onto a new partition, but not its
-- statement triggers, and a TRUNCATE aimed at a partition fires only the partition's. (The
-- same trigger as the one the block at the end of this file puts on existing partitions.)
CREATE OR REPLACE FUNCTION task_events_create_partition(p_name text, p_lower timestamptz,
                                             p_upper timestamptz) RETURNS void
LANGUAGE plpgsql SET lock_timeout = '200ms' AS $$
BEGIN
    IF to_regclass(p_name) IS NOT NULL THEN
        RETURN;
    END IF;
    LOCK TABLE tasks IN SHARE ROW EXCLUSIVE MODE;  -- for the new partition's foreign key
    LOCK TABLE ONLY task_events IN ACCESS EXCLUSIVE MODE;
    IF p_lower IS NULL THEN
        EXECUTE format('CREATE TABLE %I PARTITION OF task_events DEFAULT', p_name);
    ELSE
        -- Bounds are written in UTC, whatever the session's time zone.
        EXECUTE format(
            'CREATE TABLE %I PARTITION OF task_events FOR VALUES FROM (%L) TO (%L)',
            p_name,
            to_char(p_lower AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS+00'),
            to_char(p_upper AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS+00'));
    END IF;
    EXECUTE format(
        'CREATE TRIGGER task_events_append_only_truncate BEFORE TRUNCATE ON %I'
        ' FOR EACH STATEMENT EXECUTE FUNCTION task_events_refuse_change()', p_name);
END;
$$;

-- Archive's last step for one month: detach its partition, check that it holds exactly
-- the events the archive file holds (p_count rows whose ids sum to p_id_sum), and drop it;
-- raise (so the caller's transaction undoes the detach) if it does not. The check runs
-- on the detached table, under task_events' ACCESS EXCLUSIVE lock, so no event can arrive
-- in the month between the check and the drop. Return the number of events dropped.
CREATE OR REPLACE FUNCTION task_events_drop_partition(p_at timestamptz, p_count bigint,
                                           p_id_sum numeric) RETURNS bigint
LANGUAGE plpgsql SET lock_timeout = '200ms' AS $$
DECLARE
    month record;
    found_count bigint;
    found_sum numeric;
BEGIN
    SELECT * INTO month FROM task_events_month(p_at);
    IF to_regclass(month.partition_name) IS NULL THEN
        RAISE EXCEPTION 'task_events has no partition %', month.partition_name
            USING ERRCODE = 'undefined_table';
    END IF;
    -- Dropping the partition drops its foreign key: ACCESS EXCLUSIVE on tasks.
    LOCK TABLE tasks IN ACCESS EXCLUSIVE MODE;
    LOCK TABLE task_events IN ACCESS EXCLUSIVE MODE;
    EXECUTE format('ALTER TABLE task_events DETACH PARTITION %I', month.partition_name);
    EXECUTE format('SELECT count(*), coalesce(sum(id), 0) FROM %I', month.partition_name)
        INTO found_count, found_sum;
    IF found_count <> p_count OR found_sum <> p_id_sum THEN
        RAISE EXCEPTION 'partition % holds % events (ids summing to %), the archive % (%)',
            month.partition_name, found_count, found_sum, p_count, p_id_sum
            USING ERRCODE = 'data_exception', CONSTRAINT = 'task_events_archive_verified';
    END IF;
    EXECUTE format('DROP TABLE %I', month.partition_name);
    RETURN found_count;
END;
$$;

-- The append-only guard. The row trigger on the parent is cloned by PostgreSQL onto every
-- partition, present and future, so an UPDATE or DELETE aimed at a partition is refused
-- too. A TRUNCATE trigger is not cloned: the parent has one, and each partition its own
-- (below, and in task_events_create_partition for the partitions made later).
DROP TRIGGER IF EXISTS task_events_append_only_row ON task_events;
CREATE TRIGGER task_events_append_only_row
    BEFORE UPDATE OR DELETE ON task_events
    FOR EACH ROW EXECUTE FUNCTION task_events_refuse_change();

DROP TRIGGER IF EXISTS task_events_append_only_truncate ON task_events;
CREATE TRIGGER task_events_append_only_truncate
    BEFORE TRUNCATE ON task_events
    FOR EACH STATEMENT EXECUTE FUNCTION task_events_refuse_change();

DO $$
DECLARE
    part regclass;
BEGIN
    FOR part IN
        SELECT inhrelid::regclass FROM pg_inherits WHERE inhparent = 'task_events'::regclass
    LOOP
        EXECUTE format('DROP TRIGGER IF EXISTS task_events_append_only_truncate ON %s', part);
        EXECUTE format(
            'CREATE TRIGGER task_events_append_only_truncate BEFORE TRUNCATE ON %s'
            ' FOR EACH STATEMENT EXECUTE FUNCTION task_events_refuse_change()', part);
    END LOOP;
END;
$$;
