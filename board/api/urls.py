from __future__ import annotations

from django.urls import include, path
from rest_framework.routers import SimpleRouter

from board.api.docs import DocsView, SchemaView
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
    path("schema/", SchemaView.as_view(api_version="v1"), name="schema"),
    path("docs/", DocsView.as_view(url_name="api:schema"), name="docs"),
]
