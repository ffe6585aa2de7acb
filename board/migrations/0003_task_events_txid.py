"""Record the inserting transaction's id on every event, for gap-free readers.

Event ids come from a sequence, so a transaction can commit after a later id is already
visible. A reader that follows ids would skip the late one. Readers instead follow
(txid, id) and only read events whose transaction is older than every transaction still
running (txid < pg_snapshot_xmin(pg_current_snapshot())): that prefix of the log can no
longer change, so a cursor into it never skips or repeats an event. See board/live/relay.py.
"""

from django.db import migrations

ADD = """
ALTER TABLE task_events
    ADD COLUMN txid xid8 NOT NULL DEFAULT pg_current_xact_id();
CREATE INDEX task_events_txid_id_idx ON task_events (txid, id);
"""

DROP = """
DROP INDEX task_events_txid_id_idx;
ALTER TABLE task_events DROP COLUMN txid;
"""


class Migration(migrations.Migration):
    dependencies = [("board", "0002_claim_indexes_triggers_autovacuum")]

    operations = [migrations.RunSQL(ADD, DROP)]
