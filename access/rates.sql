-- Per-user write rates (access.rates). Counts are kept per fixed window of %(window)s
-- seconds: it ends at the next multiple of the window since the epoch, by the database's
-- clock, so that every server process counts into the same row. A write is allowed when
-- the current window's count, plus what it adds, plus the previous window's count weighted
-- by the share of it that still lies within the last %(window)s seconds, stays within the
-- limit.

-- name: spend
-- Count %(count)s writes of %(kind)s by user %(user_id)s if that keeps the user within
-- %(limit)s; return the window's new count, or no row (nothing counted) if it would not.
-- The condition is checked again on the row as locked by the upsert, so concurrent writers
-- in any process never count past the limit together.
WITH current_window AS (
    SELECT to_timestamp((floor(extract(epoch FROM statement_timestamp()) / %(window)s) + 1)
                        * %(window)s) AS window_end
), room AS (
    SELECT w.window_end,
           %(limit)s - coalesce(p.count, 0)
               * extract(epoch FROM w.window_end - statement_timestamp())::float8
               / %(window)s AS room
    FROM current_window w
    LEFT JOIN write_counts p
           ON p.window_end = w.window_end - make_interval(secs => %(window)s)
          AND p.user_id = %(user_id)s AND p.kind = %(kind)s
)
INSERT INTO write_counts AS c (window_end, user_id, kind, count)
SELECT r.window_end, %(user_id)s, %(kind)s, %(count)s FROM room r WHERE %(count)s <= r.room
ON CONFLICT (window_end, user_id, kind) DO UPDATE SET count = c.count + excluded.count
WHERE c.count + excluded.count <= (SELECT room FROM room)
RETURNING c.count;

-- name: counts
-- The writes of %(kind)s by user %(user_id)s in the current window and in the one before
-- it, and the seconds until the current one ends (for Retry-After, after a refusal).
WITH current_window AS (
    SELECT to_timestamp((floor(extract(epoch FROM statement_timestamp()) / %(window)s) + 1)
                        * %(window)s) AS window_end
)
SELECT coalesce(sum(c.count) FILTER (WHERE c.window_end = w.window_end), 0)::int,
       coalesce(sum(c.count) FILTER (WHERE c.window_end < w.window_end), 0)::int,
       extract(epoch FROM w.window_end - statement_timestamp())::float8
FROM current_window w
LEFT JOIN write_counts c
       ON c.user_id = %(user_id)s AND c.kind = %(kind)s
      AND c.window_end IN (w.window_end, w.window_end - make_interval(secs => %(window)s))
GROUP BY w.window_end;

-- name: forget_ended_windows
-- Drop the counts of windows that ended before the previous one (run when a user's first
-- write of a window is counted): a range on the primary key.
DELETE FROM write_counts
WHERE window_end <= statement_timestamp() - make_interval(secs => %(window)s);
