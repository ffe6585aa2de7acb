"""The writes each user made in the current and the previous minute (access.rates)."""

from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("access", "0001_initial"),
    ]

    operations = [
        migrations.CreateModel(
            name="WriteCount",
            fields=[
                (
                    "pk",
                    models.CompositePrimaryKey(
                        "window_end",
                        "user_id",
                        "kind",
                        blank=True,
                        editable=False,
                        primary_key=True,
                        serialize=False,
                    ),
                ),
                ("window_end", models.DateTimeField()),
                ("user_id", models.BigIntegerField()),
                ("kind", models.TextField()),
                ("count", models.IntegerField()),
            ],
            options={"db_table": "write_counts"},
        ),
        # Counts are not worth WAL, and losing them in a crash costs nothing.
        migrations.RunSQL(
            "ALTER TABLE write_counts SET UNLOGGED", "ALTER TABLE write_counts SET LOGGED"
        ),
    ]
