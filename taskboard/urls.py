from __future__ import annotations

from django.contrib import admin
from django.contrib.auth import urls as auth_urls
from django.templatetags.static import static
from django.urls import URLPattern, URLResolver, include, path
from django.views.generic import RedirectView

from board import conf
from board.ops.health import healthz
from board.ops.metrics import MetricsView
from board.pages.views import PasswordResetView

PASSWORD_RESET_PAGES = {
    "password_reset",
    "password_reset_done",
    "password_reset_confirm",
    "password_reset_complete",
}


def account_urls() -> list[URLPattern | URLResolver]:
    """Return Django's login, logout and password change pages, and its password reset
    pages only when EMAIL_URL is set: with no way to send the email, a reset form would
    only tell anyone who asks which addresses have accounts. The form is the board's,
    which queues the email (board.pages.views.PasswordResetView)."""
    pages = [p for p in auth_urls.urlpatterns if getattr(p, "name", None) != "password_reset"]
    if not conf.email_url():
        return [p for p in pages if getattr(p, "name", None) not in PASSWORD_RESET_PAGES]
    return [path("password_reset/", PasswordResetView.as_view(), name="password_reset"), *pages]


urlpatterns = [
    path("api/v1/", include("board.api.urls")),
    path("healthz", healthz, name="healthz"),
    path("metrics", MetricsView.as_view(), name="metrics"),
    # Pages name their icon (templates/base.html, admin/base_site.html); this is for what
    # asks the old way: the API's JSON in a browser tab, its docs page.
    path("favicon.ico", RedirectView.as_view(url=static("board/favicon.svg"), permanent=True)),
    path("admin/", admin.site.urls),
    path("accounts/", include(account_urls())),
    path("", include("board.urls")),
]

handler400 = "board.http.errors.bad_request"
handler403 = "board.http.errors.permission_denied"
handler404 = "board.http.errors.not_found"
handler500 = "board.http.errors.server_error"
