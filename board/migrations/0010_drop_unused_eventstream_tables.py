"""Drop django-eventstream's tables, which nothing ever used.

The board's events live in ``task_events``; django-eventstream serves only its SSE encoder
(board.live.relay), so it is not an installed app, and its two tables, made by the
migrations before this one, go, together with the record of its migrations (so that
installing the app again, for its own storage, would make them afresh).
"""

from django.db import migrations

DROP = """
DROP TABLE IF EXISTS django_eventstream_event;
DROP TABLE IF EXISTS django_eventstream_eventcounter;
DELETE FROM django_migrations WHERE app = 'django_eventstream';
"""


class Migration(migrations.Migration):
    dependencies = [("board", "0009_notify_per_statement")]

    operations = [migrations.RunSQL(DROP, migrations.RunSQL.noop)]
