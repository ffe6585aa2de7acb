"""The human work queue: escalated tasks, as a proxy of board.Task for the admin."""

from __future__ import annotations

from typing import ClassVar, cast

from django.db import models
from django.db.models import OuterRef, Subquery
from django.db.models.fields.json import KT

from board.models import EventType, Task, TaskEvent, TaskQuerySet

# Who may requeue, resolve and cancel: in the admin's queue and in the API alike.
TRIAGE_PERMISSION = "escalations.triage_task"


class EscalatedTaskQuerySet(TaskQuerySet):
    def with_escalation(self) -> EscalatedTaskQuerySet:
        """Annotate when and why each task was last escalated, from its latest event.

        ``escalated_at`` and ``escalation_reason`` come from the newest "escalated" event:
        two correlated subqueries in the one query, each a short backward scan of the
        (task_id, id) index.
        """
        latest = TaskEvent.objects.filter(task=OuterRef("pk"), type=EventType.ESCALATED).order_by(
            "-id"
        )
        return cast(
            EscalatedTaskQuerySet,
            self.annotate(
                escalated_at=Subquery(latest.values("created_at")[:1]),
                escalation_reason=Subquery(
                    latest.annotate(reason=KT("payload__reason")).values("reason")[:1]
                ),
            ),
        )


class EscalatedTaskManager(models.Manager.from_queryset(EscalatedTaskQuerySet)):  # type: ignore[misc]
    def get_queryset(self) -> EscalatedTaskQuerySet:
        return cast(EscalatedTaskQuerySet, super().get_queryset().escalated())


class EscalatedTask(Task):
    objects: ClassVar[EscalatedTaskManager] = EscalatedTaskManager()

    class Meta:
        proxy = True
        # Oldest first. An escalated task is only ever updated by leaving the queue, so its
        # updated_at is the time it escalated.
        ordering = ["updated_at", "id"]
        verbose_name = "escalated task"
        verbose_name_plural = "escalated tasks"
        permissions = [
            ("triage_task", "Can requeue, resolve and cancel escalated tasks"),
        ]
