from django.apps import AppConfig


class TaskboardConfig(AppConfig):
    name = "taskboard"
    verbose_name = "Taskboard"
