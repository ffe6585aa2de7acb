"""API tokens in the admin: who has one and since when; rotate, issue or revoke.

Only digests are stored, so the admin never shows a token, except once: on the page that
answers the rotation (an action on the list, or the button on a token's page) or the
issue of a new one. That page is sent straight in the answer, with ``no-store``, and not
through Django's messages, which could keep it in the session table.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.contrib.admin import helpers
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import Q, QuerySet
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


def manageable(actor: Any, queryset: QuerySet[ApiToken]) -> QuerySet[ApiToken]:
    """Return the tokens of ``queryset`` that ``actor`` may issue, rotate or delete: the
    rule of :func:`may_issue_for`, as a filter."""
    access = queue_access(actor)
    others = Q()
    if access.limited:
        # Covered: the user is limited, to some of the actor's queues only.
        others &= Q(user__queue_limit__queues__contained_by=sorted(access.queues or ()))
    if not actor.is_superuser:
        others &= Q(user__is_staff=False, user__is_superuser=False)
    if not others:  # Q() | Q(...) would be the Q(...) alone
        return queryset
    return queryset.filter(Q(user_id=actor.pk) | others)


def check_may_issue_for(actor: Any, users: list[Any], verb: str = "issue or rotate") -> None:
    if not all(may_issue_for(actor, user) for user in users):
        raise PermissionDenied(
            f"Only a superuser may {verb} the token of staff, and staff limited to some "
            "queues only that of users limited to some of theirs."
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

    def get_queryset(self, request: HttpRequest) -> QuerySet[ApiToken]:
        # Deleting a token locks its user out, and a token acts as its user: the list, the
        # token pages and the actions hold only the tokens this user may manage.
        return manageable(request.user, super().get_queryset(request))

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        if not super().has_delete_permission(request, obj):
            return False
        return obj is None or may_issue_for(request.user, obj.user)

    def delete_model(self, request: HttpRequest, obj: ApiToken) -> None:
        check_may_issue_for(request.user, [obj.user], "delete")
        super().delete_model(request, obj)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[ApiToken]) -> None:
        users = [token.user for token in queryset.select_related("user")]
        check_may_issue_for(request.user, users, "delete")
        super().delete_queryset(request, queryset)

    def response_action(
        self, request: HttpRequest, queryset: QuerySet[Any], *args: Any, **kwargs: Any
    ) -> HttpResponse | None:
        """Refuse a selection that names a token this user may not manage, rather than
        apply the action to the rest of it (the list's queryset leaves those out)."""
        if request.POST.get("select_across") != "1":
            selected = self.existing(request.POST.getlist(helpers.ACTION_CHECKBOX_NAME))
            verb = "delete" if request.POST.get("action") == "delete_selected" else "rotate"
            check_may_issue_for(request.user, [token.user for token in selected], verb)
        return super().response_action(request, queryset, *args, **kwargs)

    def existing(self, keys: list[str]) -> list[ApiToken]:
        """Return the tokens of ``keys`` whoever may manage them (none for a key that is
        not one: SelectionChecked answers that)."""
        key = ApiToken._meta.pk
        assert key is not None
        try:
            values = [key.to_python(value) for value in keys]
        except (ValidationError, ValueError, TypeError):
            return []
        return list(ApiToken.objects.filter(pk__in=values).select_related("user"))

    def delete_view(
        self, request: HttpRequest, object_id: str, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        # As the rotate button answers: a token this user may not manage is refused (403),
        # not taken for a missing one.
        users = [token.user for token in self.existing([unquote(object_id)])]
        check_may_issue_for(request.user, users, "delete")
        return super().delete_view(request, object_id, extra_context)

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
        found = self.existing([unquote(object_id)])
        if not found:
            raise Http404(f"No API token {object_id}.")
        [token] = found
        check_may_issue_for(request.user, [token.user])
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
