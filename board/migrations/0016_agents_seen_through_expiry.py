"""An agent's last sighting survives the expiry of its lease.

``GET agents/`` shows when each agent was last seen: its last claim or heartbeat of a
task it holds (that task's ``updated_at``), or its last complete, fail, release or
escalate (``agent_activity``, kept by the trigger of migration 0008). Claims and
heartbeats write nothing to ``agent_activity``, so once an expired lease was claimed by
another agent, its holder's last claim or heartbeat of it was forgotten and its
``last_seen_at`` went back in time.

The claim that records an expiry now puts that moment in the ``expired`` event's payload
(``previous_holder_seen_at``: the task's ``updated_at`` as the holder left it), and the
trigger counts it as the previous holder's sighting, never earlier than the latest one
already counted (which may be of an earlier hour's row).
"""

from django.db import migrations

COUNT_AGENTS = """
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
        -- What a lease holder does to end its lease, and the expiry of a lease (recorded
        -- by the system: the agent is the holder whose lease ran out, last seen when it
        -- last claimed or heartbeat the task).
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
"""

# Migration 0008's function.
COUNT_AGENTS_BEFORE = """
CREATE OR REPLACE FUNCTION task_events_count_agents() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM agent_activity_add(
        agent,
        max(created_at) FILTER (WHERE type <> 'expired'),
        count(*) FILTER (WHERE type = 'completed'),
        count(*) FILTER (WHERE type = 'failed'),
        count(*) FILTER (WHERE type = 'expired'))
    FROM (
        SELECT CASE WHEN type = 'expired' THEN payload->>'previous_holder' ELSE actor END
                   AS agent,
               type, created_at
        FROM inserted_events
        WHERE type = 'expired'
           OR (type IN ('completed', 'failed', 'released', 'escalated') AND actor <> 'system')
    ) e
    WHERE agent IS NOT NULL
    GROUP BY agent;
    RETURN NULL;
END;
$$;
"""


class Migration(migrations.Migration):
    dependencies = [("board", "0015_credential_changes")]

    operations = [migrations.RunSQL(COUNT_AGENTS, COUNT_AGENTS_BEFORE)]
