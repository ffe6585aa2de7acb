"""The functions and triggers defined by ``board/sql/schema/`` (applied again, unchanged in
behaviour: the definitions of migrations 0002 to 0016 with their comments), so that from
now on the files are where they are read and changed (board/sql/schema/__init__.py)."""

from django.db import migrations

from board.sql.schema import ApplySchema


class Migration(migrations.Migration):
    dependencies = [
        ("board", "0018_password_reset_deliveries"),
        ("access", "0002_write_counts"),
        ("auth", "0012_alter_user_first_name_max_length"),
    ]

    operations = [ApplySchema("8ffa6aa68478e4fb")]
