-- Telling humans: webhooks and their deliveries, the statements of
-- board.notifications.deliveries, which sends them. The deliveries themselves are made by
-- the trigger of board/sql/schema/deliveries.sql, in the statement that writes their event.
-- Parameters are psycopg named placeholders; nothing is ever formatted into the SQL.

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
