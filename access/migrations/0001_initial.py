"""API tokens stored hashed, and the counts of failed authentications.

Moves the tokens of ``rest_framework.authtoken`` (plain-text keys) here as SHA-256 digests,
so that every existing token keeps working, then drops its table: no plain-text copy
remains. PostgreSQL's ``sha256()`` gives the same digest as ``access.tokens.digest``.
"""

from __future__ import annotations

from typing import Any

import django.db.models.deletion
import django.utils.timezone
from django.conf import settings
from django.db import migrations, models


def hash_drf_tokens(apps: Any, schema_editor: Any) -> None:
    connection = schema_editor.connection
    if "authtoken_token" not in connection.introspection.table_names():
        return  # a new database: DRF's token table was never made
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO api_tokens (user_id, digest, created)
            SELECT user_id, encode(sha256(convert_to(key, 'UTF8')), 'hex'), created
            FROM authtoken_token
            """
        )
        cursor.execute("DROP TABLE authtoken_token")
        # Forget the app, so that adding it back later would make a new, empty table.
        cursor.execute("DELETE FROM django_migrations WHERE app = 'authtoken'")
        cursor.execute(
            """
            DELETE FROM auth_permission WHERE content_type_id IN
                (SELECT id FROM django_content_type WHERE app_label = 'authtoken')
            """
        )
        cursor.execute("DELETE FROM django_content_type WHERE app_label = 'authtoken'")


class Migration(migrations.Migration):
    initial = True

    dependencies = [
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
        ("contenttypes", "0002_remove_content_type_name"),
        ("auth", "0012_alter_user_first_name_max_length"),
    ]

    operations = [
        migrations.CreateModel(
            name="ApiToken",
            fields=[
                (
                    "user",
                    models.OneToOneField(
                        on_delete=django.db.models.deletion.CASCADE,
                        primary_key=True,
                        related_name="api_token",
                        serialize=False,
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
                ("digest", models.CharField(editable=False, max_length=64, unique=True)),
                (
                    "created",
                    models.DateTimeField(default=django.utils.timezone.now, editable=False),
                ),
            ],
            options={"verbose_name": "API token", "db_table": "api_tokens"},
        ),
        migrations.CreateModel(
            name="AuthFailure",
            fields=[
                (
                    "pk",
                    models.CompositePrimaryKey(
                        "window_end",
                        "address",
                        blank=True,
                        editable=False,
                        primary_key=True,
                        serialize=False,
                    ),
                ),
                ("window_end", models.DateTimeField()),
                ("address", models.TextField()),
                ("failures", models.IntegerField()),
            ],
            options={"db_table": "auth_failures"},
        ),
        # Counts are not worth WAL, and losing them in a crash costs nothing.
        migrations.RunSQL(
            "ALTER TABLE auth_failures SET UNLOGGED", "ALTER TABLE auth_failures SET LOGGED"
        ),
        migrations.RunPython(hash_drf_tokens, migrations.RunPython.noop, elidable=False),
    ]
