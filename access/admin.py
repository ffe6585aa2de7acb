"""API tokens in the admin: who has one and since when; rotate, issue or revoke.

Only digests are stored, so the admin never shows a token, except once: on the page that
answers the rotation (an action on the list, or the button on a token's page) or the
issue of a new one. That page is sent straight in the answer, with ``no-store``, and not
through Django's messages, which could keep it in the session table.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseNotAllowed
from django.template.response import TemplateResponse
from django.urls import URLPattern, path
from django.utils.cache import add_never_cache_headers

from access import tokens
from access.models import ApiToken
from board.access import queue_access
from board.admin import SelectionChecked


def may_issue_for(actor: Any, user: Any) -> bool:
    """Return whether ``actor`` may issue or rotate ``user``'s token.

    A token acts as its user, so only a superuser may mint one for another staff member
    or superuser: otherwise the permission to manage tokens would be every permission.
    For the same reason, staff limited to some queues may only mint tokens of users who
    are limited to some of those queues: the token of an unlimited agent, or of an agent
    of another queue, would reach the queues their limit keeps them from.
    """
    if actor.pk == user.pk:
        return True
    if not queue_access(actor).covers(queue_access(user)):
        return False
    return bool(actor.is_superuser or not (user.is_staff or user.is_superuser))


def check_may_issue_for(actor: Any, users: list[Any]) -> None:
    if not all(may_issue_for(actor, user) for user in users):
        raise PermissionDenied(
            "Only a superuser may issue or rotate the token of staff, and staff limited to "
            "some queues only that of users limited to some of theirs."
        )


@admin.register(ApiToken)
class ApiTokenAdmin(SelectionChecked):
    list_display = ("user", "created")
    search_fields = ("user__username",)
    ordering = ("user__username",)
    actions = ["rotate"]
    change_form_template = "admin/access/apitoken/change_form.html"

    fields = ("user", "created")
    raw_id_fields = ("user",)

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        # A token is never edited: it is issued (pick the user), rotated or deleted.
        return ["created"] if obj is None else ["user", "created"]

    def has_rotate_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("access.change_apitoken")

    def save_model(self, request: HttpRequest, obj: ApiToken, form: Any, change: bool) -> None:
        check_may_issue_for(request.user, [obj.user])
        issued = tokens.issue(obj.user)
        obj.pk, obj.digest, obj.created, obj.key = (
            issued.pk,
            issued.digest,
            issued.created,
            issued.key,
        )

    def response_add(
        self, request: HttpRequest, obj: ApiToken, post_url_continue: Any = None
    ) -> HttpResponse:
        return self.shown_once(request, [obj], "New API token")

    @admin.action(permissions=["rotate"], description="Rotate the selected tokens (shown once)")
    def rotate(self, request: HttpRequest, queryset: QuerySet[ApiToken]) -> HttpResponse:
        selected = list(queryset.select_related("user"))
        check_may_issue_for(request.user, [token.user for token in selected])
        rotated = [tokens.issue(token.user) for token in selected]
        for token in rotated:
            self.log_change(request, token, "Rotated the token.")
        return self.shown_once(request, rotated, "Rotated API tokens")

    def get_urls(self) -> list[URLPattern]:
        info = self.opts.app_label, self.opts.model_name
        rotate = path(
            "<path:object_id>/rotate/",
            self.admin_site.admin_view(self.rotate_view),
            name="{}_{}_rotate".format(*info),
        )
        return [rotate, *super().get_urls()]

    def rotate_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """The token page's button: rotate this one token (POST only)."""
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        if not self.has_rotate_permission(request):
            raise PermissionDenied
        token = self.get_object(request, unquote(object_id))
        if token is None:
            raise Http404(f"No API token {object_id}.")
        return self.rotate(request, self.get_queryset(request).filter(pk=token.pk))

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        extra_context = {**(extra_context or {}), "can_rotate": self.has_rotate_permission(request)}
        return super().change_view(request, object_id, form_url, extra_context)

    def shown_once(self, request: HttpRequest, issued: list[ApiToken], title: str) -> HttpResponse:
        """Show the plain tokens just issued; they cannot be shown again."""
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": title,
            "issued": issued,
        }
        response = TemplateResponse(request, "admin/access/apitoken/shown_once.html", context)
        add_never_cache_headers(response)
        return response
