"""The escalation queue in the admin: the humans' work list, oldest first.

The admin never edits a task. Its three ways out of the queue (requeue, resolve, cancel)
are actions on the list and buttons on a task's page; each one calls the transition of the
same name in ``board.transitions`` with the logged-in user as the actor, one task at a time,
and reports how many it applied and how many it skipped. A task's page also takes a comment
(``board.transitions.comment``) from anyone who may see it, and shows the task's place in
the work graph: what it depends on, what waits for it, and its progress.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.templatetags.admin_urls import add_preserved_filters
from django.contrib.admin.utils import display_for_value, flatten_fieldsets, unquote
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.text import Truncator

from board import transitions
from board.access import queue_access
from board.admin import ReadOnlyTaskAdmin
from board.exceptions import InvalidTransition, TaskNotFound
from board.models import Task
from board.pages.forms import CommentForm
from escalations.models import EscalatedTask
from escalations.triage import CANCEL, REQUEUE, RESOLVE, Triage, may_triage


def _tasks(count: int) -> str:
    return f"{count} task" if count == 1 else f"{count} tasks"


def report(triage: Triage, applied: int, skipped: int) -> str:
    """Return e.g. "Requeued 3 tasks; skipped 1 that was no longer escalated."."""
    text = f"{triage.done} {_tasks(applied)}"
    if skipped:
        were = "was" if skipped == 1 else "were"
        text += f"; skipped {skipped} that {were} no longer escalated"
    return text + "."


@admin.action(permissions=["triage"], description="Requeue selected tasks (reset failures)")
def requeue(
    modeladmin: EscalatedTaskAdmin, request: HttpRequest, queryset: QuerySet[EscalatedTask]
) -> HttpResponse | None:
    return modeladmin.triage_selected(request, queryset, REQUEUE)


@admin.action(permissions=["triage"], description="Resolve selected tasks by hand…")
def resolve(
    modeladmin: EscalatedTaskAdmin, request: HttpRequest, queryset: QuerySet[EscalatedTask]
) -> HttpResponse | None:
    return modeladmin.triage_selected(request, queryset, RESOLVE)


@admin.action(permissions=["triage"], description="Cancel selected tasks…")
def cancel(
    modeladmin: EscalatedTaskAdmin, request: HttpRequest, queryset: QuerySet[EscalatedTask]
) -> HttpResponse | None:
    return modeladmin.triage_selected(request, queryset, CANCEL)


@admin.register(EscalatedTask)
class EscalatedTaskAdmin(ReadOnlyTaskAdmin):
    list_display = [
        "title",
        "queue",
        "failures",
        "last_error_summary",
        "escalated_at",
        "escalation_reason",
    ]
    list_filter = ["queue"]
    search_fields = ["title", "description", "last_error"]
    actions = [requeue, resolve, cancel]
    fieldsets = [
        (None, {"fields": ["title", "description", "queue", "priority", "status"]}),
        (
            "Escalation",
            {"fields": ["escalated_at", "escalation_reason", "failures", "task_last_error"]},
        ),
        ("Data", {"fields": ["task_payload", "task_progress", "task_result"]}),
        ("Record", {"fields": ["created_by", "created_at", "updated_at"]}),
    ]
    readonly_fields = flatten_fieldsets(fieldsets)
    change_form_template = "admin/escalations/escalatedtask/change_form.html"
    triage_form_template = "admin/escalations/triage_form.html"

    def get_queryset(self, request: HttpRequest) -> QuerySet[EscalatedTask]:
        return super().get_queryset(request).with_escalation()  # type: ignore[attr-defined,no-any-return]

    @admin.display(description="last error")
    def last_error_summary(self, task: EscalatedTask) -> str | None:
        return None if task.last_error is None else Truncator(task.last_error).chars(80)

    @admin.display(description="escalated", ordering="escalated_at")
    def escalated_at(self, task: EscalatedTask) -> str:
        # Formatted here, since the change page shows a method's value as it is.
        return display_for_value(task.escalated_at, self.get_empty_value_display())  # type: ignore[attr-defined]

    @admin.display(description="why")
    def escalation_reason(self, task: EscalatedTask) -> str:
        return task.escalation_reason or self.get_empty_value_display()  # type: ignore[attr-defined]

    def has_triage_permission(self, request: HttpRequest) -> bool:
        """Return whether the user may requeue, resolve and cancel escalated tasks."""
        return may_triage(request.user)

    # The list's actions.

    def triage_selected(
        self, request: HttpRequest, queryset: QuerySet[EscalatedTask], triage: Triage
    ) -> HttpResponse | None:
        """Apply ``triage`` to the selected tasks, asking for its form first if it has one."""
        # The queryset holds only the selected tasks that are still escalated; the posted
        # selection also counts those that left the queue since the page was drawn.
        if request.POST.get("select_across") == "1":
            selected = [str(pk) for pk in queryset.values_list("pk", flat=True)]
        else:
            selected = request.POST.getlist(helpers.ACTION_CHECKBOX_NAME)
        eligible = queryset.filter(status__in=triage.allowed)
        fields: dict[str, Any] = {}
        if triage.form_class is not None:
            form = triage.form_class(request.POST if "confirm" in request.POST else None)
            if not form.is_valid():
                return self.render_triage_form(
                    request, triage, form, list(eligible), selected=selected
                )
            fields = form.cleaned_data
        applied = 0
        for task_id in list(eligible.values_list("pk", flat=True)):
            try:
                triage.transition(task_id=task_id, actor=request.user, **fields)
            except (InvalidTransition, TaskNotFound):
                continue  # another human got there between the filter and the transition
            applied += 1
        skipped = max(len(set(selected)) - applied, 0)
        self.message_user(
            request,
            report(triage, applied, skipped),
            messages.WARNING if skipped or not applied else messages.SUCCESS,
        )
        return None

    def render_triage_form(
        self,
        request: HttpRequest,
        triage: Triage,
        form: forms.Form,
        tasks: list[EscalatedTask],
        *,
        selected: list[str] | None = None,
    ) -> TemplateResponse:
        """Render the page that asks for a note (and a result) before a transition.

        With ``selected``, it posts back to the list as the action's confirmation, like
        Django's delete confirmation; without, to the URL it was served from.
        """
        request.current_app = self.admin_site.name
        skipped = max(len(set(selected)) - len(tasks), 0) if selected is not None else 0
        context = {
            **self.admin_site.each_context(request),
            "title": f"{triage.label} escalated {'task' if len(tasks) == 1 else 'tasks'}",
            "opts": self.opts,
            "app_label": self.opts.app_label,
            "triage": triage,
            "form": form,
            "tasks": tasks,
            "skipped": skipped,
            "selected": selected,
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            "preserved_filters": self.get_preserved_filters(request),
            "changelist_url": self.changelist_url(),
            "media": self.media + form.media,
        }
        return TemplateResponse(request, self.triage_form_template, context)

    # The task page's buttons.

    def get_urls(self) -> list[URLPattern]:
        info = self.opts.app_label, self.opts.model_name
        urls = [
            path(
                f"<path:object_id>/{triage.name}/",
                self.admin_site.admin_view(self.triage_view),
                {"triage": triage},
                name="{}_{}_{}".format(*info, triage.name),
            )
            for triage in (REQUEUE, RESOLVE, CANCEL)
        ]
        urls.append(
            path(
                "<path:object_id>/comment/",
                self.admin_site.admin_view(self.comment_view),
                name="{}_{}_comment".format(*info),
            )
        )
        return urls + super().get_urls()

    def comment_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """Add the posted comment to the task's history, then show the task's page again.

        Anyone who may see the task may comment, as in the API; a task that has left the
        queue meanwhile still takes the comment (a comment fits any status).
        """
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        if not self.has_view_permission(request):
            raise PermissionDenied
        task_id = unquote(object_id)
        visible = queue_access(request.user).visible(Task.objects.all())
        if not task_id.isdigit() or not visible.filter(pk=task_id).exists():
            self.message_user(request, f"There is no task {task_id}.", messages.WARNING)
            return self.redirect_to_queue(request)
        form = CommentForm(request.POST)
        if not form.is_valid():
            self.message_user(request, " ".join(map(str, form.errors["body"])), messages.ERROR)
        else:
            try:
                transitions.comment(
                    task_id=int(task_id), actor=request.user, body=form.cleaned_data["body"]
                )
            except TaskNotFound as exc:
                self.message_user(request, str(exc), messages.WARNING)
                return self.redirect_to_queue(request)
            self.message_user(request, f"Commented on task {task_id}.", messages.SUCCESS)
        if self.get_object(request, task_id) is None:
            return self.redirect_to_queue(request)
        url = reverse(
            f"admin:{self.opts.app_label}_{self.opts.model_name}_change",
            args=[task_id],
            current_app=self.admin_site.name,
        )
        preserved_filters = self.get_preserved_filters(request)
        url = add_preserved_filters(
            {"preserved_filters": preserved_filters, "opts": self.opts}, url
        )
        return HttpResponseRedirect(url + "#comment")

    def triage_view(self, request: HttpRequest, object_id: str, triage: Triage) -> HttpResponse:
        """Apply ``triage`` to one task (after its form, if it has one), back to the list."""
        if not self.has_triage_permission(request):
            raise PermissionDenied
        task = self.get_object(request, unquote(object_id))
        if task is None:
            why = "no longer escalated"
            if queue_access(request.user).limited:  # or escalated in a queue not theirs
                why = "not escalated in one of your queues"
            self.message_user(request, f"Task {object_id} is {why}.", messages.WARNING)
            return self.redirect_to_queue(request)
        fields: dict[str, Any] = {}
        if triage.form_class is not None:
            form = triage.form_class(request.POST if request.method == "POST" else None)
            if not form.is_valid():
                return self.render_triage_form(request, triage, form, [task])
            fields = form.cleaned_data
        elif request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        try:
            task = triage.transition(task_id=task.pk, actor=request.user, **fields)
        except (InvalidTransition, TaskNotFound) as exc:
            self.message_user(request, str(exc), messages.WARNING)
        else:
            self.message_user(request, f"{triage.done} {task}.", messages.SUCCESS)
        return self.redirect_to_queue(request)

    def redirect_to_queue(self, request: HttpRequest) -> HttpResponseRedirect:
        """Redirect to the list, with the filters it had when the task was opened."""
        preserved_filters = self.get_preserved_filters(request)
        url = add_preserved_filters(
            {"preserved_filters": preserved_filters, "opts": self.opts}, self.changelist_url()
        )
        return HttpResponseRedirect(url)

    def changelist_url(self) -> str:
        return reverse(
            f"admin:{self.opts.app_label}_{self.opts.model_name}_changelist",
            current_app=self.admin_site.name,
        )

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        extra_context = {
            **(extra_context or {}),
            "can_triage": self.has_triage_permission(request),
        }
        return super().change_view(request, object_id, form_url, extra_context)
