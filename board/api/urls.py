from __future__ import annotations

from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView
from rest_framework.routers import SimpleRouter

from board.api.views import AgentViewSet, EventViewSet, QueueViewSet, TaskViewSet, WebhookViewSet

app_name = "api"

router = SimpleRouter()
router.register("tasks", TaskViewSet, basename="task")
router.register("events", EventViewSet, basename="event")
router.register("queues", QueueViewSet, basename="queue")
router.register("agents", AgentViewSet, basename="agent")
router.register("webhooks", WebhookViewSet, basename="webhook")

urlpatterns = [
    path("", include(router.urls)),
    path("schema/", SpectacularAPIView.as_view(api_version="v1"), name="schema"),
    # The split view serves Swagger UI's start-up script as a file, not inline, so that the
    # Content-Security-Policy (TASKBOARD_HTTPS) needs no 'unsafe-inline' for scripts.
    path("docs/", SpectacularSwaggerSplitView.as_view(url_name="api:schema"), name="docs"),
]
