from __future__ import annotations

from django.contrib import admin
from django.urls import include, path

from board.health import healthz
from board.metrics import MetricsView

urlpatterns = [
    path("api/v1/", include("board.api.urls")),
    path("healthz", healthz, name="healthz"),
    path("metrics", MetricsView.as_view(), name="metrics"),
    path("admin/", admin.site.urls),
    path("accounts/", include("django.contrib.auth.urls")),
    path("", include("board.urls")),
]

handler400 = "board.api.errors.bad_request"
handler403 = "board.api.errors.permission_denied"
handler404 = "board.api.errors.not_found"
handler500 = "board.api.errors.server_error"
