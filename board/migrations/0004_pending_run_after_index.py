"""Index the future run_after of pending tasks, for waiting claims' next wake-up time."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [("board", "0003_task_events_txid")]

    operations = [
        migrations.RunSQL(
            """
            -- Waiting claims ask when the next delayed task comes due (min(run_after)):
            -- only pending tasks with a run_after are in this index.
            CREATE INDEX tasks_pending_run_after_idx ON tasks (run_after)
                WHERE status = 'pending' AND run_after IS NOT NULL;
            """,
            "DROP INDEX tasks_pending_run_after_idx;",
        )
    ]
