-- The throttle on failed authentication (access.throttle). A window is fixed: it ends at
-- the next multiple of %(window)s seconds since the epoch, by the database's clock, so
-- that every server process counts into the same row.

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
)
SELECT failures, ceil(extract(epoch FROM window_end - statement_timestamp()))::int
FROM failure;

-- name: failures
-- The failed authentications from %(address)s in the current window, and the whole
-- seconds until it ends; no row when there were none.
SELECT failures, ceil(extract(epoch FROM window_end - statement_timestamp()))::int
FROM auth_failures
WHERE window_end = to_timestamp((floor(extract(epoch FROM statement_timestamp()) / %(window)s) + 1)
                                * %(window)s)
  AND address = %(address)s;

-- name: forget_ended_windows
-- Drop the counts of windows that have ended (run when a window's first failure is
-- counted, so at most once per address and window): a range on the primary key.
DELETE FROM auth_failures WHERE window_end <= statement_timestamp();
