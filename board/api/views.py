"""The v1 REST API. Viewsets declare, serializers validate, ``board.transitions`` decides."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from typing import Any, cast

from django.db.models import Q, QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_view,
)
from rest_framework import exceptions, permissions, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.utils.encoders import JSONEncoder as DRFJSONEncoder
from rest_framework.utils.urls import replace_query_param

from access import rates
from board import questions, transitions
from board import queues as glance
from board.access import QueueAccess, queue_access
from board.api import serializers as s
from board.api.permissions import IsStaff, MayTriage
from board.exceptions import ReferencedTaskNotFound
from board.live import waiting
from board.models import (
    QUEUE_PATTERN,
    Delivery,
    Task,
    TaskEvent,
    TaskQuerySet,
    Webhook,
    WebhookKind,
)
from board.notifications import deliveries
from board.ops import metrics

IDEMPOTENCY_HEADER = "Idempotency-Key"
IDEMPOTENCY_KEY_PATTERN = "^[!-~]{1,255}$"
IDEMPOTENCY_KEY = re.compile(IDEMPOTENCY_KEY_PATTERN)

ERRORS_400 = {400: OpenApiResponse(s.ValidationErrorSerializer, description="Invalid input.")}
ERRORS_404 = {404: OpenApiResponse(s.ErrorSerializer, description="No such task.")}
ERRORS_409_LEASE = {
    409: OpenApiResponse(
        s.ConflictSerializer,
        description="lease_lost: you do not hold a live lease on this task; stop working on it.",
    )
}
ERRORS_409_TRANSITION = {
    409: OpenApiResponse(
        s.ConflictSerializer,
        description="invalid_transition: the task's status does not allow this action.",
    )
}


def errors_429_rate(setting: str, what: str) -> dict[int, OpenApiResponse]:
    """The refusal of a write past the user's rate (access.rates); its ``Retry-After``
    header is declared with the other 429's (board.api.schema)."""
    return {
        429: OpenApiResponse(
            s.ErrorSerializer,
            description=(
                f"rate_limited: more {what} in the last minute than `{setting}` "
                "allows per user (0 turns it off). Nothing was done; try again after the "
                "`Retry-After` header's seconds."
            ),
        )
    }


FORBIDDEN_QUEUE = "forbidden_queue: your agent is limited to other queues (create_agent --queues)."
ERRORS_403_QUEUE = {403: OpenApiResponse(s.ErrorSerializer, description=FORBIDDEN_QUEUE)}
ERRORS_403 = {
    403: OpenApiResponse(
        s.ErrorSerializer,
        description=(
            "permission_denied: staff with the escalations.triage_task permission only; "
            + FORBIDDEN_QUEUE
        ),
    )
}


# Rows read in a page's first batch; later batches are sized by the bytes per row seen so
# far. Small, so that a page of large rows loads few more of them than it keeps.
FIRST_BATCH = 16


def json_size(data: Any) -> int:
    """Return the bytes ``data`` takes in the API's JSON (DRF's renderer: UTF-8, compact)."""
    text = json.dumps(data, cls=DRFJSONEncoder, ensure_ascii=False, separators=(",", ":"))
    return len(text.encode())


def keyset_page(
    request: Request,
    queryset: QuerySet[Any],
    *,
    limit: int,
    render: Callable[[Any], dict[str, Any]],
    after: int | None = None,
    before: int | None = None,
    budget: int = s.PAGE_BYTES,
) -> tuple[list[dict[str, Any]], str | None]:
    """Return one page of ``queryset``, each row rendered, and the URL of the next page, or
    None at the end.

    Keyset pagination on the primary key: ascending from ``after``, or descending from
    ``before`` when ``after`` is None. Each page is an index range scan, as fast at the
    millionth row as at the first, and a page never repeats or skips a row.

    A page holds ``limit`` rows, or fewer when they are large: it stops before the row that
    would take its JSON past ``budget`` bytes (the first row is always kept), and ``next``
    continues after the last row it holds. Rows are read in batches, so that large rows past
    the budget are not all loaded to be dropped.
    """
    if after is not None:
        ordered, param, newer = queryset.order_by("id"), "after", "id__gt"
        queryset = ordered.filter(id__gt=after)
    else:
        ordered, param, newer = queryset.order_by("-id"), "before", "id__lt"
        queryset = ordered.filter(id__lt=before) if before else ordered
    results: list[dict[str, Any]] = []
    size = 0
    last: int | None = None
    batch = FIRST_BATCH
    while True:
        # One row more than the page needs tells whether another page follows.
        wanted = min(batch, limit + 1 - len(results))
        rows = list((queryset if last is None else ordered.filter(**{newer: last}))[:wanted])
        for row in rows:
            if len(results) == limit:
                return results, replace_query_param(request.build_absolute_uri(), param, last)
            data = render(row)
            row_size = json_size(data) + 1  # and its comma
            if results and size + row_size > budget:
                return results, replace_query_param(request.build_absolute_uri(), param, last)
            results.append(data)
            size += row_size
            last = row.id
        if len(rows) < wanted:
            return results, None
        # As many rows as the budget still has room for, at the bytes per row seen so far.
        batch = max(1, (budget - size) * len(results) // max(size, 1)) + 1


def release_fields(serializer: serializers.Field[Any, Any, Any, Any]) -> None:
    """Unbind the serializer's fields, once it has validated.

    Each bound field points back to its parent (``field.parent``; a list's ``child`` to
    the list), reference cycles that only the garbage collector's full collections free,
    and with them the body the serializer holds: a task's 0.9 MB description stayed until
    then. Unbound, the serializer and its fields are freed as soon as they are no longer
    used; ``fields`` would be bound afresh if anything asked for it again.
    """
    state = vars(serializer)
    state.pop("parent", None)
    for field in [*state.pop("fields", {}).values(), state.get("child")]:
        if field is not None:
            release_fields(field)


def render_task(task: Task) -> dict[str, Any]:
    return s.render(s.TaskSerializer, task)


def render_event(event: TaskEvent) -> dict[str, Any]:
    return s.render(s.EventSerializer, event)


class BoardViewSet(viewsets.GenericViewSet[Any]):
    # Policy shared by the API: JSON in and out, authenticated users only, and each user's
    # queue limit (board.access): rows of other queues are left out of every queryset, and
    # views check the queue of what they create, claim or act on.

    permission_classes = [permissions.IsAuthenticated]
    # The lookup from this viewset's model to the queue of its row.
    queue_field = "queue"

    @property
    def access(self) -> QueueAccess:
        return queue_access(self.request.user)

    def get_queryset(self) -> QuerySet[Any]:
        return self.access.visible(super().get_queryset(), self.queue_field)

    def validated(self, serializer_class: type[serializers.Serializer[Any]]) -> dict[str, Any]:
        serializer = serializer_class(data=self.request.data)
        try:
            serializer.is_valid(raise_exception=True)
            return dict(serializer.validated_data)
        finally:
            release_fields(serializer)

    def query(self, serializer_class: type[serializers.Serializer[Any]]) -> dict[str, Any]:
        """Validate the query parameters that ``serializer_class`` declares, as the schema
        states them: each at most once, and an empty value is a value (``?status=`` is
        refused), not an absent parameter as DRF reads form data."""
        params = self.request.query_params
        serializer = serializer_class(data={name: values[-1] for name, values in params.lists()})
        repeated = {
            name: ["Give this parameter once."]
            for name, values in params.lists()
            if len(values) > 1 and name in serializer.fields
        }
        try:
            if repeated:
                raise exceptions.ValidationError(repeated)
            serializer.is_valid(raise_exception=True)
            return dict(serializer.validated_data)
        finally:
            release_fields(serializer)


@extend_schema_view(
    list=extend_schema(
        operation_id="tasks_list",
        summary="List tasks, newest first",
        parameters=[s.TaskFilterSerializer, s.TaskListPageSerializer],
        responses={200: s.TaskPageSerializer, **ERRORS_400},
    ),
    retrieve=extend_schema(summary="Read a task", responses={200: s.TaskSerializer, **ERRORS_404}),
    create=extend_schema(
        summary="Create a task",
        description=(
            "With an `Idempotency-Key` header, a repeat of the key by the same user creates "
            "nothing: the same body answers 200 with the task the key created, as it is now; "
            "another body answers 409 `idempotency_conflict`."
        ),
        parameters=[
            OpenApiParameter(
                IDEMPOTENCY_HEADER,
                OpenApiTypes.STR,
                OpenApiParameter.HEADER,
                required=False,
                pattern=IDEMPOTENCY_KEY_PATTERN,
                description=(
                    "1 to 255 visible ASCII characters, unique per user: a retry with the "
                    "same key and body creates nothing."
                ),
            )
        ],
        request=s.TaskCreateSerializer,
        responses={
            201: s.TaskSerializer,
            200: OpenApiResponse(
                s.TaskSerializer,
                description="The key was used before with this body: the task it created.",
            ),
            **ERRORS_400,
            **ERRORS_403_QUEUE,
            404: OpenApiResponse(
                s.ErrorSerializer,
                description="not_found: a task named in depends_on or parent_id does not exist.",
            ),
            409: OpenApiResponse(
                s.ErrorSerializer,
                description="idempotency_conflict: the key was used before with another body.",
            ),
            **errors_429_rate("TASKBOARD_CREATE_RATE", "tasks created"),
        },
    ),
)
class TaskViewSet(BoardViewSet):
    # Tasks, and the transitions agents and humans make on them.

    queryset = Task.objects.all()
    serializer_class = s.TaskSerializer
    # Ids are bigints: a longer string is no task (404), never a database error.
    lookup_value_regex = r"[0-9]{1,18}"

    def list(self, request: Request) -> Response:
        filters = self.query(s.TaskFilterSerializer)
        page = self.query(s.TaskListPageSerializer)
        tasks = self.get_queryset()
        if "status" in filters:
            tasks = tasks.filter(status=filters["status"])
        if "queue" in filters:
            tasks = tasks.filter(queue=filters["queue"])
        if "leased_by" in filters:
            tasks = tasks.filter(leased_by_id=filters["leased_by"])
        if "parent" in filters:
            tasks = tasks.filter(parent_id=filters["parent"])
        if "blocked" in filters:
            tasks = cast(TaskQuerySet, tasks).blocked(filters["blocked"] == "true")
        if "depends_on" in filters:
            tasks = tasks.filter(dependencies__depends_on_id=filters["depends_on"])
        if "assignee" in filters:
            name = filters["assignee"]
            name = request.user.get_username() if name == "me" else name
            tasks = tasks.filter(Q(assignee_id=name) | Q(question__assignee=name))
        if "requires" in filters:
            # Spelled as tasks_requires_idx's predicate, so that the index serves it.
            tasks = tasks.extra(
                where=["tasks.requires <> '{}' AND tasks.requires @> ARRAY[%s]::varchar[]"],
                params=[filters["requires"]],
            )
        results, next_url = keyset_page(
            request, tasks, limit=page["limit"], before=page.get("before"), render=render_task
        )
        return Response({"results": results, "next": next_url})

    def retrieve(self, request: Request, pk: str) -> Response:
        return Response(s.render(s.TaskSerializer, self.get_object()))

    def create(self, request: Request) -> Response:
        key = request.headers.get(IDEMPOTENCY_HEADER)
        if key is not None and not IDEMPOTENCY_KEY.fullmatch(key):
            raise exceptions.ValidationError(
                {IDEMPOTENCY_HEADER: ["Use 1 to 255 visible ASCII characters (no spaces)."]}
            )
        data = self.validated(s.TaskCreateSerializer)
        self.access.check(data.get("queue", "default"))
        self._check_tasks_exist(data)
        rates.spend(request.user, rates.Write.CREATE)
        task, created = transitions.create_once(actor=request.user, idempotency_key=key, **data)
        return Response(
            s.render(s.TaskSerializer, task),
            status=status.HTTP_201_CREATED if created else status.HTTP_200_OK,
        )

    def _check_tasks_exist(self, data: dict[str, Any]) -> None:
        """Refuse dependencies and parents that are not tasks the caller can see (404, as
        for a task asked for by id: a schema-valid id that names nothing)."""
        wanted = {*data["depends_on"], *([data["parent_id"]] if data["parent_id"] else [])}
        if not wanted:
            return
        found = set(self.get_queryset().filter(id__in=wanted).values_list("id", flat=True))
        if missing := sorted(set(data["depends_on"]) - found):
            raise ReferencedTaskNotFound(missing[0], "depends_on")
        if data["parent_id"] and data["parent_id"] not in found:
            raise ReferencedTaskNotFound(data["parent_id"], "parent_id")

    @extend_schema(
        summary="Comment on a task",
        description=(
            'Adds a `commented` event (payload `{"body": ...}`) to the task\'s history, in '
            "any status. It appears on the stream like every other event."
        ),
        request=s.CommentSerializer,
        responses={
            201: s.EventSerializer,
            **ERRORS_400,
            **ERRORS_403_QUEUE,
            **ERRORS_404,
            **errors_429_rate("TASKBOARD_COMMENT_RATE", "comments"),
        },
    )
    @action(detail=True, methods=["post"])
    def comments(self, request: Request, pk: str) -> Response:
        self.access.check_task(int(pk))
        data = self.validated(s.CommentSerializer)
        rates.spend(request.user, rates.Write.COMMENT)
        event = transitions.comment(task_id=int(pk), actor=request.user, **data)
        return Response(s.render(s.EventSerializer, event), status=status.HTTP_201_CREATED)

    @extend_schema(
        summary="Claim tasks",
        description=(
            "Lease up to `limit` claimable tasks, highest priority first. Concurrent claims "
            "never get the same task. Each task carries a fresh `lease_token`."
        ),
        request=s.ClaimSerializer,
        responses={200: s.ClaimResponseSerializer, **ERRORS_400, **ERRORS_403_QUEUE},
    )
    @action(detail=False, methods=["post"])
    def claim(self, request: Request) -> Response:
        data = self.validated(s.ClaimSerializer)
        queues = self.access.claim_queues(data["queues"])
        # Timed here, by the claim's one caller (waiting claims, MCP tools and the board's
        # pages all come through this view): the state machine knows nothing of metrics.
        with metrics.CLAIM_SECONDS.time():
            claims = transitions.claim(
                actor=request.user,
                queues=queues,
                limit=data["limit"],
                lease_seconds=data.get("lease_seconds"),
            )
        tasks = []
        for claim in claims:
            claim.task.lease_token = claim.lease_token
            tasks.append(claim.task)
        if not tasks and (report := waiting.claim_report(request)) is not None:
            # For board.live.waiting, which holds the request between attempts: that it
            # claimed nothing, when work next becomes claimable without an event to
            # announce it, and the queues this claim takes from (fewer than its body named,
            # for an agent limited to queues).
            report.empty = True
            at = glance.next_claimable_at(queues)
            report.next_claimable = at.timestamp() if at is not None else None
            if self.access.limited:
                report.queues = frozenset(queues)
        return Response({"tasks": s.render_many(s.ClaimedTaskSerializer, tasks)})

    def _transition(self, pk: str, transition: Any, serializer_class: Any) -> Response:
        """Validate the body with ``serializer_class``, apply ``transition``, render the task."""
        self.access.check_task(int(pk))
        task = transition(
            task_id=int(pk), actor=self.request.user, **self.validated(serializer_class)
        )
        return Response(s.render(s.TaskSerializer, task))

    @extend_schema(
        summary="Extend your lease",
        description=(
            "Only the live lease holder may do this: the claim's `lease_token`, the same user, "
            "and a lease that has not run out. Otherwise 409 `lease_lost`: stop working on "
            "the task."
        ),
        request=s.HeartbeatSerializer,
        responses={
            200: s.TaskSerializer,
            **ERRORS_400,
            **ERRORS_403_QUEUE,
            **ERRORS_404,
            **ERRORS_409_LEASE,
        },
    )
    @action(detail=True, methods=["post"])
    def heartbeat(self, request: Request, pk: str) -> Response:
        return self._transition(pk, transitions.heartbeat, s.HeartbeatSerializer)

    @extend_schema(
        summary="Complete your task",
        description=(
            "Only the live lease holder may do this: the claim's `lease_token`, the same user, "
            "and a lease that has not run out. Otherwise 409 `lease_lost`: stop working on "
            "the task."
        ),
        request=s.CompleteSerializer,
        responses={
            200: s.TaskSerializer,
            **ERRORS_400,
            **ERRORS_403_QUEUE,
            **ERRORS_404,
            **ERRORS_409_LEASE,
        },
    )
    @action(detail=True, methods=["post"])
    def complete(self, request: Request, pk: str) -> Response:
        return self._transition(pk, transitions.complete, s.CompleteSerializer)

    @extend_schema(
        summary="Fail your task (one strike)",
        description=(
            "Only the live lease holder may do this: the claim's `lease_token`, the same user, "
            "and a lease that has not run out. Otherwise 409 `lease_lost`: stop working on "
            "the task."
        ),
        request=s.FailSerializer,
        responses={
            200: s.TaskSerializer,
            **ERRORS_400,
            **ERRORS_403_QUEUE,
            **ERRORS_404,
            **ERRORS_409_LEASE,
        },
    )
    @action(detail=True, methods=["post"])
    def fail(self, request: Request, pk: str) -> Response:
        return self._transition(pk, transitions.fail, s.FailSerializer)

    @extend_schema(
        summary="Release your task (no strike)",
        description=(
            "Only the live lease holder may do this: the claim's `lease_token`, the same user, "
            "and a lease that has not run out. Otherwise 409 `lease_lost`: stop working on "
            "the task."
        ),
        request=s.LeaseSerializer,
        responses={
            200: s.TaskSerializer,
            **ERRORS_400,
            **ERRORS_403_QUEUE,
            **ERRORS_404,
            **ERRORS_409_LEASE,
        },
    )
    @action(detail=True, methods=["post"])
    def release(self, request: Request, pk: str) -> Response:
        return self._transition(pk, transitions.release, s.LeaseSerializer)

    @extend_schema(
        summary="Escalate your task to a human",
        description=(
            "Only the live lease holder may do this: the claim's `lease_token`, the same user, "
            "and a lease that has not run out. Otherwise 409 `lease_lost`: stop working on "
            "the task."
        ),
        request=s.EscalateSerializer,
        responses={
            200: s.TaskSerializer,
            **ERRORS_400,
            **ERRORS_403_QUEUE,
            **ERRORS_404,
            **ERRORS_409_LEASE,
        },
    )
    @action(detail=True, methods=["post"])
    def escalate(self, request: Request, pk: str) -> Response:
        return self._transition(pk, transitions.escalate, s.EscalateSerializer)

    @extend_schema(
        summary="Ask a person (lease holder)",
        description=(
            "Instead of failing or escalating: the lease ends (no strike, the attempt clock "
            "stops) and the task awaits input until `answer_by` (now + `answer_within`, "
            "default TASKBOARD_ANSWER_WITHIN). Give `options` or an `answer_schema`, not "
            "both; neither: the answer is free text. Nobody answering in time escalates "
            "the task. After the answer, the task is held for you for "
            "TASKBOARD_ANSWER_HOLD_SECONDS: your next claim on its queue takes it first, "
            "with every answer in `answers`. Only the live lease holder may ask; otherwise "
            "409 `lease_lost`."
        ),
        request=s.AskSerializer,
        responses={
            200: s.TaskSerializer,
            **ERRORS_400,
            **ERRORS_403_QUEUE,
            **ERRORS_404,
            **ERRORS_409_LEASE,
        },
    )
    @action(detail=True, methods=["post"])
    def ask(self, request: Request, pk: str) -> Response:
        return self._transition(pk, transitions.ask, s.AskSerializer)

    @extend_schema(
        summary="Answer a task's question",
        description=(
            "The task's or the question's assignee, or a user with the `board.answer_task` "
            "permission, answers the open question: with `options`, one of them; with an "
            "`answer_schema`, a value it accepts; else a string. The task is pending again, "
            "held for the agent that asked for TASKBOARD_ANSWER_HOLD_SECONDS (other claims "
            "pass it by), then anyone's. A task that is not awaiting input: 409 "
            "`invalid_transition` (a second answer, say)."
        ),
        request=s.AnswerSerializer,
        responses={
            200: s.TaskSerializer,
            **ERRORS_400,
            403: OpenApiResponse(
                s.ErrorSerializer,
                description=(
                    "permission_denied: you may not answer it; forbidden_queue: a queue you "
                    "are limited away from."
                ),
            ),
            **ERRORS_404,
            **ERRORS_409_TRANSITION,
        },
    )
    @action(detail=True, methods=["post"])
    def answer(self, request: Request, pk: str) -> Response:
        task = self.get_object()
        if not questions.may_answer(request.user, task.question, task.assignee_id):
            raise exceptions.PermissionDenied(
                "Only the assignee or a user with the board.answer_task permission may "
                "answer this question."
            )
        data = self.validated(s.AnswerSerializer)
        task = transitions.answer(task_id=task.pk, actor=request.user, **data)
        if task.answers:
            metrics.observe_answer(task.answers[-1])
        return Response(s.render(s.TaskSerializer, task))

    @extend_schema(
        summary="Requeue a task (staff)",
        request=s.NoteSerializer,
        responses={
            200: s.TaskSerializer,
            **ERRORS_400,
            **ERRORS_403,
            **ERRORS_404,
            **ERRORS_409_TRANSITION,
        },
    )
    @action(detail=True, methods=["post"], permission_classes=[MayTriage])
    def requeue(self, request: Request, pk: str) -> Response:
        return self._transition(pk, transitions.requeue, s.NoteSerializer)

    @extend_schema(
        summary="Resolve an escalated task (staff)",
        request=s.ResolveSerializer,
        responses={
            200: s.TaskSerializer,
            **ERRORS_400,
            **ERRORS_403,
            **ERRORS_404,
            **ERRORS_409_TRANSITION,
        },
    )
    @action(detail=True, methods=["post"], permission_classes=[MayTriage])
    def resolve(self, request: Request, pk: str) -> Response:
        return self._transition(pk, transitions.resolve, s.ResolveSerializer)

    @extend_schema(
        summary="Cancel a task (staff)",
        request=s.NoteSerializer,
        responses={
            200: s.TaskSerializer,
            **ERRORS_400,
            **ERRORS_403,
            **ERRORS_404,
            **ERRORS_409_TRANSITION,
        },
    )
    @action(detail=True, methods=["post"], permission_classes=[MayTriage])
    def cancel(self, request: Request, pk: str) -> Response:
        return self._transition(pk, transitions.cancel, s.NoteSerializer)

    @extend_schema(
        summary="A task's events, oldest first",
        parameters=[s.TaskEventFilterSerializer],
        responses={200: s.EventPageSerializer, **ERRORS_400, **ERRORS_404},
    )
    @action(detail=True, methods=["get"])
    def events(self, request: Request, pk: str) -> Response:
        task = self.get_object()
        params = self.query(s.TaskEventFilterSerializer)
        results, next_url = keyset_page(
            request,
            TaskEvent.objects.filter(task=task),
            after=params["after"],
            limit=params["limit"],
            render=render_event,
        )
        return Response({"results": results, "next": next_url})


class EventViewSet(BoardViewSet):
    # The append-only audit log of every transition.

    queryset = TaskEvent.objects.all()
    serializer_class = s.EventSerializer
    queue_field = "task__queue"

    @extend_schema(
        operation_id="events_list",
        summary="The event log, by ascending id",
        parameters=[s.EventFilterSerializer],
        responses={200: s.EventPageSerializer, **ERRORS_400},
    )
    def list(self, request: Request) -> Response:
        params = self.query(s.EventFilterSerializer)
        events = self.get_queryset()
        if "task" in params:
            events = events.filter(task_id=params["task"])
        if "type" in params:
            events = events.filter(type=params["type"])
        results, next_url = keyset_page(
            request, events, after=params["after"], limit=params["limit"], render=render_event
        )
        return Response({"results": results, "next": next_url})


ERRORS_403_STAFF = {
    403: OpenApiResponse(
        s.ErrorSerializer, description="permission_denied: staff only; " + FORBIDDEN_QUEUE
    ),
    404: OpenApiResponse(s.ErrorSerializer, description="Not a queue name."),
}


class QueueViewSet(BoardViewSet):
    # Queues at a glance, from counters kept by the transitions; staff pause and resume.

    lookup_field = "name"
    lookup_value_regex = QUEUE_PATTERN.strip("^").removesuffix(r"\Z")
    # For DRF's OPTIONS answer, which describes the body of the POST actions.
    serializer_class = s.NoteSerializer

    @extend_schema(
        operation_id="queues_list",
        summary="Every queue that has tasks, with its counts",
        description=(
            "Read from counters that every transition keeps in step, never a scan of the "
            "tasks: as fast with millions of finished tasks as with ten. Paged by name: "
            "at most `limit` queues, and a `Link` header to the next page when more follow."
        ),
        parameters=[
            s.QueuePageSerializer,
            OpenApiParameter(
                "Link",
                OpenApiTypes.STR,
                OpenApiParameter.HEADER,
                response=[200],
                description=(
                    'When more queues follow: `<url>; rel="next"`, the next page. Absent on '
                    "the last page."
                ),
            ),
        ],
        responses={200: s.QueueSerializer(many=True), **ERRORS_400},
    )
    def list(self, request: Request) -> Response:
        page = self.query(s.QueuePageSerializer)
        limit = page["limit"]
        queues = glance.queue_list(self.access, after=page.get("after"), limit=limit + 1)
        response = Response(s.render_many(s.QueueSerializer, queues[:limit]))
        if len(queues) > limit:
            url = replace_query_param(
                request.build_absolute_uri(), "after", queues[limit - 1]["name"]
            )
            response["Link"] = f'<{url}>; rel="next"'
        return response

    def _set_paused(self, name: str, paused: bool) -> Response:
        self.access.check(name)
        note = self.validated(s.NoteSerializer)["note"]
        change = transitions.pause_queue if paused else transitions.resume_queue
        change(queue=name, actor=self.request.user, note=note)
        return Response(s.render(s.QueueSerializer, glance.queue_detail(name, self.access)))

    @extend_schema(
        summary="Pause a queue (staff)",
        description=(
            "Claims stop handing out the queue's tasks; leases already held run on. "
            "Recorded with actor, time and note."
        ),
        request=s.NoteSerializer,
        responses={200: s.QueueSerializer, **ERRORS_400, **ERRORS_403_STAFF},
    )
    @action(detail=True, methods=["post"], permission_classes=[IsStaff])
    def pause(self, request: Request, name: str) -> Response:
        return self._set_paused(name, True)

    @extend_schema(
        summary="Resume a queue (staff)",
        description="Claims take the queue's tasks again; claims waiting on it wake at once.",
        request=s.NoteSerializer,
        responses={200: s.QueueSerializer, **ERRORS_400, **ERRORS_403_STAFF},
    )
    @action(detail=True, methods=["post"], permission_classes=[IsStaff])
    def resume(self, request: Request, name: str) -> Response:
        return self._set_paused(name, False)


class AgentViewSet(BoardViewSet):
    # Who holds what, and how each agent's leases ended lately.

    serializer_class = s.AgentSerializer

    @extend_schema(
        operation_id="agents_list",
        summary="Every user that has claimed a task",
        description=(
            "The tasks each holds now, when it was last seen (its last claim, heartbeat, "
            "complete, fail, release or escalate), and how its leases ended in the last "
            "24 hours (counted by the hour)."
        ),
        responses={200: s.AgentSerializer(many=True)},
    )
    def list(self, request: Request) -> Response:
        agents = glance.agent_list(self.access, request.user.get_username())
        return Response(s.render_many(s.AgentSerializer, agents))


class IsStaffForWebhooks(IsStaff):
    message = "Only staff may see or change webhooks."


ERRORS_403_WEBHOOKS = {
    403: OpenApiResponse(
        s.ErrorSerializer,
        description=(
            "permission_denied: staff only. forbidden_queue: a queue outside the queues "
            "this user is limited to."
        ),
    )
}
ERRORS_404_WEBHOOK = {404: OpenApiResponse(s.ErrorSerializer, description="No such webhook.")}


class WebhookViewSet(BoardViewSet):
    # Staff tell humans about events: webhooks (board.notifications.deliveries sends them).

    queryset = Webhook.objects.filter(kind=WebhookKind.WEBHOOK)
    serializer_class = s.WebhookSerializer
    permission_classes = [IsStaffForWebhooks]
    lookup_value_regex = r"[0-9]{1,18}"

    def get_queryset(self) -> QuerySet[Any]:
        # Staff see every webhook; staff limited to queues (board.access), only those that
        # send nothing but their own queues' events, as for tasks and events themselves.
        return self.access.visible_webhooks(self.queryset.all())

    @extend_schema(
        operation_id="webhooks_list",
        summary="List webhooks, newest first (staff)",
        parameters=[s.TaskListPageSerializer],
        responses={200: s.WebhookPageSerializer, **ERRORS_400, **ERRORS_403_WEBHOOKS},
    )
    def list(self, request: Request) -> Response:
        page = self.query(s.TaskListPageSerializer)
        results, next_url = keyset_page(
            request,
            self.get_queryset(),
            limit=page["limit"],
            before=page.get("before"),
            render=lambda webhook: s.render(s.WebhookSerializer, webhook),
        )
        return Response({"results": results, "next": next_url})

    @extend_schema(
        summary="Add a webhook (staff)",
        description=(
            "Every later event of the given types, in the given queues, is POSTed to the URL "
            'as `{"event": Event, "task": Task}` (or a Slack `{"text": ...}`), with the '
            "headers `Taskboard-Event-Id` and `Taskboard-Signature: t=<unix seconds>,"
            'v1=<hex HMAC-SHA256(secret, "<t>.<raw body>")>`, at least once: retried with '
            "backoff for 24 hours. The secret is shown only in this response."
        ),
        request=s.WebhookCreateSerializer,
        responses={201: s.WebhookCreatedSerializer, **ERRORS_400, **ERRORS_403_WEBHOOKS},
    )
    def create(self, request: Request) -> Response:
        data = self.validated(s.WebhookCreateSerializer)
        if self.access.limited:
            # As a limited claim does: no queues means its own; another's is refused.
            if data.get("queues"):
                self.access.check(*data["queues"])
            else:
                data["queues"] = sorted(self.access.queues or ())
        # 256 random bits, as a receiver's key for HMAC-SHA256 should have.
        data["secret"] = data.get("secret") or secrets.token_hex(32)
        webhook = deliveries.create_webhook(actor=request.user, **data)
        return Response(s.WebhookCreatedSerializer(webhook).data, status=status.HTTP_201_CREATED)

    @extend_schema(
        summary="Remove a webhook and its deliveries (staff)",
        responses={204: None, **ERRORS_403_WEBHOOKS, **ERRORS_404_WEBHOOK},
    )
    def destroy(self, request: Request, pk: str) -> Response:
        self.get_object()  # 404 for one this user may not see
        if not deliveries.delete_webhook(webhook_id=int(pk), actor=request.user):
            raise exceptions.NotFound("No such webhook.")
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(
        operation_id="webhooks_deliveries_list",
        summary="A webhook's deliveries, newest first (staff)",
        description=(
            "Each: the event, how many attempts were made, the last status code or error, "
            "when the next attempt is due (pending) and when it was delivered."
        ),
        parameters=[s.TaskListPageSerializer],
        responses={
            200: s.DeliveryPageSerializer,
            **ERRORS_400,
            **ERRORS_403_WEBHOOKS,
            **ERRORS_404_WEBHOOK,
        },
    )
    @action(detail=True, methods=["get"])
    def deliveries(self, request: Request, pk: str) -> Response:
        webhook = self.get_object()
        page = self.query(s.TaskListPageSerializer)
        results, next_url = keyset_page(
            request,
            Delivery.objects.filter(webhook=webhook),
            limit=page["limit"],
            before=page.get("before"),
            render=lambda delivery: s.render(s.DeliverySerializer, delivery),
        )
        return Response({"results": results, "next": next_url})
