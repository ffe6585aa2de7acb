"""The board's HTML pages: the live board and a task's page.

Both pages are drawn from one snapshot of the database and carry, for the browser's
EventSource, the id to resume the stream from (``?lastEventId=``) and the ids of the events
the stream will deliver although the page already shows them. The script applies every
other event, so the page neither misses what happened between drawing and connecting nor
applies anything twice. A holder's changes go through the REST API
(``board/static/board/board.js``), which calls ``board.transitions``.

Plain HTML forms post here instead, and work without the script: a comment on a task's
page (any user who may see the task), requeuing, resolving or cancelling an escalated task
on its page (those who may triage, escalations.triage) and pausing or resuming a queue in
the board's queues panel (staff). Each calls its transition and redirects back.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.contrib import messages
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_required
from django.contrib.auth.forms import PasswordResetForm
from django.core.exceptions import PermissionDenied
from django.db import connection, transaction
from django.db.models import Count, QuerySet
from django.forms import Form
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect, JsonResponse
from django.shortcuts import get_object_or_404, render
from django.urls import reverse
from django.utils import timezone
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_POST, require_safe

from board import conf, transitions
from board.access import QueueAccess, queue_access
from board.api.permissions import may_pause_queues
from board.api.serializers import TaskSerializer
from board.exceptions import ForbiddenQueue, InvalidTransition, TaskNotFound
from board.live.relay import head_below_horizon, run_on_django
from board.models import QUEUE_PATTERN, EventType, Task, TaskEvent, TaskStatus
from board.notifications import deliveries
from board.pages.forms import MAX_NOTE_LENGTH, CommentForm, QueueNoteForm
from board.pages.relations import SUMMARY_FIELDS, Summary, hidden, relations_of, summary
from board.pages.timeline import TimelineEntry, requested_page
from board.queues import agent_list, queue_panel, queue_totals
from board.sql import QUERIES
from board.templatetags.board_extras import EVENT_TEXT_LIMIT, progress_text
from escalations.triage import TRIAGES, NoteForm, may_triage

# The board shows every open task up to this many per column (a note counts the rest)...
OPEN_COLUMN_LIMIT = 200
# ...and the most recently finished (done or cancelled) tasks.
FINISHED_LIMIT = 50

# A card shows neither: the task page does. Payloads may be up to 1 MiB each.
CARD_OMITS = {"payload", "description", "result", "progress"}

_NEVER = datetime.min.replace(tzinfo=UTC)

# The queues panel's columns: the keys of a queue's "counts" (board.queues.queue_list).
QUEUE_COUNTS = [
    ("pending", "Pending"),
    ("blocked", "Blocked"),
    ("in_progress", "In progress"),
    ("escalated", "Escalated"),
    ("done", "Done"),
    ("cancelled", "Cancelled"),
]

# The agents panel shows this many agents, those holding tasks and seen last first.
AGENTS_LIMIT = 50
# The queues panel (and the queue filter) shows this many queues: paused ones first, then
# the busiest (board.queues.queue_panel); a note counts the rest.
QUEUES_LIMIT = 50

COUNTS_FROM_TOTALS = ("in_progress", "escalated", "done", "cancelled")

COUNTS = [
    (TaskStatus.PENDING.value, "Pending"),
    (TaskStatus.IN_PROGRESS.value, "In progress"),
    (TaskStatus.ESCALATED.value, "Escalated"),
    (TaskStatus.DONE.value, "Done"),
    (TaskStatus.CANCELLED.value, "Cancelled"),
]


@dataclass(frozen=True)
class Column:
    """A column of the board: the tasks in ``statuses``, in ``ordering``, up to a limit."""

    key: str
    label: str
    statuses: tuple[str, ...]
    ordering: tuple[str, ...]
    finished: bool = False

    def tasks(self, tasks: QuerySet[Task]) -> list[Task]:
        limit = FINISHED_LIMIT if self.finished else OPEN_COLUMN_LIMIT
        return list(tasks.filter(status__in=self.statuses).order_by(*self.ordering)[:limit])


COLUMNS = [
    # Pending and in progress in claim order.
    Column("pending", "Pending", (TaskStatus.PENDING,), ("-priority", "created_at", "id")),
    Column(
        "in_progress", "In progress", (TaskStatus.IN_PROGRESS,), ("-priority", "created_at", "id")
    ),
    # Oldest escalation first: an escalated task was last updated when it escalated.
    Column("escalated", "Escalated", (TaskStatus.ESCALATED,), ("updated_at", "id")),
    Column(
        "finished",
        "Done & cancelled",
        (TaskStatus.DONE, TaskStatus.CANCELLED),
        ("-updated_at", "-id"),
        finished=True,
    ),
]


def unstable_event_ids(horizon: str, task_id: int | None = None) -> list[int]:
    """Return the ids of the events this snapshot sees past the horizon (of one task)."""
    with connection.cursor() as cursor:
        cursor.execute(
            QUERIES["snapshot_unstable_events"], {"horizon": horizon, "task_id": task_id}
        )
        return [int(row[0]) for row in cursor.fetchall()]


@contextmanager
def page_snapshot() -> Iterator[None]:
    """Run the block's reads in one read-only REPEATABLE READ snapshot.

    Every statement then sees the same database: the counts, the cards, the stream head
    and the list of events to skip agree with each other. Inside an outer transaction (a
    test's), the isolation level is the outer one's.
    """
    outermost = not connection.in_atomic_block
    with transaction.atomic():
        if outermost:
            with connection.cursor() as cursor:
                cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        yield


def queue_filter(request: HttpRequest) -> str | None:
    """Return the ``?queue=`` of the request, or None when it is absent or no queue name."""
    queue = request.GET.get("queue", "").strip()
    return queue if re.match(QUEUE_PATTERN, queue) else None


def comment_counts(task_ids: list[int]) -> dict[int, int]:
    """Return how many comments each of ``task_ids`` has (those with none are left out)."""
    if not task_ids:
        return {}
    rows = (
        TaskEvent.objects.filter(task_id__in=task_ids, type=EventType.COMMENTED)
        .values_list("task_id")
        .annotate(n=Count("id"))
        .order_by()
    )
    return dict(rows)


def _card(task: dict[str, Any], comments: dict[int, int]) -> dict[str, Any]:
    """Return what a card shows of a serialized task: not its (possibly large) data, but
    the start of its progress and how many comments it has."""
    card = {key: value for key, value in task.items() if key not in CARD_OMITS}
    card["progress_text"] = progress_text(task["progress"])
    card["comments"] = comments.get(task["id"], 0)
    return card


def _stream_context(resume_id: int, skip: list[int]) -> dict[str, Any]:
    return {"resume_id": resume_id, "skip": skip, "now": timezone.now().isoformat()}


def visible_agents(access: QueueAccess, viewer: str) -> list[dict[str, Any]]:
    """Return the agents panel's rows (board.queues.agent_list, which shows a user limited
    to queues only itself): those holding tasks first, then the most recently seen, up to
    AGENTS_LIMIT."""
    agents = agent_list(access, viewer)
    agents.sort(key=lambda agent: agent["name"])
    agents.sort(key=lambda agent: agent["last_seen_at"] or _NEVER, reverse=True)
    agents.sort(key=lambda agent: not agent["holding"])
    return agents[:AGENTS_LIMIT]


def dependencies_of(tasks: list[Task], access: QueueAccess) -> dict[int, Summary]:
    """Return, by id, the dependencies of each blocked task of ``tasks``: what keeps it
    blocked is those not done. One of a queue the user may not see is listed by id only."""
    ids = {dep for task in tasks if task.blocked for dep in task.depends_on}
    found = Task.objects.filter(pk__in=ids).only(*SUMMARY_FIELDS) if ids else []
    return {
        task.pk: summary(task) if access.allows(task.queue) else hidden(task.pk) for task in found
    }


@require_safe
@login_required
def home(request: HttpRequest) -> HttpResponse:
    """Show the board: open tasks by status, the latest finished ones, counts per status,
    and at a glance every queue and agent."""
    queue = queue_filter(request)
    access = queue_access(request.user)
    # Before the page's snapshot: everything below the horizon is then either visible to
    # it or will never exist.
    horizon, head = run_on_django(head_below_horizon())
    resume_id = head.id
    with page_snapshot():
        skip = unstable_event_ids(horizon)
        # A user limited to queues (board.access) sees only those, here as in the API.
        visible = access.visible(Task.objects.all())
        tasks = visible.filter(queue=queue) if queue else visible
        counts = dict(tasks.values_list("status").annotate(n=Count("id")).order_by())
        columns = {column.key: column.tasks(tasks) for column in COLUMNS}
        cards = [task for shown in columns.values() for task in shown]
        comments = comment_counts([task.pk for task in cards])
        dependencies = dependencies_of(cards, access)
        queue_rows, queues_in_all = queue_panel(access, QUEUES_LIMIT)
        agents = visible_agents(access, request.user.get_username())
    # The filter offers the queues of the panel, and the one shown; any other is a name to
    # type (the panel's note), so that neither grows with the number of queues.
    queues = sorted({row["name"] for row in queue_rows} | ({queue} if queue else set()))
    counts = {status.value: counts.get(status.value, 0) for status in TaskStatus}
    can_pause = may_pause_queues(request.user)
    state = {
        **_stream_context(resume_id, skip),
        "page": "board",
        "user": request.user.get_username(),
        "queue": queue,
        "lease_seconds": conf.lease_seconds(),
        "open_limit": OPEN_COLUMN_LIMIT,
        "finished_limit": FINISHED_LIMIT,
        "agents_limit": AGENTS_LIMIT,
        "queues_limit": QUEUES_LIMIT,
        "queues_in_all": queues_in_all,
        "counts": counts,
        "tasks": [_card(data, comments) for data in TaskSerializer(cards, many=True).data],
        "dependencies": dependencies,
        "queues": queue_rows,
        "agents": agents,
        "can_pause": can_pause,
    }
    return render(
        request,
        "board/home.html",
        {
            "state": state,
            "queue": queue,
            "queues": queues,
            "counts": [(status, label, counts[status]) for status, label in COUNTS],
            "columns": [
                {
                    "key": column.key,
                    "label": column.label,
                    "tasks": columns[column.key],
                    "count": sum(counts[status] for status in column.statuses),
                }
                for column in COLUMNS
            ],
            "dependencies": dependencies,
            "comments": comments,
            "queue_rows": queue_rows,
            "queues_in_all": queues_in_all,
            "count_columns": QUEUE_COUNTS,
            "agents": agents,
            "can_pause": can_pause,
            "finished_limit": FINISHED_LIMIT,
            "now": timezone.now(),
        },
    )


@require_safe
def panels(request: HttpRequest) -> HttpResponse:
    """Return the board's queues and agents panels, and its counts (of ``?queue=``, or of
    every queue), as JSON: what the open board reads again after events. As bounded as
    the page: at most QUEUES_LIMIT queues and AGENTS_LIMIT agents."""
    if not request.user.is_authenticated:
        # The board's script reads a 401 as the end of its session (a redirect to the
        # login page would read as a page it cannot parse).
        return JsonResponse({"detail": "Not logged in."}, status=401)
    access = queue_access(request.user)
    queue_rows, queues_in_all = queue_panel(access, QUEUES_LIMIT)
    totals = queue_totals(access, queue_filter(request))
    return JsonResponse(
        {
            "queues": queue_rows,
            "queues_in_all": queues_in_all,
            "agents": visible_agents(access, request.user.get_username()),
            # The board counts blocked tasks as pending, as their status says.
            "counts": {
                "pending": totals["pending"] + totals["blocked"],
                **{status: totals[status] for status in COUNTS_FROM_TOTALS},
            },
        }
    )


def _task_page(
    request: HttpRequest,
    pk: int,
    *,
    form: CommentForm | None = None,
    triage_form: Form | None = None,
    status: int = 200,
) -> HttpResponse:
    """Render a task's page, with ``form`` (a comment that was refused) or ``triage_form``
    (a requeue, resolve or cancel that was refused) if given."""
    access = queue_access(request.user)
    # Before the page's snapshot: everything below the horizon is then either visible to
    # it or will never exist.
    horizon, head = run_on_django(head_below_horizon())
    resume_id = head.id
    with page_snapshot():
        visible = access.visible(Task.objects.all())
        task = get_object_or_404(visible, pk=pk)
        page = requested_page(task.pk, request.GET)
        skip = unstable_event_ids(horizon, task.pk)
        relations = relations_of(task, access)
    data = TaskSerializer(task).data
    state = {
        **_stream_context(resume_id, skip),
        "page": "task",
        "user": request.user.get_username(),
        "lease_seconds": conf.lease_seconds(),
        "task": data,
        "relations": relations,
        # Live events join the timeline only on its newest page.
        "timeline_live": page.latest,
        "event_count": page.total,
        "event_text_limit": EVENT_TEXT_LIMIT,
    }
    return render(
        request,
        "board/task.html",
        {
            "state": state,
            "task": task,
            "timeline_page": page,
            "relations": relations,
            "comment_form": form or CommentForm(),
            "can_triage": may_triage(request.user),
            "triage_form": triage_form,
            "now": timezone.now(),
        },
        status=status,
    )


@require_safe
@login_required
def task_detail(request: HttpRequest, pk: int) -> HttpResponse:
    """Show one task, its payload, progress and result, its place in the work graph
    (parent, children, dependencies, dependents) and its timeline, oldest first: its newest
    events, or with ``?before=`` or ``?after=`` (an event id) the page of older or newer."""
    return _task_page(request, pk)


@require_safe
@login_required
def event_detail(request: HttpRequest, pk: int, event_id: int) -> HttpResponse:
    """Show one event of a task in full: the timeline cuts long texts short."""
    visible = queue_access(request.user).visible(Task.objects.all())
    task = get_object_or_404(visible, pk=pk)
    event = get_object_or_404(TaskEvent.objects.filter(task=task), pk=event_id)
    entry = TimelineEntry(event=event, first=event, ids=[event.pk])
    return render(request, "board/event.html", {"task": task, "entry": entry, "full": True})


@require_POST
@login_required
def comment(request: HttpRequest, pk: int) -> HttpResponse:
    """Add the posted comment to the task's timeline, then show the task's page there.

    Any user who may see the task may comment on it, in any status.
    """
    visible = queue_access(request.user).visible(Task.objects.all())
    if not visible.filter(pk=pk).exists():
        raise Http404("No such task.")
    form = CommentForm(request.POST)
    if not form.is_valid():
        return _task_page(request, pk, form=form, status=400)
    try:
        event = transitions.comment(task_id=pk, actor=request.user, body=form.cleaned_data["body"])
    except TaskNotFound as exc:
        raise Http404("No such task.") from exc
    return HttpResponseRedirect(f"{reverse('board:task', args=[pk])}#event-{event.pk}")


@require_POST
@login_required
def triage(request: HttpRequest, pk: int, name: str) -> HttpResponse:
    """Requeue, resolve or cancel an escalated task (``name``), as the escalation queue in
    the admin does and with the same transitions, then show the task's page again."""
    if not may_triage(request.user):
        raise PermissionDenied("Only staff who may triage requeue, resolve or cancel.")
    way_out = TRIAGES.get(name)
    if way_out is None:
        raise Http404("No such action.")
    visible = queue_access(request.user).visible(Task.objects.all())
    if not visible.filter(pk=pk).exists():
        raise Http404("No such task.")
    # The page's one form has a note for each of the three (the admin's requeue is a
    # button without one).
    form = (way_out.form_class or NoteForm)(request.POST)
    if not form.is_valid():
        return _task_page(request, pk, triage_form=form, status=400)
    fields = form.cleaned_data
    try:
        task = way_out.transition(task_id=pk, actor=request.user, **fields)
    except (InvalidTransition, TaskNotFound) as exc:
        messages.warning(request, str(exc))
    else:
        messages.success(request, f"{way_out.done} {task}.")
    return HttpResponseRedirect(reverse("board:task", args=[pk]))


def _set_paused(request: HttpRequest, name: str, *, paused: bool) -> HttpResponse:
    """Pause or resume queue ``name`` as the user, then go back to where the form was."""
    if not may_pause_queues(request.user):
        raise PermissionDenied("Only staff may pause or resume queues.")
    try:
        queue_access(request.user).check(name)
    except ForbiddenQueue as exc:
        raise PermissionDenied(str(exc)) from exc
    form = QueueNoteForm(request.POST)
    if not form.is_valid():
        messages.error(request, f"The note is too long: at most {MAX_NOTE_LENGTH} characters.")
    elif paused:
        transitions.pause_queue(queue=name, actor=request.user, note=form.cleaned_data["note"])
        messages.success(request, f"Paused {name}: no claim hands out its tasks until resumed.")
    else:
        transitions.resume_queue(queue=name, actor=request.user, note=form.cleaned_data["note"])
        messages.success(request, f"Resumed {name}.")
    target = request.POST.get("next", "")
    if not url_has_allowed_host_and_scheme(
        target, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        target = reverse("board:home")
    return HttpResponseRedirect(target)


@require_POST
@login_required
def pause_queue(request: HttpRequest, name: str) -> HttpResponse:
    """Pause a queue: a claim hands out none of its tasks until it is resumed."""
    return _set_paused(request, name, paused=True)


@require_POST
@login_required
def resume_queue(request: HttpRequest, name: str) -> HttpResponse:
    """Resume a paused queue."""
    return _set_paused(request, name, paused=False)


class PasswordResetView(auth_views.PasswordResetView):
    """Django's password reset form, whose email is queued (board.notifications.deliveries
    sends it, at least once, within TASKBOARD_WEBHOOK_TIMEOUT_SECONDS a try) rather than sent in the
    request: an SMTP server that never answers holds no request, and the answer does the
    same work, in the same time, whether or not the address has an account. Routed only
    when EMAIL_URL is set (taskboard.urls); each POST counts against the client's address
    as a failed login does (access.throttle)."""

    def form_valid(self, form: PasswordResetForm) -> HttpResponse:
        deliveries.queue_password_reset(address=form.cleaned_data["email"])
        return HttpResponseRedirect(self.get_success_url())
