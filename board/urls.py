from __future__ import annotations

from django.urls import path, register_converter

from board.pages import views
from escalations.triage import TRIAGES


class TaskIdConverter:
    """A task id: digits that fit a bigint, so a longer number is a 404, not a query error."""

    regex = "[0-9]{1,18}"

    def to_python(self, value: str) -> int:
        return int(value)

    def to_url(self, value: int) -> str:
        return str(value)


class QueueNameConverter:
    """A queue name (board.models.QUEUE_PATTERN): anything else is a 404."""

    regex = "[a-z0-9_-]{1,64}"

    def to_python(self, value: str) -> str:
        return value

    def to_url(self, value: str) -> str:
        return value


class TriageConverter:
    """One of the escalation queue's ways out (escalations.triage)."""

    regex = "|".join(TRIAGES)

    def to_python(self, value: str) -> str:
        return value

    def to_url(self, value: str) -> str:
        return value


register_converter(TaskIdConverter, "task_id")
register_converter(TriageConverter, "triage")
register_converter(QueueNameConverter, "queue")

app_name = "board"

urlpatterns = [
    path("", views.home, name="home"),
    path("panels/", views.panels, name="panels"),
    path("tasks/<task_id:pk>/", views.task_detail, name="task"),
    path("tasks/<task_id:pk>/comments/", views.comment, name="comment"),
    path("tasks/<task_id:pk>/events/<task_id:event_id>/", views.event_detail, name="event"),
    path("tasks/<task_id:pk>/<triage:name>/", views.triage, name="triage"),
    path("queues/<queue:name>/pause/", views.pause_queue, name="pause-queue"),
    path("queues/<queue:name>/resume/", views.resume_queue, name="resume-queue"),
]
