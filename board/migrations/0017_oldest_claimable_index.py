"""Each queue's oldest claimable task in one index step (GET queues/, /metrics).

``oldest_pending_at`` left out tasks not due yet (``run_after`` still to come) by a filter
on the walk down ``tasks_pending_queue_created_idx`` in creation order, which read past
every scheduled or retry-delayed task of the queue: 835 ms for a queue with 200,000 tasks
scheduled for tomorrow. This index orders a queue's unblocked pending tasks by when each
is claimable from (created, or due when that is later): its first entry answers, and it is
claimable when that time has come. It replaces the index it was taken from, which nothing
else reads. The predicate keeps that index's form, which the claim's conditions do not
imply (migration 0008).
"""

from django.db import migrations

FORWARD = """
CREATE INDEX tasks_pending_queue_due_idx ON tasks (queue, (GREATEST(created_at, run_after)))
    WHERE (status = 'pending' AND open_dependencies = 0) IS TRUE;
DROP INDEX tasks_pending_queue_created_idx;
"""

BACKWARD = """
CREATE INDEX tasks_pending_queue_created_idx ON tasks (queue, created_at)
    WHERE (status = 'pending' AND open_dependencies = 0) IS TRUE;
DROP INDEX tasks_pending_queue_due_idx;
"""


class Migration(migrations.Migration):
    dependencies = [("board", "0016_agents_seen_through_expiry")]

    operations = [migrations.RunSQL(FORWARD, BACKWARD)]
