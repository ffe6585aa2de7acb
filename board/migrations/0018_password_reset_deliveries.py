"""Password reset emails go through the deliveries, as escalation emails do.

A reset delivery names the address that was given (``recipient``) and no event or task;
the check keeps every row one or the other.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("board", "0017_oldest_claimable_index"),
    ]

    operations = [
        migrations.AddField(
            model_name="delivery",
            name="recipient",
            field=models.EmailField(blank=True, max_length=254, null=True),
        ),
        migrations.AlterField(
            model_name="delivery",
            name="event_id",
            field=models.BigIntegerField(blank=True, null=True),
        ),
        migrations.AlterField(
            model_name="delivery",
            name="task_id",
            field=models.BigIntegerField(blank=True, null=True),
        ),
        migrations.AddConstraint(
            model_name="delivery",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    models.Q(
                        ("event_id__isnull", False),
                        ("recipient__isnull", True),
                        ("task_id__isnull", False),
                    ),
                    models.Q(
                        ("event_id__isnull", True),
                        ("recipient__isnull", False),
                        ("task_id__isnull", True),
                    ),
                    _connector="OR",
                ),
                name="deliveries_of_an_event_or_a_reset",
            ),
        ),
    ]
