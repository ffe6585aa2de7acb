"""The admin's read-only view of every task and event, and of the queues' pauses.

Nothing here writes a row itself: tasks change only through ``board.transitions`` (the
escalation queue in ``escalations.admin`` offers the human transitions), and the event log
is append-only. The event history, the work graph and the JSON rendering live here, for
both task admins. Staff set which queues an agent is limited to (board.access) on the user's
page. A queue's state and its log of pauses and resumes are read-only lists; pausing and
resuming are actions on the queues, for staff (as in the API), that call
``board.transitions.pause_queue`` and ``resume_queue``. Webhooks are listed with their
deliveries; staff retry failed deliveries with an action that calls
``board.notifications.deliveries.retry_deliveries``.
"""

from __future__ import annotations

import json
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.utils import flatten_fieldsets, unquote
from django.contrib.admin.views.main import ChangeList
from django.contrib.auth import admin as auth_admin
from django.contrib.auth import get_user_model
from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import Count, Exists, OuterRef, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from board import transitions
from board.access import queue_access
from board.api.permissions import may_pause_queues
from board.models import (
    Capabilities,
    Delivery,
    DeliveryStatus,
    QueueLimit,
    QueuePause,
    QueueState,
    Task,
    TaskEvent,
    Webhook,
)
from board.notifications import deliveries
from board.pages.forms import QueueNoteForm
from board.pages.relations import relations_of
from board.pages.timeline import requested_page, timeline_page

admin.site.site_header = "Taskboard administration"
admin.site.site_title = "Taskboard admin"
admin.site.index_title = "Taskboard"


def json_block(value: Any) -> SafeString:
    """Return ``value`` as indented JSON in a ``<pre>``, escaped."""
    return format_html("<pre>{}</pre>", json.dumps(value, indent=2, ensure_ascii=False))


class SelectionChecked(admin.ModelAdmin):
    """A model admin whose actions refuse a selection that is not a list of its keys
    (``_selected_action=abc``, which no checkbox sends) with a message, where Django's
    admin fails with a 500: filtering the queryset by it raises ValueError."""

    def response_action(
        self, request: HttpRequest, queryset: QuerySet[Any], *args: Any, **kwargs: Any
    ) -> HttpResponse | None:
        key = self.model._meta.pk
        assert key is not None
        try:
            for value in request.POST.getlist(helpers.ACTION_CHECKBOX_NAME):
                key.get_prep_value(key.to_python(value))
        except (ValidationError, ValueError, TypeError):
            self.message_user(request, "The selection is not a list of items.", messages.ERROR)
            return HttpResponseRedirect(request.get_full_path())
        return super().response_action(request, queryset, *args, **kwargs)


class ReadOnlyAdmin(SelectionChecked):
    """A model admin that shows and never adds, edits or deletes."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class TaskChangeList(ChangeList):
    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet[Any]:
        # No list shows these, and a payload alone may be up to a MiB: leave them in the
        # database (searching description still works, it is a filter).
        queryset = super().get_queryset(request, exclude_parameters)
        return queryset.defer("payload", "result", "description")


class ReadOnlyTaskAdmin(ReadOnlyAdmin):
    """A read-only task admin, with the renderings the task and escalation admins share.

    A task's page shows its newest events (board.pages.timeline.PAGE_SIZE, long texts cut short)
    and links the rest: its history page, a page of events at a time, and the event list.
    """

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return TaskChangeList

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        # A user limited to queues sees and triages only those, here as in the API: every
        # list, page and action of these admins starts from this queryset.
        return queue_access(request.user).visible(super().get_queryset(request))

    @admin.display(description="payload")
    def task_payload(self, task: Task) -> SafeString:
        return json_block(task.payload)

    @admin.display(description="result")
    def task_result(self, task: Task) -> SafeString:
        return json_block(task.result)

    @admin.display(description="progress")
    def task_progress(self, task: Task) -> SafeString | str:
        if task.progress is None:
            return self.get_empty_value_display()
        return json_block(task.progress)

    @admin.display(description="last error")
    def task_last_error(self, task: Task) -> SafeString | str:
        if task.last_error is None:
            return self.get_empty_value_display()
        return format_html("<pre>{}</pre>", task.last_error)

    @admin.display(description="failures", ordering="failure_count")
    def failures(self, task: Task) -> str:
        return f"{task.failure_count}/{task.max_failures}"

    @admin.display(description="leased by", ordering="leased_by")
    def holder(self, task: Task) -> str | None:
        # The foreign key holds the username itself: no join to auth_user needed.
        return task.leased_by_id

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        # The work graph needs the user's queue limit, which a field's display method does
        # not get: the page's template shows it (admin/board/work_graph.html).
        context = dict(extra_context or {})
        task = self.get_object(request, unquote(object_id))
        if task is not None:
            context["relations"] = relations_of(task, queue_access(request.user))
            context["timeline_page"] = timeline_page(task.pk)
        return super().change_view(request, object_id, form_url, context)

    def history_view(
        self, request: HttpRequest, object_id: str, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """Show the task's event history: the page behind the "History" button.

        Django's own history page lists the admin's change log, which is always empty here:
        nothing in the admin changes a task directly, every change is an event.
        """
        task = self.get_object(request, unquote(object_id))
        if task is None:
            # As Django's own history page answers: back to the list, saying why.
            self.message_user(request, f"There is no task {object_id} here.", messages.WARNING)
            return HttpResponseRedirect(
                reverse(
                    f"admin:{self.opts.app_label}_{self.opts.model_name}_changelist",
                    current_app=self.admin_site.name,
                )
            )
        if not self.has_view_or_change_permission(request, task):
            raise PermissionDenied
        request.current_app = self.admin_site.name
        context = {
            **self.admin_site.each_context(request),
            "title": f"Event history: {task}",
            "subtitle": None,
            "object": task,
            "opts": self.opts,
            "timeline_page": requested_page(task.pk, request.GET),
            **(extra_context or {}),
        }
        return TemplateResponse(request, "admin/board/task/history.html", context)


@admin.register(Task)
class TaskAdmin(ReadOnlyTaskAdmin):
    list_display = [
        "id",
        "title",
        "queue",
        "status",
        "holder",
        "leased_until",
        "failure_count",
        "created_at",
    ]
    list_display_links = ["id", "title"]
    list_filter = ["status", "queue"]
    search_fields = ["title"]
    # The lease token is a secret of the holder and is never shown.
    fieldsets = [
        (None, {"fields": ["title", "description", "queue", "priority", "status"]}),
        (
            "Lease and strikes",
            {
                "fields": [
                    "holder",
                    "leased_until",
                    "lease_seconds",
                    "run_after",
                    "failures",
                    "task_last_error",
                ]
            },
        ),
        ("Data", {"fields": ["task_payload", "task_progress", "task_result"]}),
        ("Record", {"fields": ["created_by", "created_at", "updated_at"]}),
    ]
    readonly_fields = flatten_fieldsets(fieldsets)
    change_form_template = "admin/board/task/change_form.html"


@admin.register(TaskEvent)
class TaskEventAdmin(ReadOnlyAdmin):
    list_display = ["id", "task", "type", "status", "actor", "created_at"]
    list_filter = ["type", "status"]
    search_fields = ["actor"]
    ordering = ["-id"]
    list_select_related = ["task"]
    # Counting the whole log on every page is slow once it is long.
    show_full_result_count = False
    readonly_fields = ("id", "task", "type", "status", "actor", "event_payload", "created_at")
    fields = readonly_fields

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        return queue_access(request.user).visible(super().get_queryset(request), "task__queue")

    @admin.display(description="payload")
    def event_payload(self, event: TaskEvent) -> SafeString:
        return json_block(event.payload)


class QueueLimitInline(admin.StackedInline):
    """The queues a user is limited to, on the user's page. Deleting it lifts the limit."""

    model = QueueLimit
    can_delete = True
    extra = 0
    max_num = 1
    verbose_name = "queue limit"
    verbose_name_plural = "queue limit (none: every queue)"


@admin.register(Capabilities)
class CapabilitiesAdmin(admin.ModelAdmin):
    """The labels each user offers: a claim takes a task only when the task's requires
    are among them (a user without a row offers none)."""

    list_display = ["user", "labels"]
    search_fields = ["user__username"]
    raw_id_fields = ["user"]


User = get_user_model()
admin.site.unregister(User)


@admin.register(User)
class UserAdmin(SelectionChecked, auth_admin.UserAdmin):
    """Django's user admin, with the queue limit on the page and in the list."""

    inlines = [QueueLimitInline]
    list_display = ["username", "email", "first_name", "last_name", "is_staff", "queues"]
    list_select_related = ["queue_limit"]

    @admin.display(description="queues")
    def queues(self, user: Any) -> str:
        limit = getattr(user, "queue_limit", None)
        return ", ".join(limit.queues) if limit is not None else "every queue"


# -- Queues: their state, and the log of pauses and resumes ---------------------------------


def _queues(count: int) -> str:
    return f"{count} queue" if count == 1 else f"{count} queues"


@admin.action(permissions=["pause"], description="Pause selected queues…")
def pause(
    modeladmin: QueueStateAdmin, request: HttpRequest, queryset: QuerySet[QueueState]
) -> HttpResponse | None:
    return modeladmin.set_paused(request, queryset, paused=True)


@admin.action(permissions=["pause"], description="Resume selected queues…")
def resume(
    modeladmin: QueueStateAdmin, request: HttpRequest, queryset: QuerySet[QueueState]
) -> HttpResponse | None:
    return modeladmin.set_paused(request, queryset, paused=False)


@admin.register(QueueState)
class QueueStateAdmin(ReadOnlyAdmin):
    """Every queue that was ever paused, whether it is now, and its last change.

    A queue gets its row when it is first paused (on the board's queues panel, through the
    API or here); from then on it is paused and resumed here with the list's actions.
    """

    list_display = ["name", "paused", "changed_at", "changed_by", "note"]
    list_filter = ["paused"]
    search_fields = ["name", "changed_by", "note"]
    ordering = ["name"]
    actions = [pause, resume]
    readonly_fields = ("name", "paused", "changed_at", "changed_by", "note")
    fields = readonly_fields
    note_form_template = "admin/board/queuestate/note_form.html"

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        return queue_access(request.user).visible(super().get_queryset(request), "name")

    def has_pause_permission(self, request: HttpRequest) -> bool:
        """Return whether the user may pause and resume queues (staff, as in the API)."""
        return may_pause_queues(request.user)

    def set_paused(
        self, request: HttpRequest, queryset: QuerySet[QueueState], *, paused: bool
    ) -> HttpResponse | None:
        """Ask for a note, then pause (or resume) each selected queue not already so."""
        verb, done = ("Pause", "Paused") if paused else ("Resume", "Resumed")
        form = QueueNoteForm(request.POST if "confirm" in request.POST else None)
        eligible = list(queryset.exclude(paused=paused).values_list("name", flat=True))
        if not form.is_valid():
            request.current_app = self.admin_site.name
            context = {
                **self.admin_site.each_context(request),
                "title": f"{verb} {_queues(len(eligible))}",
                "opts": self.opts,
                "verb": verb,
                "action": verb.lower(),
                "form": form,
                "queues": eligible,
                "skipped": queryset.count() - len(eligible),
                "selected": request.POST.getlist(helpers.ACTION_CHECKBOX_NAME),
                "select_across": request.POST.get("select_across", "0"),
                "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
                "media": self.media + form.media,
            }
            return TemplateResponse(request, self.note_form_template, context)
        change = transitions.pause_queue if paused else transitions.resume_queue
        for name in eligible:
            change(queue=name, actor=request.user, note=form.cleaned_data["note"])
        skipped = queryset.count() - len(eligible)
        text = f"{done} {_queues(len(eligible))}"
        if skipped:
            text += f"; skipped {skipped} already {'paused' if paused else 'running'}"
        self.message_user(
            request, text + ".", messages.WARNING if skipped or not eligible else messages.SUCCESS
        )
        return None


@admin.register(QueuePause)
class QueuePauseAdmin(ReadOnlyAdmin):
    """The log of every pause and resume: who, when, which queue, and why. Append-only."""

    list_display = ["created_at", "queue", "change", "actor", "note"]
    list_filter = ["paused", "queue"]
    search_fields = ["queue", "actor", "note"]
    ordering = ["-id"]
    readonly_fields = ("queue", "change", "actor", "note", "created_at")
    fields = readonly_fields

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        return queue_access(request.user).visible(super().get_queryset(request), "queue")

    @admin.display(description="change", ordering="paused")
    def change(self, entry: QueuePause) -> str:
        return "paused" if entry.paused else "resumed"


@admin.register(Webhook)
class WebhookAdmin(ReadOnlyAdmin):
    """Webhooks (and the escalation emails' row), with their deliveries by status. They
    are added and removed through the API (``POST webhooks/``), which shows the secret
    once; the secret is never shown here."""

    list_display = ["id", "__str__", "kind", "format", "event_types", "queue_names", "active"]
    list_filter = ["kind", "active", "format"]
    ordering = ["-id"]
    readonly_fields = (
        "kind",
        "url",
        "format",
        "event_types",
        "queue_names",
        "active",
        "created_by",
        "created_at",
        "delivery_counts",
    )
    fields = readonly_fields

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        # Staff limited to queues see only the webhooks of their queues, as in the API.
        return queue_access(request.user).visible_webhooks(super().get_queryset(request))

    @admin.display(description="events")
    def event_types(self, webhook: Webhook) -> str:
        return ", ".join(webhook.events)

    @admin.display(description="queues")
    def queue_names(self, webhook: Webhook) -> str:
        return ", ".join(webhook.queues) if webhook.queues else "all"

    @admin.display(description="deliveries")
    def delivery_counts(self, webhook: Webhook) -> SafeString:
        counts = dict(webhook.deliveries.values_list("status").annotate(n=Count("id")).order_by())
        url = reverse("admin:board_delivery_changelist")
        return format_html_join(
            ", ",
            '<a href="{}?webhook__id__exact={}&amp;status__exact={}">{} {}</a>',
            (
                (url, webhook.pk, status, counts.get(status, 0), status)
                for status in DeliveryStatus.values
            ),
        )


@admin.action(permissions=["retry"], description="Retry the selected failed deliveries")
def retry(modeladmin: DeliveryAdmin, request: HttpRequest, queryset: QuerySet[Delivery]) -> None:
    selected = list(queryset.values_list("id", flat=True))
    rearmed = deliveries.retry_deliveries(delivery_ids=selected, actor=request.user)
    text = f"Retrying {rearmed} {'delivery' if rearmed == 1 else 'deliveries'}"
    if skipped := len(selected) - rearmed:
        text += f"; skipped {skipped} that had not failed or whose event was archived"
    modeladmin.message_user(request, text + ".", messages.WARNING if skipped else messages.SUCCESS)


DELIVERY_COLUMNS: list[Any] = [
    "id",
    "webhook",
    "event_id",
    "task_link",
    "status",
    "attempts",
    "last_status_code",
    "last_error",
    "next_attempt_at",
    "delivered_at",
]


@admin.register(Delivery)
class DeliveryAdmin(ReadOnlyAdmin):
    """Every delivery of an event to a webhook or by email: its attempts and their outcome.
    Staff retry failed ones (board.notifications.deliveries.retry_deliveries): due at once,
    for a new horizon."""

    list_display = DELIVERY_COLUMNS
    # Only the webhooks of the deliveries this user may see (a limited user's queues).
    list_filter = ["status", ("webhook", admin.RelatedOnlyFieldListFilter)]
    list_select_related = ["webhook"]
    ordering = ["-id"]
    actions = [retry]
    readonly_fields = (*DELIVERY_COLUMNS[1:], "leased_until", "armed_at", "created_at")
    fields = readonly_fields

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        # Staff limited to queues see (and retry) only the deliveries of the webhooks they
        # may see (the webhook admin's rule), whose URL each row shows: a webhook of every
        # queue is not theirs, though it sends their tasks' events too. And only those of
        # their queues' tasks. (A delivery has no foreign key to its task: the log may be
        # archived.)
        access = queue_access(request.user)
        deliveries = super().get_queryset(request)
        if not access.limited:
            return deliveries
        webhooks = access.visible_webhooks(Webhook.objects.filter(pk=OuterRef("webhook_id")))
        tasks = access.visible(Task.objects.filter(pk=OuterRef("task_id")))
        return deliveries.filter(Exists(webhooks), Exists(tasks))

    def has_retry_permission(self, request: HttpRequest) -> bool:
        """Return whether the user may retry deliveries: staff, as for webhooks in the API."""
        return bool(request.user.is_authenticated and request.user.is_staff)

    @admin.display(description="task", ordering="task_id")
    def task_link(self, delivery: Delivery) -> SafeString:
        if delivery.task_id is None:  # a password reset email
            return format_html("password reset to {}", delivery.recipient)
        url = reverse("admin:board_task_change", args=[delivery.task_id])
        return format_html('<a href="{}">#{}</a>', url, delivery.task_id)
