-- The throttle on failed authentication (access.throttle). Counts are kept per fixed
-- window: it ends at the next multiple of %(window)s seconds since the epoch, by the
-- database's clock, so that every server process counts into the same row. The check
-- weighs the previous window's count too, so that the limit holds over any span of that
-- length, not only within one window.

-- name: record_failure
-- Count one failed authentication from %(address)s in the current window; return the
-- window's count and the whole seconds until it ends.
WITH failure AS (
    INSERT INTO auth_failures AS f (window_end, address, failures)
    VALUES (
        to_timestamp((floor(extract(epoch FROM statement_timestamp()) / %(window)s) + 1)
                     * %(window)s),
        %(address)s,
        1
    )
    ON CONFLICT (window_end, address) DO UPDATE SET failures = f.failures + 1
    RETURNING failures, window_end
), announced AS (
    -- The address's first failure of this window: every server process forgets it
    -- (access.throttle.CleanAddresses), at the commit of this same statement.
    SELECT pg_notify('auth_failures', %(address)s) FROM failure WHERE failures = 1
)
-- The announced column is read by nobody, and must stay: PostgreSQL runs a SELECT in a WITH
-- only as far as the outer query reads it, so without it no NOTIFY would be sent.
SELECT failures, ceil(extract(epoch FROM window_end - statement_timestamp()))::int,
       (SELECT count(*) FROM announced) AS announced
FROM failure;

-- name: failures
-- The failed authentications from %(address)s in the current window and in the one before
-- it, and the seconds until the current one ends (access.throttle weighs the two).
WITH current_window AS (
    SELECT to_timestamp((floor(extract(epoch FROM statement_timestamp()) / %(window)s) + 1)
                        * %(window)s) AS window_end
)
SELECT coalesce(sum(f.failures) FILTER (WHERE f.window_end = w.window_end), 0)::int,
       coalesce(sum(f.failures) FILTER (WHERE f.window_end < w.window_end), 0)::int,
       extract(epoch FROM w.window_end - statement_timestamp())::float8
FROM current_window w
LEFT JOIN auth_failures f
       ON f.address = %(address)s
      AND f.window_end IN (w.window_end, w.window_end - make_interval(secs => %(window)s))
GROUP BY w.window_end;

-- name: forget_ended_windows
-- Drop the counts of windows that ended before the previous one (run when a window's
-- first failure is counted, so at most once per address and window): a range on the
-- primary key.
DELETE FROM auth_failures
WHERE window_end <= statement_timestamp() - make_interval(secs => %(window)s);

