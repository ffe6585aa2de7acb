from __future__ import annotations

from django.contrib import admin
from django.templatetags.static import static
from django.urls import include, path
from django.views.generic import RedirectView

from board.health import healthz
from board.metrics import MetricsView

urlpatterns = [
    path("api/v1/", include("board.api.urls")),
    path("healthz", healthz, name="healthz"),
    path("metrics", MetricsView.as_view(), name="metrics"),
    # Pages name their icon (templates/base.html, admin/base_site.html); this is for what
    # asks the old way: the API's JSON in a browser tab, its docs page.
    path("favicon.ico", RedirectView.as_view(url=static("board/favicon.svg"), permanent=True)),
    path("admin/", admin.site.urls),
    path("accounts/", include("django.contrib.auth.urls")),
    path("", include("board.urls")),
]

handler400 = "board.api.errors.bad_request"
handler403 = "board.api.errors.permission_denied"
handler404 = "board.api.errors.not_found"
handler500 = "board.api.errors.server_error"
