"""Partition task_events by month, so that old months can be archived.

The log keeps every event, its id, the id sequence's position, and everything 0002, 0003,
0008 and 0009 put on the table: the append-only triggers (on the parent, and cloned by
PostgreSQL onto each partition, so an UPDATE or DELETE aimed at a partition is refused
too; TRUNCATE triggers are not cloned, so each partition gets its own), the NOTIFY and
agent-counting statement triggers with their transition tables, the txid column and the
(txid, id) index that board/sql/stream.sql and board/live/relay.py read, the per-task index and
the type check.

Partitions are months of created_at in UTC, named task_events_YYYY_MM, plus a DEFAULT
partition, task_events_default, so that an insert never fails for lack of a partition
(an event dated in a month nobody prepared lands there). task_events_ensure_partition()
makes a month's partition, moving that month's rows out of the default first; this
migration makes one for every month that has events and for the next three, and
board.transitions makes the current and next month's at most once per process per month,
and every ``migrate`` the next three (board.apps), so the default stays empty in practice.
Only task_events_drop_partition(), called by ``taskboard archive`` (board/ops/archive.py),
removes events, a whole verified month at a time.

The rows are copied once, under the table's exclusive lock: a large log takes a while to
migrate (about the time of one INSERT ... SELECT of the whole table).
"""

from django.db import migrations

FUNCTIONS = """
-- Locks. Making, detaching or dropping a partition takes task_events' ACCESS EXCLUSIVE lock
-- and, for the partitions' foreign key to tasks, a SHARE ROW EXCLUSIVE (make, detach) or
-- ACCESS EXCLUSIVE (drop) lock on tasks, while transitions lock tasks and task_events in
-- the other order, or in one statement. Taken as they come, the two orders deadlock (a
-- test with agents working during an archive did). So these functions take every lock
-- they will need first, tasks then task_events, before any slow step, and wait at most
-- lock_timeout = 200 ms for each: shorter than deadlock_timeout (1 s by default), so in a
-- deadlock it is always this side that gives up (with lock_not_available, which the
-- callers retry), never a transition.
-- The bounds of the UTC month that holds p_at, and its partition's name.
CREATE FUNCTION task_events_month(p_at timestamptz, OUT lower_bound timestamptz,
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
CREATE FUNCTION task_events_ensure_partition(p_at timestamptz) RETURNS text
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
-- statement triggers, and a TRUNCATE aimed at a partition fires only the partition's.
CREATE FUNCTION task_events_create_partition(p_name text, p_lower timestamptz,
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
CREATE FUNCTION task_events_drop_partition(p_at timestamptz, p_count bigint,
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
"""

DROP_FUNCTIONS = """
DROP FUNCTION task_events_drop_partition(timestamptz, bigint, numeric);
DROP FUNCTION task_events_ensure_partition(timestamptz);
DROP FUNCTION task_events_create_partition(text, timestamptz, timestamptz);
DROP FUNCTION task_events_month(timestamptz);
"""

# The triggers of 0002, 0008 and 0009 and the indexes of 0001 and 0003, as they stand after
# 0010; both directions put them back on the new table.
TRIGGERS = """
CREATE TRIGGER task_events_append_only_row
    BEFORE UPDATE OR DELETE ON task_events
    FOR EACH ROW EXECUTE FUNCTION task_events_refuse_change();
CREATE TRIGGER task_events_append_only_truncate
    BEFORE TRUNCATE ON task_events
    FOR EACH STATEMENT EXECUTE FUNCTION task_events_refuse_change();
CREATE TRIGGER task_events_notify_insert
    AFTER INSERT ON task_events
    REFERENCING NEW TABLE AS new_events
    FOR EACH STATEMENT EXECUTE FUNCTION task_events_notify();
CREATE TRIGGER task_events_count_agents
    AFTER INSERT ON task_events REFERENCING NEW TABLE AS inserted_events
    FOR EACH STATEMENT EXECUTE FUNCTION task_events_count_agents();
"""

INDEXES = """
CREATE INDEX task_events_task_id_idx ON task_events (task_id, id);
CREATE INDEX task_events_txid_id_idx ON task_events (txid, id);
"""

# Copy the foreign keys (Django's name and DEFERRABLE INITIALLY DEFERRED) from the old
# table, by their definitions.
COPY_FOREIGN_KEYS = """
DO $$
DECLARE
    fk record;
BEGIN
    FOR fk IN
        SELECT conname, pg_get_constraintdef(oid) AS definition FROM pg_constraint
        WHERE conrelid = 'task_events_old'::regclass AND contype = 'f'
    LOOP
        EXECUTE format('ALTER TABLE task_events ADD CONSTRAINT %I %s',
                       fk.conname, fk.definition);
    END LOOP;
END;
$$;
"""

# Both directions first put the table as it is aside, with its index names, and keep its id
# sequence's position for the new table's sequence.
SET_ASIDE = """
ALTER TABLE task_events RENAME TO task_events_old;
ALTER TABLE task_events_old RENAME CONSTRAINT task_events_pkey TO task_events_old_pkey;
ALTER INDEX task_events_task_id_idx RENAME TO task_events_old_task_id_idx;
ALTER INDEX task_events_txid_id_idx RENAME TO task_events_old_txid_id_idx;
CREATE TEMPORARY TABLE task_events_sequence ON COMMIT DROP AS
    SELECT last_value, is_called FROM task_events_id_seq;
"""

# The whole migration holds both tables; taken first, tasks then task_events (the order of a
# transition's statement), so that a transition waits instead of deadlocking with it.
LOCK_BOTH = "LOCK TABLE tasks, task_events IN ACCESS EXCLUSIVE MODE;"

PARTITION = f"""
{LOCK_BOTH}
{SET_ASIDE}
ALTER SEQUENCE task_events_id_seq RENAME TO task_events_old_id_seq;

-- The same columns, types, defaults, NOT NULLs and type check, partitioned by created_at.
-- Ids come from one sequence shared by every partition (an identity column, as Django made
-- it, is not possible on a partitioned table before PostgreSQL 17), so they stay unique
-- across partitions. The primary key must include the partition key, so it is
-- (id, created_at): PostgreSQL can only enforce uniqueness within a partition; id alone is
-- unique because only the sequence hands ids out.
CREATE TABLE task_events (LIKE task_events_old INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
    PARTITION BY RANGE (created_at);
CREATE SEQUENCE task_events_id_seq OWNED BY task_events.id;
SELECT setval('task_events_id_seq', last_value, is_called) FROM task_events_sequence;
ALTER TABLE task_events ALTER COLUMN id SET DEFAULT nextval('task_events_id_seq');

{FUNCTIONS}

-- A partition for every month that has events, the next three months, and the default.
SELECT task_events_ensure_partition(month)
FROM (
    SELECT DISTINCT date_trunc('month', created_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'
        AS month
    FROM task_events_old
    UNION
    SELECT now() + make_interval(months => ahead) FROM generate_series(0, 3) AS ahead
) months;
SELECT task_events_create_partition('task_events_default', NULL, NULL);

-- Every event, with its id, txid and time. No trigger is on the new table yet: the copy
-- sends no NOTIFY and counts no agent twice. Indexes are built after the copy.
INSERT INTO task_events SELECT * FROM task_events_old ORDER BY id;

ALTER TABLE task_events ADD CONSTRAINT task_events_pkey PRIMARY KEY (id, created_at);
{INDEXES}
{COPY_FOREIGN_KEYS}
DROP TABLE task_events_old;
{TRIGGERS}
"""

# Back to one table: the same columns with an identity column again, at the sequence's
# position. The partitions' TRUNCATE triggers go with them.
UNPARTITION = f"""
{LOCK_BOTH}
{SET_ASIDE}
ALTER TABLE task_events_old ALTER COLUMN id DROP DEFAULT;
DROP SEQUENCE task_events_id_seq;

CREATE TABLE task_events (LIKE task_events_old INCLUDING DEFAULTS INCLUDING CONSTRAINTS);
ALTER TABLE task_events ALTER COLUMN id ADD GENERATED BY DEFAULT AS IDENTITY;
SELECT setval('task_events_id_seq', last_value, is_called) FROM task_events_sequence;
INSERT INTO task_events SELECT * FROM task_events_old ORDER BY id;
ALTER TABLE task_events ADD CONSTRAINT task_events_pkey PRIMARY KEY (id);
{INDEXES}
{COPY_FOREIGN_KEYS}
DROP TABLE task_events_old;
{DROP_FUNCTIONS}
{TRIGGERS}
"""


class Migration(migrations.Migration):
    dependencies = [("board", "0010_drop_unused_eventstream_tables")]

    operations = [migrations.RunSQL(PARTITION, UNPARTITION)]
