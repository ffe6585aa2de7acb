"""Index the board's "recently done and cancelled" column."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [("board", "0004_pending_run_after_index")]

    operations = [
        migrations.RunSQL(
            """
            -- The board shows the latest finished tasks: without this, every page load would
            -- sort all of history by updated_at.
            CREATE INDEX tasks_finished_recent_idx ON tasks (updated_at DESC, id DESC)
                WHERE status IN ('done', 'cancelled');
            """,
            "DROP INDEX tasks_finished_recent_idx;",
        )
    ]
