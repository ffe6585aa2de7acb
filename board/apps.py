from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.db.models.signals import post_migrate


class BoardConfig(AppConfig):
    name = "board"
    verbose_name = "Task board"

    def ready(self) -> None:
        from board.live import relay, revocation

        post_migrate.connect(_create_event_partitions_ahead, sender=self)
        relay.on_credentials_changed(revocation.credentials_changed)


def _create_event_partitions_ahead(using: str, **kwargs: Any) -> None:
    """After every ``migrate``: the event log's partitions for this month and the next
    three, so that none has to be made by a transition (board.partitions)."""
    from django.db import connections

    from board import partitions

    if connections[using].vendor != "postgresql" or using != "default":
        return
    partitions.ensure(months_ahead=3)
