from __future__ import annotations

from django.urls import path, register_converter

from board import views


class TaskIdConverter:
    """A task id: digits that fit a bigint, so a longer number is a 404, not a query error."""

    regex = "[0-9]{1,18}"

    def to_python(self, value: str) -> int:
        return int(value)

    def to_url(self, value: int) -> str:
        return str(value)


register_converter(TaskIdConverter, "task_id")

app_name = "board"

urlpatterns = [
    path("", views.home, name="home"),
    path("tasks/<task_id:pk>/", views.task_detail, name="task"),
]
