"""What the API reads and writes. Input and output serializers are separate: inputs only
validate (the transitions module decides), outputs only render."""

from __future__ import annotations

import re
from typing import Any

from django.contrib.auth import get_user_model
from django.core.validators import RegexValidator
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from rest_framework import serializers

from board import conf
from board.models import (
    LABEL_PATTERN,
    MAX_ATTEMPT_SECONDS,
    MAX_DEPENDENCIES,
    MAX_REQUIRES,
    QUEUE_PATTERN,
    Delivery,
    DeliveryStatus,
    EventType,
    Task,
    TaskEvent,
    TaskStatus,
    Webhook,
    WebhookFormat,
)
from board.notifications import webhook_addresses
from board.questions import MAX_OPTION, MAX_OPTIONS, MAX_QUESTION, schema_problem

# The text rules, written once as JSON Schema patterns (ECMA-262 syntax, which Python's
# ``re`` reads the same way) so that the OpenAPI document states exactly what is refused.
# PostgreSQL cannot store NUL (U+0000) in text or jsonb.
NUL_FREE_PATTERN = "^[^\\u0000]*$"
# What Python's ``str.isspace`` calls whitespace, spelled out for other regex engines.
WHITESPACE = (
    "\\t\\n\\u000b\\f\\r\\u001c-\\u001f \\u0085\\u00a0\\u1680\\u2000-\\u200a"
    "\\u2028\\u2029\\u202f\\u205f\\u3000"
)
# Text that says something: NUL-free, with at least one character that is not whitespace.
VISIBLE_PATTERN = f"^[^\\u0000]*[^\\u0000{WHITESPACE}][^\\u0000]*$"
# An RFC 3339 time with its UTC offset, as the contract asks, on a day that exists, in the
# years Python's datetime holds on both sides of UTC (0002..9998: a time in year 1 or 9999
# may fall outside them once converted to UTC).
_YEAR = (
    "(?:000[2-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-8][0-9]{3}|9[0-8][0-9]{2}|99[0-8][0-9]|999[0-8])"
)
_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = (
    f"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
    "|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))"
    f"|{_LEAP_YEAR}-02-29)"
)
_TIME = "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]{1,9})?"
_OFFSET = "(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
TIME_PATTERN = f"^{_DATE}T{_TIME}{_OFFSET}$"
NUL_MESSAGE = "Null characters (\\u0000) are not allowed."
BLANK_MESSAGE = "This field may not be blank."


def storable_text_error(text: str) -> str | None:
    """Say why PostgreSQL cannot store ``text``, or return None if it can."""
    if "\x00" in text:
        return NUL_MESSAGE
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "Unpaired surrogates are not valid Unicode."
    return None


# Arrays and objects nested deeper than this are refused: Python's json reads about 900
# levels in a request but writes fewer from deeper in the stack (psycopg dumping the
# payload in a transition failed at 940 with RecursionError, a 500). Real payloads nest a
# few levels; this leaves every reader and writer a wide margin.
MAX_JSON_DEPTH = 100


def storable_json_error(value: Any) -> str | None:
    """Say why jsonb cannot store ``value`` (walked without recursion), or return None."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if error := storable_text_error(item):
                return error
        elif isinstance(item, dict | list):
            if depth == MAX_JSON_DEPTH:
                return f"Arrays and objects may nest at most {MAX_JSON_DEPTH} levels deep."
            if isinstance(item, dict):
                stack.extend((key, depth + 1) for key in item)
                stack.extend((child, depth + 1) for child in item.values())
            else:
                stack.extend((child, depth + 1) for child in item)
    return None


class StrictCharField(serializers.CharField):
    """A string field that refuses numbers and booleans instead of coercing them, and text
    that PostgreSQL cannot store; ``visible=True`` refuses text that is only whitespace.
    board.api.schema documents the rule as VISIBLE_PATTERN or NUL_FREE_PATTERN.

    Text is trimmed only where asked (``trim_whitespace=True``), and its length is counted
    as sent, before trimming, as the schema's maxLength counts it.
    """

    default_error_messages = {"invalid": "Must be a string.", "blank": BLANK_MESSAGE}

    def __init__(self, *, visible: bool = False, **kwargs: Any) -> None:
        kwargs.setdefault("trim_whitespace", False)
        super().__init__(**kwargs)
        self.visible = visible

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        if error := storable_text_error(data):
            raise serializers.ValidationError(error)
        if self.visible and data and data.isspace():
            self.fail("blank")
        if self.max_length is not None and len(data) > self.max_length:
            self.fail("max_length", max_length=self.max_length)
        return super().to_internal_value(data)


class StrictRegexField(StrictCharField):
    def __init__(self, regex: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.validators.append(RegexValidator(regex, message=self.error_messages["invalid"]))


class StorableJSONField(serializers.JSONField):
    """Any JSON value that jsonb can store (board.api.schema: the JSONValue schema)."""

    def to_internal_value(self, data: Any) -> Any:
        if error := storable_json_error(data):
            raise serializers.ValidationError(error)
        return super().to_internal_value(data)


class StrictIntegerField(serializers.IntegerField):
    """An integer field that refuses strings, booleans and fractions.

    A number with no fraction (``5.0``) is an integer, as JSON Schema counts them.
    """

    default_error_messages = {"invalid": "Must be an integer."}

    def to_internal_value(self, data: Any) -> int:
        if isinstance(data, float) and data.is_integer():
            data = int(data)
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictFloatField(serializers.FloatField):
    """A number field that refuses strings and booleans."""

    default_error_messages = {"invalid": "Must be a number."}

    def to_internal_value(self, data: Any) -> float:
        if isinstance(data, bool) or not isinstance(data, int | float):
            self.fail("invalid")
        return super().to_internal_value(data)


class TimeField(serializers.DateTimeField):
    """A time in RFC 3339 with a UTC offset (TIME_PATTERN): DRF's DateTimeField alone
    also reads times without an offset, or with a space for the ``T``."""

    default_error_messages = {
        "invalid": "Use an RFC 3339 time with a UTC offset: YYYY-MM-DDThh:mm:ss[.f](Z|+hh:mm).",
    }

    def to_internal_value(self, value: Any) -> Any:
        if not isinstance(value, str) or not TIME_TEXT.fullmatch(value):
            self.fail("invalid")
        return super().to_internal_value(value)


TIME_TEXT = re.compile(TIME_PATTERN)


class QueryIntegerField(serializers.IntegerField):
    """A query parameter that is an integer written in decimal digits, and nothing else:
    DRF's IntegerField also reads ``5.0``, `` 5``, ``+5`` and ``1_000``."""

    default_error_messages = {"invalid": "Must be an integer."}

    def to_internal_value(self, data: Any) -> int:
        if not isinstance(data, str) or not INTEGER_TEXT.fullmatch(data):
            self.fail("invalid")
        return super().to_internal_value(data)


INTEGER_TEXT = re.compile(r"-?[0-9]+")


class JSONObjectField(StorableJSONField):
    """A JSON object (a dict), not any JSON value (board.api.schema: JSONObject)."""

    default_error_messages = {"not_an_object": "Must be a JSON object."}

    def to_internal_value(self, data: Any) -> dict[str, Any]:
        if not isinstance(data, dict):
            self.fail("not_an_object")
        return dict(super().to_internal_value(data))


class AnyJSONField(StorableJSONField):
    """Any JSON value, null included.

    null is one of the values, not an absence: the field takes it without ``allow_null``,
    which would document it a second time beside the JSONValue schema.
    """

    def validate_empty_values(self, data: Any) -> tuple[bool, Any]:
        if data is None:
            return True, None
        return super().validate_empty_values(data)


class UniqueListField(serializers.ListField):
    """A list in which no item appears twice (board.api.schema: ``uniqueItems``)."""

    default_error_messages = {"duplicates": "List each item once."}

    def to_internal_value(self, data: Any) -> list[Any]:
        items = list(super().to_internal_value(data))
        if len(set(items)) != len(items):
            self.fail("duplicates")
        return items


def queue_field(**kwargs: Any) -> StrictRegexField:
    return StrictRegexField(
        QUEUE_PATTERN,
        max_length=64,
        error_messages={"invalid": "Use 1 to 64 characters of a-z, 0-9, '_' and '-'."},
        **kwargs,
    )


def task_id_field(**kwargs: Any) -> StrictIntegerField:
    return StrictIntegerField(min_value=1, max_value=2**63 - 1, **kwargs)


def username_field(**kwargs: Any) -> StrictCharField:
    return StrictCharField(min_length=1, max_length=150, **kwargs)


def label_field() -> StrictRegexField:
    return StrictRegexField(
        LABEL_PATTERN,
        max_length=64,
        error_messages={
            "invalid": "Use 1 to 64 characters of a-z, 0-9, ':', '.', '_' and '-', "
            "starting with a-z or 0-9."
        },
    )


def lease_token_field() -> StrictCharField:
    return StrictCharField(max_length=100, help_text="The lease_token from the claim response.")


def lease_seconds_field(**kwargs: Any) -> StrictIntegerField:
    return StrictIntegerField(min_value=1, max_value=conf.MAX_LEASE_SECONDS, **kwargs)


# -- Output -----------------------------------------------------------------------------


class StoredTimeField(serializers.DateTimeField):
    """A time kept inside JSON (as PostgreSQL writes it), shown as every other time is."""

    def to_representation(self, value: Any) -> Any:
        if isinstance(value, str):
            value = parse_datetime(value) or value
        return super().to_representation(value)


class QuestionSerializer(serializers.Serializer[Any]):
    event_id = serializers.IntegerField(help_text="The id of the `asked` event.")
    question = serializers.CharField()
    options = serializers.ListField(
        child=serializers.CharField(),
        allow_null=True,
        help_text="The answer must be one of these, when given.",
    )
    answer_schema = serializers.DictField(
        allow_null=True, help_text="A JSON Schema the answer must validate against, when given."
    )
    assignee = serializers.CharField(
        allow_null=True, help_text="The user asked to answer (anyone allowed may)."
    )
    answer_by = StoredTimeField(help_text="When the task is escalated if nobody answered.")
    action_digest = serializers.CharField(
        allow_null=True, help_text="What exactly is to be approved (e.g. a SHA-256)."
    )
    asked_by = serializers.CharField()
    asked_at = StoredTimeField()


class AnsweredQuestionSerializer(QuestionSerializer):
    answer = AnyJSONField()
    note = serializers.CharField(allow_null=True)
    answered_by = serializers.CharField()
    answered_at = StoredTimeField()


class TaskSerializer(serializers.ModelSerializer[Task]):
    leased_by = serializers.CharField(source="leased_by_id", allow_null=True, read_only=True)
    created_by = serializers.CharField(source="created_by_id", read_only=True)
    lease_expired = serializers.SerializerMethodField()
    payload = JSONObjectField()
    result = AnyJSONField()
    depends_on = serializers.ListField(
        child=serializers.IntegerField(),
        read_only=True,
        help_text="The tasks this one waits for (set on create).",
    )
    blocked = serializers.BooleanField(
        read_only=True, help_text="Pending, with a dependency that is not done: not claimable."
    )
    parent_id = serializers.IntegerField(
        allow_null=True, read_only=True, help_text="The task this one is a subtask of."
    )
    progress = AnyJSONField(
        help_text="The latest progress a heartbeat reported; kept across attempts."
    )
    max_attempt_seconds = serializers.IntegerField(
        allow_null=True,
        read_only=True,
        help_text="How long one attempt may hold the task, however often it heartbeats.",
    )
    attempt_started_at = serializers.DateTimeField(
        allow_null=True, read_only=True, help_text="When the current holder claimed it."
    )
    idempotency_key = serializers.CharField(
        allow_null=True, read_only=True, help_text="The Idempotency-Key it was created with."
    )
    assignee = serializers.CharField(
        source="assignee_id",
        allow_null=True,
        read_only=True,
        help_text="Only this user may claim the task; null: anyone.",
    )
    requires = serializers.ListField(
        child=serializers.CharField(),
        read_only=True,
        help_text="Labels the claimant's capabilities must include.",
    )
    question = QuestionSerializer(
        allow_null=True, read_only=True, help_text="The open question, while awaiting input."
    )
    answers = AnsweredQuestionSerializer(
        many=True, read_only=True, help_text="Every answered question, oldest first."
    )

    class Meta:
        model = Task
        fields = [
            "id",
            "title",
            "description",
            "payload",
            "queue",
            "priority",
            "max_failures",
            "run_after",
            "status",
            "failure_count",
            "leased_by",
            "leased_until",
            "lease_expired",
            "result",
            "last_error",
            "created_by",
            "created_at",
            "updated_at",
            "depends_on",
            "blocked",
            "parent_id",
            "progress",
            "max_attempt_seconds",
            "attempt_started_at",
            "idempotency_key",
            "assignee",
            "requires",
            "question",
            "answers",
        ]
        read_only_fields = fields

    def get_lease_expired(self, task: Task) -> bool:
        """True when the task is in progress and its lease has run out."""
        return (
            task.status == TaskStatus.IN_PROGRESS
            and task.leased_until is not None
            and task.leased_until <= timezone.now()
        )


class ClaimedTaskSerializer(TaskSerializer):
    lease_token = serializers.CharField(
        read_only=True, help_text="The secret to present on heartbeat, complete, fail, ..."
    )

    class Meta(TaskSerializer.Meta):
        fields = [*TaskSerializer.Meta.fields, "lease_token"]
        read_only_fields = fields


class ClaimResponseSerializer(serializers.Serializer[Any]):
    tasks = ClaimedTaskSerializer(many=True)


class EventSerializer(serializers.ModelSerializer[TaskEvent]):
    task_id = serializers.IntegerField(read_only=True)
    payload = JSONObjectField()

    class Meta:
        model = TaskEvent
        fields = ["id", "task_id", "type", "status", "actor", "payload", "created_at"]
        read_only_fields = fields


class ErrorSerializer(serializers.Serializer[Any]):
    error = serializers.CharField(help_text="A stable, machine-readable code.")
    detail = serializers.CharField(help_text="A sentence for humans.")


class ConflictSerializer(ErrorSerializer):
    status = serializers.ChoiceField(choices=TaskStatus.choices, help_text="The task's status now.")


class ValidationErrorSerializer(ErrorSerializer):
    """``error`` is "invalid"; ``fields`` maps each refused field to its messages."""

    # "fields" is the name of a Serializer attribute, so it is declared here instead.
    def get_fields(self) -> dict[str, serializers.Field[Any, Any, Any, Any]]:
        return {
            **super().get_fields(),
            "fields": serializers.DictField(
                child=serializers.ListField(child=serializers.CharField()),
                help_text="The messages for each field that was refused.",
            ),
        }


# -- Input ------------------------------------------------------------------------------


class TaskCreateSerializer(serializers.Serializer[Any]):
    title = StrictCharField(min_length=1, max_length=200, visible=True, trim_whitespace=True)
    description = StrictCharField(required=False, default="", allow_blank=True)
    payload = JSONObjectField(required=False, default=dict)
    queue = queue_field(required=False, default="default")
    priority = StrictIntegerField(required=False, default=0, min_value=-1000, max_value=1000)
    max_failures = StrictIntegerField(required=False, min_value=1, max_value=100)
    run_after = TimeField(required=False, allow_null=True, default=None)
    depends_on = UniqueListField(
        child=task_id_field(),
        required=False,
        default=list,
        max_length=MAX_DEPENDENCIES,
        help_text=(
            "Existing tasks that must be done before this one can be claimed (at most "
            f"{MAX_DEPENDENCIES}, no duplicates)."
        ),
    )
    parent_id = task_id_field(
        required=False,
        allow_null=True,
        default=None,
        help_text="An existing task that this one is a subtask of.",
    )
    # No default here: left out, the server's default applies (transitions.create_once);
    # null, no limit.
    max_attempt_seconds = StrictIntegerField(
        required=False,
        allow_null=True,
        min_value=1,
        max_value=MAX_ATTEMPT_SECONDS,
        help_text=(
            "How long one attempt may hold the task, however often it heartbeats. "
            "Left out: TASKBOARD_MAX_ATTEMPT_SECONDS (unset: no limit); null: no limit."
        ),
    )
    assignee = username_field(
        required=False,
        allow_null=True,
        default=None,
        help_text="Only this user (a person or an agent) may claim the task.",
    )
    requires = UniqueListField(
        child=label_field(),
        required=False,
        default=list,
        max_length=MAX_REQUIRES,
        help_text=(
            f"At most {MAX_REQUIRES} labels, each among the claimant's capabilities for a "
            "claim to take the task."
        ),
    )

    def validate_assignee(self, value: str | None) -> str | None:
        return existing_user(value)


def existing_user(name: str | None) -> str | None:
    """Refuse a username that names nobody (a task assigned to nobody could never be done)."""
    if name is not None and not get_user_model().objects.filter(username=name).exists():
        raise serializers.ValidationError(f"No user is named {name!r}.")
    return name


class AskSerializer(serializers.Serializer[Any]):
    lease_token = lease_token_field()
    question = StrictCharField(min_length=1, max_length=MAX_QUESTION, visible=True)
    options = UniqueListField(
        child=StrictCharField(min_length=1, max_length=MAX_OPTION, visible=True),
        required=False,
        allow_null=True,
        default=None,
        min_length=2,
        max_length=MAX_OPTIONS,
        help_text="2 to 10 distinct choices; the answer must be one of them.",
    )
    answer_schema = JSONObjectField(
        required=False,
        allow_null=True,
        default=None,
        help_text="A JSON Schema (at most 64 KiB) the answer must validate against.",
    )
    assignee = username_field(
        required=False,
        allow_null=True,
        default=None,
        help_text="The user asked to answer.",
    )
    answer_within = StrictIntegerField(
        required=False,
        allow_null=True,
        default=None,
        min_value=60,
        max_value=2592000,
        help_text="Seconds until the task is escalated for want of an answer.",
    )
    action_digest = StrictCharField(
        required=False,
        allow_null=True,
        default=None,
        min_length=1,
        max_length=128,
        help_text="What is to be approved, e.g. the SHA-256 of the exact command.",
    )

    def validate_assignee(self, value: str | None) -> str | None:
        return existing_user(value)

    def validate_answer_schema(self, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and (problem := schema_problem(value)):
            raise serializers.ValidationError(f"The answer schema {problem}")
        return value

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if attrs.get("options") is not None and attrs.get("answer_schema") is not None:
            raise serializers.ValidationError(
                {"answer_schema": ["Give options or an answer schema, not both."]}
            )
        return attrs


class AnswerSerializer(serializers.Serializer[Any]):
    answer = AnyJSONField(
        help_text=(
            "One of the options; or a value the answer schema accepts; or else a string of "
            "1 to 10,000 characters."
        )
    )
    note = StrictCharField(
        required=False, allow_null=True, allow_blank=True, default=None, max_length=10000
    )


class CommentSerializer(serializers.Serializer[Any]):
    body = StrictCharField(min_length=1, max_length=10000, visible=True)


class QueueCountsSerializer(serializers.Serializer[Any]):
    pending = serializers.IntegerField(help_text="Pending and not blocked (due or not).")
    blocked = serializers.IntegerField(help_text="Pending, waiting for a dependency.")
    in_progress = serializers.IntegerField()
    escalated = serializers.IntegerField()
    done = serializers.IntegerField()
    cancelled = serializers.IntegerField()
    awaiting_input = serializers.IntegerField(help_text="Waiting for a person's answer.")


class QueueSerializer(serializers.Serializer[Any]):
    name = serializers.CharField()
    paused = serializers.BooleanField(help_text="Its tasks are not handed out by claims.")
    counts = QueueCountsSerializer()
    oldest_pending_at = serializers.DateTimeField(
        allow_null=True,
        help_text=(
            "Since when its longest-waiting claimable task (pending, unblocked, due) has "
            "been claimable: its creation, or its run_after when later; null when it has "
            "none."
        ),
    )


class AgentSerializer(serializers.Serializer[Any]):
    name = serializers.CharField()
    holding = serializers.ListField(
        child=serializers.IntegerField(), help_text="The tasks it holds a lease on now."
    )
    last_seen_at = serializers.DateTimeField(
        allow_null=True, help_text="Its last claim, heartbeat, complete, fail, release or escalate."
    )
    completed_24h = serializers.IntegerField(help_text="Completes in the last 24 hours.")
    failed_24h = serializers.IntegerField(help_text="Fails in the last 24 hours.")
    expired_24h = serializers.IntegerField(help_text="Leases lost by expiry in the last 24 hours.")


class ClaimSerializer(serializers.Serializer[Any]):
    queues = serializers.ListField(
        child=queue_field(),
        required=False,
        allow_null=True,
        default=None,
        max_length=100,
        help_text="Claim only from these queues; omitted, null or empty: from every queue.",
    )
    limit = StrictIntegerField(
        required=False, default=1, min_value=1, max_value=conf.MAX_CLAIM_LIMIT
    )
    lease_seconds = lease_seconds_field(required=False)
    wait = StrictFloatField(
        required=False,
        default=0,
        min_value=0,
        max_value=conf.MAX_WAIT_SECONDS,
        help_text="Seconds to wait for a claimable task when none is there now.",
    )


class HeartbeatSerializer(serializers.Serializer[Any]):
    lease_token = lease_token_field()
    lease_seconds = lease_seconds_field(required=False)
    progress = AnyJSONField(required=False, default=None)


class CompleteSerializer(serializers.Serializer[Any]):
    lease_token = lease_token_field()
    result = AnyJSONField(required=False, default=None)


class FailSerializer(serializers.Serializer[Any]):
    lease_token = lease_token_field()
    error = StrictCharField(max_length=10000, visible=True, trim_whitespace=True)
    retry_after = StrictIntegerField(
        required=False,
        allow_null=True,
        default=None,
        min_value=0,
        max_value=conf.MAX_LEASE_SECONDS * 30,
    )


class LeaseSerializer(serializers.Serializer[Any]):
    lease_token = lease_token_field()


class EscalateSerializer(LeaseSerializer):
    reason = StrictCharField(max_length=10000, visible=True, trim_whitespace=True)


class NoteSerializer(serializers.Serializer[Any]):
    note = StrictCharField(
        required=False,
        allow_null=True,
        allow_blank=True,
        default=None,
        max_length=10000,
        trim_whitespace=True,
    )


class ResolveSerializer(NoteSerializer):
    result = AnyJSONField(required=False, default=None)


class TaskFilterSerializer(serializers.Serializer[Any]):
    status = serializers.ChoiceField(choices=TaskStatus.choices, required=False)
    queue = queue_field(required=False)
    leased_by = StrictCharField(required=False, max_length=150)
    # DRF's metaclass takes declared fields off the class, so this does not hide the
    # serializer's own ``parent`` attribute at run time; mypy sees only the class body.
    parent = QueryIntegerField(  # type: ignore[assignment]
        required=False, min_value=1, max_value=2**63 - 1, help_text="Subtasks of this task."
    )
    blocked = serializers.ChoiceField(
        choices=["true", "false"],
        required=False,
        help_text="true: pending tasks waiting for a dependency; false: all the others.",
    )
    depends_on = QueryIntegerField(
        required=False,
        min_value=1,
        max_value=2**63 - 1,
        help_text="Tasks that depend on this task.",
    )
    assignee = StrictCharField(
        required=False,
        max_length=150,
        help_text=("Tasks assigned to this user, or whose open question is: a username, or `me`."),
    )
    requires = StrictRegexField(
        LABEL_PATTERN,
        required=False,
        max_length=64,
        help_text="Tasks that require this label.",
    )


# A page stops growing once its rows' JSON reaches this many bytes (always one row at
# least), whatever its ``limit``: a thousand tasks of a megabyte each are not one answer.
PAGE_BYTES = 4 * 1024 * 1024


def page_limit_field() -> QueryIntegerField:
    """A list's ``limit``, which large rows can cut short (board.api.views.keyset_page)."""
    return QueryIntegerField(
        required=False,
        min_value=1,
        max_value=1000,
        default=100,
        help_text=(
            "The most rows the page holds; fewer when rows are large: a page stops before "
            f"the row that would take its JSON past {PAGE_BYTES // 2**20} MiB (it always "
            "holds one row at least), and its `next` continues after the last row it holds. "
            "Follow `next` until it is null rather than counting rows."
        ),
    )


class EventFilterSerializer(serializers.Serializer[Any]):
    after = QueryIntegerField(required=False, min_value=0, default=0, max_value=2**63 - 1)
    task = QueryIntegerField(required=False, min_value=1, max_value=2**63 - 1)
    type = serializers.ChoiceField(choices=EventType.choices, required=False)
    limit = page_limit_field()


class TaskEventFilterSerializer(serializers.Serializer[Any]):
    after = QueryIntegerField(required=False, min_value=0, default=0, max_value=2**63 - 1)
    limit = page_limit_field()


class TaskListPageSerializer(serializers.Serializer[Any]):
    before = QueryIntegerField(
        required=False, min_value=1, max_value=2**63 - 1, help_text="Tasks with a smaller id."
    )
    limit = page_limit_field()


# Queues a page of GET queues/ holds at most (and by default): a queue is a few hundred
# bytes, so a page stays under half a megabyte however many queues agents have made.
MAX_QUEUE_PAGE = 1000


class QueuePageSerializer(serializers.Serializer[Any]):
    after = queue_field(required=False, help_text="Queues whose names sort after this one.")
    limit = QueryIntegerField(
        required=False,
        min_value=1,
        max_value=MAX_QUEUE_PAGE,
        default=MAX_QUEUE_PAGE,
        help_text=(
            "The most queues the answer holds. When more follow, the answer's `Link` header "
            'names the next page (`rel="next"`: the same list with `after` set to the last '
            "name of this one)."
        ),
    )


class TaskPageSerializer(serializers.Serializer[Any]):
    results = TaskSerializer(many=True)
    next = serializers.URLField(allow_null=True, help_text="The next page, or null at the end.")


class EventPageSerializer(serializers.Serializer[Any]):
    results = EventSerializer(many=True)
    next = serializers.URLField(allow_null=True, help_text="The next page, or null at the end.")


# http or https, a host name or address (an IPv6 one in brackets), a port (1..65535, no
# leading zero), then a path, query or fragment without spaces or control characters. The
# pattern is the whole rule (the schema states it): a URL that fits it but reaches nothing
# fails its deliveries, with the error in each delivery, like a receiver that is down.
PORT_PATTERN = (
    "(?:6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3})"
)
WEBHOOK_URL_PATTERN = (
    "^[Hh][Tt][Tt][Pp][Ss]?://(?:[A-Za-z0-9._~-]+|\\[[0-9A-Fa-f:.]+\\])"
    f"(?::{PORT_PATTERN})?"
    "(?:[/?#][^\\u0000-\\u0020\\u007f]*)?\\Z"  # \Z: no newline after the end
)


class WebhookCreateSerializer(serializers.Serializer[Any]):
    url = StrictRegexField(
        WEBHOOK_URL_PATTERN,
        max_length=2000,
        error_messages={"invalid": "Use an http or https URL."},
        help_text=(
            "Where to POST the deliveries: an http or https URL whose host is, and resolves "
            "to, public addresses only (unless TASKBOARD_WEBHOOK_ALLOW_PRIVATE)."
        ),
    )
    events = serializers.ListField(
        child=serializers.ChoiceField(choices=EventType.choices),
        required=False,
        default=lambda: [EventType.ESCALATED.value],
        min_length=1,
        max_length=len(EventType.choices),
        help_text='The event types to send; default ["escalated"].',
    )
    queues = serializers.ListField(
        child=queue_field(),
        required=False,
        allow_null=True,
        default=None,
        min_length=1,
        max_length=100,
        help_text="Send only events of tasks in these queues; omitted or null: every queue.",
    )
    secret = StrictCharField(
        required=False,
        min_length=1,
        max_length=200,
        visible=True,
        help_text="The key of the HMAC-SHA256 signature; omitted: a random one is made.",
    )
    format = serializers.ChoiceField(
        choices=WebhookFormat.choices,
        required=False,
        default=WebhookFormat.JSON.value,
        help_text=(
            'json: {"event": Event, "task": Task}; slack: a Slack-compatible {"text": ...} '
            "with a link to the task's admin page."
        ),
    )

    def validate_url(self, value: str) -> str:
        if reason := webhook_addresses.refusal(value):
            raise serializers.ValidationError(reason)
        return value

    def validate_events(self, value: list[str]) -> list[str]:
        return sorted(set(value), key=value.index)

    def validate_queues(self, value: list[str] | None) -> list[str] | None:
        return None if value is None else sorted(set(value), key=value.index)


class WebhookSerializer(serializers.ModelSerializer[Webhook]):
    # As given: an IRI may hold characters that a "uri" format would not admit.
    url = serializers.CharField()
    events = serializers.ListField(child=serializers.ChoiceField(choices=EventType.choices))
    queues = serializers.ListField(child=serializers.CharField(), allow_null=True)

    class Meta:
        model = Webhook
        fields = ["id", "url", "events", "queues", "format", "active", "created_by", "created_at"]


class WebhookCreatedSerializer(WebhookSerializer):
    secret = serializers.CharField(help_text="Shown only in this response.")

    class Meta(WebhookSerializer.Meta):
        fields = [*WebhookSerializer.Meta.fields, "secret"]


class DeliverySerializer(serializers.ModelSerializer[Delivery]):
    status = serializers.ChoiceField(choices=DeliveryStatus.choices)

    class Meta:
        model = Delivery
        fields = [
            "id",
            "event_id",
            "task_id",
            "status",
            "attempts",
            "last_status_code",
            "last_error",
            "next_attempt_at",
            "delivered_at",
            "created_at",
        ]
        # Never null here: a webhook's deliveries are all of events (the password reset
        # emails, which have none, go through the email row, which the API does not serve).
        extra_kwargs = {
            "event_id": {"allow_null": False, "required": True},
            "task_id": {"allow_null": False, "required": True},
        }


class WebhookPageSerializer(serializers.Serializer[Any]):
    results = WebhookSerializer(many=True)
    next = serializers.URLField(allow_null=True, help_text="The next page, or null at the end.")


class DeliveryPageSerializer(serializers.Serializer[Any]):
    results = DeliverySerializer(many=True)
    next = serializers.URLField(allow_null=True, help_text="The next page, or null at the end.")


def render(serializer_class: type[serializers.Serializer[Any]], instance: Any) -> dict[str, Any]:
    """Return ``serializer_class(instance).data``, from one cached serializer per class.

    Building a ModelSerializer's fields costs more than the rest of a request's Python
    work; output serializers hold no per-request state, so one instance serves them all.
    """
    serializer = _renderers.get(serializer_class)
    if serializer is None:
        serializer = _renderers.setdefault(serializer_class, serializer_class())
    return dict(serializer.to_representation(instance))


def render_many(serializer_class: type[serializers.Serializer[Any]], rows: Any) -> list[Any]:
    return [render(serializer_class, row) for row in rows]


_renderers: dict[type[serializers.Serializer[Any]], serializers.Serializer[Any]] = {}
