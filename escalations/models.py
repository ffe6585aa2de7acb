"""The human work queue: escalated tasks, as a proxy of board.Task for the admin."""

from __future__ import annotations

from board.models import Task, TaskQuerySet, TaskStatus


class EscalatedTaskManager(TaskQuerySet.as_manager().__class__):  # type: ignore[misc]
    def get_queryset(self) -> TaskQuerySet:
        return super().get_queryset().filter(status=TaskStatus.ESCALATED)


class EscalatedTask(Task):
    objects = EscalatedTaskManager()

    class Meta:
        proxy = True
        ordering = ["updated_at", "id"]
        verbose_name = "escalated task"
        verbose_name_plural = "escalated tasks"
