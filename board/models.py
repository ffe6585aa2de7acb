"""Tasks and their append-only event log.

Only ``board.transitions`` writes these tables. The database enforces the rest: status and
range checks here, and in the migrations the insert-only trigger on ``task_events``, the
NOTIFY of each new event and the partial indexes the claim query runs on.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models
from django.db.models.functions import Now
from django.urls import reverse

QUEUE_PATTERN = r"^[a-z0-9_-]{1,64}\Z"
queue_validator = RegexValidator(
    QUEUE_PATTERN, "Queue names are 1 to 64 characters of a-z, 0-9, '_' and '-'."
)


class TaskStatus(models.TextChoices):
    PENDING = "pending"
    IN_PROGRESS = "in_progress"
    DONE = "done"
    ESCALATED = "escalated"
    CANCELLED = "cancelled"
    AWAITING_INPUT = "awaiting_input"


class EventType(models.TextChoices):
    CREATED = "created"
    CLAIMED = "claimed"
    HEARTBEAT = "heartbeat"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    RELEASED = "released"
    ESCALATED = "escalated"
    REQUEUED = "requeued"
    RESOLVED = "resolved"
    CANCELLED = "cancelled"
    COMMENTED = "commented"
    UNBLOCKED = "unblocked"
    ASKED = "asked"
    ANSWERED = "answered"


MAX_ATTEMPT_SECONDS = 604800
MAX_DEPENDENCIES = 100
MAX_REQUIRES = 20
LABEL_PATTERN = r"^[a-z0-9][a-z0-9:._-]{0,63}\Z"
label_validator = RegexValidator(
    LABEL_PATTERN,
    "Labels are 1 to 64 characters of a-z, 0-9, ':', '.', '_' and '-', starting with a-z or 0-9.",
)


class TaskQuerySet(models.QuerySet["Task"]):
    def open(self) -> TaskQuerySet:
        """Return tasks that still need someone: pending or in progress."""
        return self.filter(status__in=[TaskStatus.PENDING, TaskStatus.IN_PROGRESS])

    def escalated(self) -> TaskQuerySet:
        return self.filter(status=TaskStatus.ESCALATED)

    def blocked(self, blocked: bool = True) -> TaskQuerySet:
        """Pending tasks with a dependency that is not done (or, False, all the others)."""
        condition = models.Q(status=TaskStatus.PENDING, open_dependencies__gt=0)
        return self.filter(condition) if blocked else self.exclude(condition)


class Task(models.Model):
    title = models.CharField(max_length=200)
    description = models.TextField(blank=True, default="")
    payload = models.JSONField(default=dict, blank=True)
    queue = models.CharField(max_length=64, default="default", validators=[queue_validator])
    priority = models.IntegerField(
        default=0, validators=[MinValueValidator(-1000), MaxValueValidator(1000)]
    )
    max_failures = models.PositiveSmallIntegerField(
        default=3, validators=[MinValueValidator(1), MaxValueValidator(100)]
    )
    run_after = models.DateTimeField(null=True, blank=True)
    status = models.CharField(max_length=16, choices=TaskStatus.choices, default=TaskStatus.PENDING)
    failure_count = models.PositiveSmallIntegerField(default=0)
    # Holder and creator are stored as usernames (a real foreign key to auth_user.username),
    # so the guards and the API read them without a join.
    # Indexed partially (only leased rows) in migration 0002: a full index here would take
    # a new entry from every transition of every task.
    leased_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        to_field="username",
        db_column="leased_by",
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="+",
        db_index=False,
    )
    leased_until = models.DateTimeField(null=True, blank=True)
    # Secret of the current holder; never serialized on a Task, only in a claim response.
    lease_token = models.UUIDField(null=True, blank=True, editable=False)
    # The lease length asked for at claim time: what a heartbeat extends by default.
    lease_seconds = models.PositiveIntegerField(null=True, blank=True, editable=False)
    result = models.JSONField(null=True, blank=True)
    last_error = models.TextField(null=True, blank=True)  # noqa: DJ001 (the contract has null)
    # Not indexed: nothing reads tasks by creator (deleting a user, which is rare, scans
    # tasks), and every transition of every task would pay for the index.
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        to_field="username",
        db_column="created_by",
        on_delete=models.PROTECT,
        related_name="+",
        db_index=False,
    )
    created_at = models.DateTimeField(db_default=Now())
    updated_at = models.DateTimeField(db_default=Now())

    # -- Work graphs (contract: "Additions to v1") --
    # The dependencies as given on create (ids of older tasks), kept on the row so that a
    # task reads without a join; task_dependencies holds the same edges with foreign keys,
    # indexed for the way back (which tasks wait for this one).
    depends_on = ArrayField(models.BigIntegerField(), default=list, db_default=[], blank=True)
    # How many of depends_on are not done: the task is blocked while it is pending and this
    # is above zero. The claim's partial indexes hold only rows where it is zero, so blocked
    # tasks cost a claim nothing. Kept by board.transitions (create, complete, resolve,
    # requeue).
    open_dependencies = models.PositiveIntegerField(default=0, db_default=0, editable=False)
    # Set (for good) by the create of a task that depends on this one, in the statement
    # that locks this row: the complete (or resolve) that makes this task done reads it in
    # its own row and runs the statement that unblocks dependents only when it is set.
    has_dependents = models.BooleanField(default=False, db_default=False, editable=False)
    # Indexed partially in migration 0008 (children are listed by parent; few tasks have one).
    parent = models.ForeignKey(
        "self",
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="children",
        db_index=False,
    )
    # The latest progress a heartbeat reported; survives a lost lease, release and fail.
    progress = models.JSONField(null=True, blank=True)
    max_attempt_seconds = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1), MaxValueValidator(MAX_ATTEMPT_SECONDS)],
    )
    attempt_started_at = models.DateTimeField(null=True, blank=True, editable=False)

    # -- Humans in the loop (contract: "Additions to v1 (second round)") --
    # Only this user may claim the task (a username; null: anyone). Claims of other users
    # never see it: the claim's open indexes hold only unassigned tasks without requires.
    assignee = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        to_field="username",
        db_column="assignee",
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="+",
        db_index=False,
    )
    # Labels the claimant's capabilities must include (board.models.Capabilities).
    requires = ArrayField(
        models.CharField(max_length=64, validators=[label_validator]),
        default=list,
        db_default=[],
        blank=True,
        size=MAX_REQUIRES,
    )
    # The open question while awaiting input (what GET shows as ``question``), with the
    # id of its ``asked`` event; null otherwise. Written by the ``ask`` statement, which
    # writes the event with the same id, so the task reads without a join.
    question = models.JSONField(null=True, blank=True, editable=False)
    # When an unanswered question escalates: set exactly while awaiting input.
    answer_by = models.DateTimeField(null=True, blank=True, editable=False)
    # Every answered question, oldest first, each with its answer.
    answers = models.JSONField(default=list, db_default=[], blank=True, editable=False)
    # After an answer, only held_for (the asker) may claim the task until held_until.
    held_for = models.CharField(  # noqa: DJ001 (a username or none)
        max_length=150, null=True, blank=True, editable=False
    )
    held_until = models.DateTimeField(null=True, blank=True, editable=False)

    # Unique per creator (a partial unique index): a create that repeats a key creates
    # nothing. The fingerprint is a SHA-256 of the create's validated body, to tell a retry
    # (same body) from a conflict (another body).
    idempotency_key = models.CharField(  # noqa: DJ001 (the contract has null)
        max_length=255, null=True, blank=True, editable=False
    )
    idempotency_fingerprint = models.CharField(  # noqa: DJ001
        max_length=64, null=True, blank=True, editable=False
    )

    objects = TaskQuerySet.as_manager()

    class Meta:
        db_table = "tasks"
        ordering = ["-id"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(status__in=TaskStatus.values), name="tasks_status_valid"
            ),
            models.CheckConstraint(
                condition=models.Q(priority__gte=-1000, priority__lte=1000),
                name="tasks_priority_range",
            ),
            models.CheckConstraint(
                condition=models.Q(max_failures__gte=1, max_failures__lte=100),
                name="tasks_max_failures_range",
            ),
            models.CheckConstraint(
                condition=models.Q(queue__regex=QUEUE_PATTERN.replace(r"\Z", "$")),
                name="tasks_queue_format",
            ),
            # A task is in progress exactly when it has a holder, a token and a deadline.
            models.CheckConstraint(
                condition=(
                    models.Q(
                        status=TaskStatus.IN_PROGRESS,
                        leased_by__isnull=False,
                        lease_token__isnull=False,
                        leased_until__isnull=False,
                    )
                    | (
                        ~models.Q(status=TaskStatus.IN_PROGRESS)
                        & models.Q(
                            leased_by__isnull=True,
                            lease_token__isnull=True,
                            leased_until__isnull=True,
                        )
                    )
                ),
                name="tasks_lease_iff_in_progress",
            ),
            # A task awaits input exactly when it has an open question and its deadline.
            models.CheckConstraint(
                condition=(
                    models.Q(
                        status=TaskStatus.AWAITING_INPUT,
                        question__isnull=False,
                        answer_by__isnull=False,
                    )
                    | (
                        ~models.Q(status=TaskStatus.AWAITING_INPUT)
                        & models.Q(question__isnull=True, answer_by__isnull=True)
                    )
                ),
                name="tasks_question_iff_awaiting_input",
            ),
            models.CheckConstraint(
                condition=models.Q(max_attempt_seconds__gte=1)
                & models.Q(max_attempt_seconds__lte=MAX_ATTEMPT_SECONDS),
                name="tasks_max_attempt_seconds_range",
            ),
            models.CheckConstraint(
                condition=models.Q(parent__lt=models.F("id")), name="tasks_parent_is_older"
            ),
            models.UniqueConstraint(
                fields=["created_by", "idempotency_key"],
                condition=models.Q(idempotency_key__isnull=False),
                name="tasks_idempotency_key_unique",
            ),
        ]
        # The claim's partial indexes are created in migrations with raw SQL (0002, 0008,
        # 0020).
        permissions = [("answer_task", "Can answer the questions agents ask")]

    def __str__(self) -> str:
        return f"#{self.pk} {self.title}"

    def get_absolute_url(self) -> str:
        return reverse("board:task", args=[self.pk])  # the admin's "View on site"

    @property
    def blocked(self) -> bool:
        """Pending with a dependency that is not done: not claimable."""
        return self.status == TaskStatus.PENDING and self.open_dependencies > 0

    @property
    def attempt_deadline(self) -> datetime | None:
        """When the current attempt must end, however often its holder heartbeats."""
        if self.attempt_started_at is None or self.max_attempt_seconds is None:
            return None
        return self.attempt_started_at + timedelta(seconds=self.max_attempt_seconds)


class TaskDependency(models.Model):
    """An edge of the work graph: ``task`` may be claimed once ``depends_on`` is done.

    A dependency is always an older task (a smaller id), so the graph has no cycles.
    """

    id = models.BigAutoField(primary_key=True)
    task = models.ForeignKey(
        Task, on_delete=models.PROTECT, related_name="dependencies", db_index=False
    )
    depends_on = models.ForeignKey(Task, on_delete=models.PROTECT, related_name="dependents")

    class Meta:
        db_table = "task_dependencies"
        constraints = [
            models.UniqueConstraint(fields=["task", "depends_on"], name="task_dependencies_unique"),
            models.CheckConstraint(
                condition=models.Q(depends_on__lt=models.F("task")),
                name="task_dependencies_older",
            ),
        ]

    def __str__(self) -> str:
        return f"task {self.task_id} after {self.depends_on_id}"


class TaskEvent(models.Model):
    # Ids come from a sequence, so they increase in insertion order (not commit order).
    # The table is partitioned by month of created_at (migration 0011): the database's
    # primary key is (id, created_at), as PostgreSQL requires of a partitioned table, and id
    # alone stays unique because only the one sequence hands ids out (board.ops.archive).
    id = models.BigAutoField(primary_key=True)
    # Indexed together with id below (the per-task timeline), not on its own.
    task = models.ForeignKey(Task, on_delete=models.PROTECT, related_name="events", db_index=False)
    type = models.CharField(max_length=16, choices=EventType.choices)
    status = models.CharField(max_length=16, choices=TaskStatus.choices)
    actor = models.CharField(max_length=150)
    payload = models.JSONField(default=dict)
    created_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "task_events"
        ordering = ["id"]
        indexes = [models.Index(fields=["task", "id"], name="task_events_task_id_idx")]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(type__in=EventType.values), name="task_events_type_valid"
            ),
        ]

    def __str__(self) -> str:
        return f"event {self.pk}: task {self.task_id} {self.type}"


class QueueLimit(models.Model):
    """The queues one user (an agent) is limited to; see board.access.

    A user without a row may use every queue. The limit is never empty: clearing it means
    deleting the row, which gives the user every queue again.
    """

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL,
        on_delete=models.CASCADE,
        primary_key=True,
        related_name="queue_limit",
    )
    queues = ArrayField(
        models.CharField(max_length=64, validators=[queue_validator]),
        help_text="Comma-separated queue names. The user sees and works only these queues.",
    )

    class Meta:
        db_table = "queue_limits"
        verbose_name = "queue limit"
        constraints = [
            models.CheckConstraint(
                condition=models.Q(queues__len__gt=0), name="queue_limits_not_empty"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.user_id}: {', '.join(self.queues)}"

    def clean(self) -> None:
        # One spelling for each limit: sorted, without duplicates.
        self.queues = sorted(set(self.queues))


class Capabilities(models.Model):
    """The labels one user (an agent, or a person) offers: a claim takes a task only when
    the task's ``requires`` are among them. A user without a row has none."""

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL,
        on_delete=models.CASCADE,
        primary_key=True,
        related_name="capabilities",
    )
    labels = ArrayField(
        models.CharField(max_length=64, validators=[label_validator]),
        default=list,
        blank=True,
        help_text="Comma-separated labels, e.g. gpu,python.",
    )

    class Meta:
        db_table = "user_capabilities"
        verbose_name = "capabilities"
        verbose_name_plural = "capabilities"

    def __str__(self) -> str:
        return f"{self.user_id}: {', '.join(self.labels)}"

    def clean(self) -> None:
        self.labels = sorted(set(self.labels))


class QueueState(models.Model):
    """Whether a queue is paused, as of its last pause or resume (board.transitions)."""

    name = models.CharField(max_length=64, primary_key=True, validators=[queue_validator])
    paused = models.BooleanField(default=False)
    changed_at = models.DateTimeField(db_default=Now())
    changed_by = models.CharField(max_length=150)
    note = models.TextField(blank=True, default="")

    class Meta:
        db_table = "queue_states"
        verbose_name = "queue"

    def __str__(self) -> str:
        return f"{self.name} ({'paused' if self.paused else 'running'})"


class QueuePause(models.Model):
    """One pause or resume of a queue: who, when and why. Only ever inserted."""

    id = models.BigAutoField(primary_key=True)
    queue = models.CharField(max_length=64)
    paused = models.BooleanField()
    actor = models.CharField(max_length=150)
    note = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "queue_pauses"
        ordering = ["-id"]
        verbose_name = "queue pause or resume"
        verbose_name_plural = "queue pauses and resumes"
        indexes = [models.Index(fields=["queue", "id"], name="queue_pauses_queue_idx")]

    def __str__(self) -> str:
        return f"{self.queue} {'paused' if self.paused else 'resumed'} by {self.actor}"


class QueueCounter(models.Model):
    """One shard of a queue's task counts by status (blocked apart from pending).

    Written only by the statement triggers of board/sql/schema/counters.sql, from every
    statement that inserts or updates tasks; read by board.queues, which sums the shards. A
    transaction adds its changes to a shard row that no other transaction holds (SKIP
    LOCKED), or to a new one, so concurrent transitions on one queue never wait for each
    other here.
    """

    id = models.BigAutoField(primary_key=True)
    queue = models.CharField(max_length=64)
    shard = models.IntegerField()
    pending = models.BigIntegerField(default=0)
    blocked = models.BigIntegerField(default=0)
    in_progress = models.BigIntegerField(default=0)
    escalated = models.BigIntegerField(default=0)
    done = models.BigIntegerField(default=0)
    cancelled = models.BigIntegerField(default=0)
    awaiting_input = models.BigIntegerField(default=0, db_default=0)

    class Meta:
        db_table = "queue_counters"
        constraints = [
            models.UniqueConstraint(fields=["queue", "shard"], name="queue_counters_shard")
        ]

    def __str__(self) -> str:
        return f"{self.queue}/{self.shard}"


class AgentActivity(models.Model):
    """One shard of an agent's activity in one hour: when it was last seen, and what its
    leases came to. Written only by the statement trigger on task_events (schema/counters.sql),
    sharded like QueueCounter so that one agent's parallel workers never wait for each
    other; read by board.queues.agent_list."""

    id = models.BigAutoField(primary_key=True)
    agent = models.CharField(max_length=150)
    hour = models.DateTimeField()
    shard = models.IntegerField()
    last_seen_at = models.DateTimeField(null=True)
    completed = models.BigIntegerField(default=0)
    failed = models.BigIntegerField(default=0)
    expired = models.BigIntegerField(default=0)

    class Meta:
        db_table = "agent_activity"
        verbose_name_plural = "agent activity"
        constraints = [
            models.UniqueConstraint(fields=["agent", "hour", "shard"], name="agent_activity_shard")
        ]
        indexes = [models.Index(fields=["hour"], name="agent_activity_hour_idx")]

    def __str__(self) -> str:
        return f"{self.agent} {self.hour:%Y-%m-%d %H}h/{self.shard}"


class WebhookKind(models.TextChoices):
    WEBHOOK = "webhook"
    # The one row that stands for EMAIL_URL's escalation emails (board.notifications.deliveries).
    EMAIL = "email"


class WebhookFormat(models.TextChoices):
    JSON = "json"
    SLACK = "slack"


class DeliveryStatus(models.TextChoices):
    PENDING = "pending"
    DELIVERED = "delivered"
    FAILED = "failed"


class Webhook(models.Model):
    """Where to tell humans about events: a URL (kind webhook), or the escalation emails
    (kind email, one row, active while EMAIL_URL is set). Written by board.transitions.

    Every statement that inserts task_events makes a delivery per matching active row, in
    the same transaction (the trigger of board/sql/schema/deliveries.sql): the event's type is in
    ``events`` and its task's queue in ``queues`` (null: every queue).
    """

    id = models.BigAutoField(primary_key=True)
    kind = models.CharField(max_length=16, choices=WebhookKind.choices, default="webhook")
    url = models.URLField(max_length=2000, blank=True, default="")
    events = ArrayField(models.CharField(max_length=32, choices=EventType.choices))
    queues = ArrayField(models.CharField(max_length=64), null=True, blank=True)
    secret = models.CharField(max_length=200, blank=True, default="")
    format = models.CharField(max_length=16, choices=WebhookFormat.choices, default="json")
    active = models.BooleanField(default=True)
    created_by = models.CharField(max_length=150)
    created_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "webhooks"
        constraints = [
            models.UniqueConstraint(
                fields=["kind"], condition=models.Q(kind="email"), name="webhooks_one_email"
            )
        ]

    def __str__(self) -> str:
        return "escalation emails" if self.kind == WebhookKind.EMAIL else self.url


class Delivery(models.Model):
    """One event to send through one webhook (or by email), or one password reset email
    (``recipient``, through the email row), delivered at least once.

    Claimed by the server processes like a task (board.notifications.deliveries): FOR UPDATE
    SKIP LOCKED, then a lease (``leased_until`` and ``lease_token``) that a killed process
    leaves to run out; the outcome is recorded only under the token. ``next_attempt_at`` is
    when it is due: the next retry, or while leased, the end of the lease. Retried with
    backoff until ``armed_at`` + TASKBOARD_DELIVERY_HORIZON_SECONDS, then failed; a staff
    retry re-arms it.
    """

    id = models.BigAutoField(primary_key=True)
    webhook = models.ForeignKey(Webhook, on_delete=models.CASCADE, related_name="deliveries")
    # No foreign keys to the task or the event: the event log may be archived.
    # Both null for a password reset email.
    event_id = models.BigIntegerField(null=True, blank=True)
    task_id = models.BigIntegerField(null=True, blank=True)
    # A password reset email: the address that was given. Its accounts are looked up, and
    # their links made, when it is sent, so that the request that asked did the same work
    # whether or not the address has an account (board.notifications.deliveries).
    recipient = models.EmailField(max_length=254, null=True, blank=True)  # noqa: DJ001
    status = models.CharField(max_length=16, choices=DeliveryStatus.choices, default="pending")
    attempts = models.IntegerField(default=0)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    leased_until = models.DateTimeField(null=True, blank=True)
    lease_token = models.UUIDField(null=True, blank=True)
    last_status_code = models.IntegerField(null=True, blank=True)
    last_error = models.TextField(null=True, blank=True)  # noqa: DJ001 (the API shows null: no error)
    delivered_at = models.DateTimeField(null=True, blank=True)
    armed_at = models.DateTimeField(db_default=Now())
    created_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "webhook_deliveries"
        verbose_name_plural = "deliveries"
        constraints = [
            models.UniqueConstraint(fields=["webhook", "event_id"], name="deliveries_once"),
            models.CheckConstraint(
                condition=(
                    models.Q(event_id__isnull=False, task_id__isnull=False, recipient__isnull=True)
                    | models.Q(event_id__isnull=True, task_id__isnull=True, recipient__isnull=False)
                ),
                name="deliveries_of_an_event_or_a_reset",
            ),
        ]
        indexes = [
            # The claim and the dispatcher's next wake-up read only pending rows, in due order.
            models.Index(
                fields=["next_attempt_at"],
                condition=models.Q(status="pending"),
                name="deliveries_due_idx",
            ),
        ]

    def __str__(self) -> str:
        if self.recipient is not None:
            return f"password reset to {self.recipient}"
        return f"event {self.event_id} to {self.webhook}"


class DeliveryResult(models.Model):
    """How many delivery attempts came to each result (delivered, retried, failed), kept by
    the statements that record them (board.transitions), for the metrics endpoint: a few
    rows, however many deliveries the table holds."""

    result = models.CharField(max_length=16, primary_key=True)
    count = models.BigIntegerField(default=0)

    class Meta:
        db_table = "delivery_results"

    def __str__(self) -> str:
        return f"{self.result}: {self.count}"


class EventCounter(models.Model):
    """One shard of how many events of one type were ever written: the counter behind
    ``taskboard_events_total`` on ``/metrics`` (board.ops.metrics).

    Written only by the statement trigger on task_events (schema/counters.sql), sharded like
    QueueCounter so that concurrent transitions never wait for each other here; read by
    board.ops.metrics, which sums the shards. Kept by the database rather than counted by each
    server process, so that every process of ``serve --workers N`` (one scrape reaches
    one of them) and every restart answers the same, monotonic figure.
    """

    id = models.BigAutoField(primary_key=True)
    type = models.CharField(max_length=20)
    shard = models.IntegerField()
    count = models.BigIntegerField(default=0)

    class Meta:
        db_table = "event_counters"
        constraints = [
            models.UniqueConstraint(fields=["type", "shard"], name="event_counters_shard")
        ]

    def __str__(self) -> str:
        return f"{self.type}/{self.shard}"
