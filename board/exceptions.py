"""The board's own exceptions, and the one place database errors are translated into them."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from django.db import DataError, IntegrityError, InternalError


class BoardError(Exception):
    """Base class of the errors a transition reports."""

    code = "board_error"


class TaskNotFound(BoardError):
    code = "not_found"

    def __init__(self, task_id: int) -> None:
        self.task_id = task_id
        super().__init__(f"Task {task_id} does not exist.")


class ReferencedTaskNotFound(TaskNotFound):
    """A create named a dependency or parent that is not a task the caller can see."""

    def __init__(self, task_id: int, field: str) -> None:
        super().__init__(task_id)
        self.field = field
        self.args = (f"Task {task_id} does not exist ({field}).",)


class LeaseLost(BoardError):
    """The caller does not hold a live lease on the task; it must stop working on it."""

    code = "lease_lost"

    def __init__(self, task_id: int, status: str, *, deadline_passed: bool = False) -> None:
        self.task_id = task_id
        self.status = status
        self.deadline_passed = deadline_passed
        if deadline_passed:
            super().__init__(
                f"You do not hold a live lease on task {task_id}: the attempt deadline "
                "passed (max_attempt_seconds since the claim). Stop working on it."
            )
            return
        super().__init__(
            f"You do not hold a live lease on task {task_id} (it is {status}): "
            "wrong token, another holder, or the lease expired. Stop working on it."
        )


class InvalidTransition(BoardError):
    code = "invalid_transition"

    def __init__(self, task_id: int, status: str, action: str, allowed: tuple[str, ...]) -> None:
        self.task_id = task_id
        self.status = status
        self.action = action
        self.allowed = allowed
        super().__init__(
            f"Cannot {action} task {task_id}: it is {status}, "
            f"and {action} applies only to {' or '.join(allowed)} tasks."
        )


class IdempotencyConflict(BoardError):
    """A create repeated an idempotency key of the same user with a different body."""

    code = "idempotency_conflict"

    def __init__(self, key: str, task_id: int) -> None:
        self.key = key
        self.task_id = task_id
        super().__init__(
            f"The Idempotency-Key was used before, by you, to create task {task_id} with "
            "another body. Use a new key for a new task."
        )


class ForbiddenQueue(BoardError):
    """The user is limited to other queues than the one it asked to create in, claim from
    or act on (board.access)."""

    code = "forbidden_queue"

    def __init__(
        self, queues: Iterable[str], allowed: Iterable[str], *, named: bool = True
    ) -> None:
        self.queues = sorted(set(queues))
        self.allowed = sorted(allowed)
        limited = f"you are limited to {', '.join(self.allowed) or 'no queue'}."
        if not named:
            # The queue of a task the caller may not see: its name is not the caller's.
            super().__init__(f"This task is in a queue you may not use: {limited}")
            return
        names = ", ".join(self.queues)
        super().__init__(
            f"You may not use the queue{'s' if len(self.queues) > 1 else ''} {names}: {limited}"
        )


class RateLimited(BoardError):
    """A user made more writes of one kind (creates, comments) in the last minute than its
    rate allows (access.rates); nothing was done. ``retry_after``: seconds until it fits."""

    code = "rate_limited"

    def __init__(self, kind: str, limit: int, retry_after: int) -> None:
        self.kind = kind
        self.limit = limit
        self.retry_after = retry_after
        did = "created more tasks" if kind == "create" else "wrote more comments"
        super().__init__(
            f"Rate limited: you {did} in the last minute than the rate allows ({limit} a "
            f"minute per user). Nothing was done; try again in {retry_after} seconds."
        )


class InvalidTask(BoardError, ValueError):
    """A value broke one of the tasks table's constraints."""

    code = "invalid"


class InvalidAnswer(BoardError, ValueError):
    """An answer that does not answer the open question (board.questions.check_answer)."""

    code = "invalid"
    field = "answer"


class EventLogIsAppendOnly(BoardError):
    """Something tried to update, delete or truncate task_events."""

    code = "append_only"


class ArchiveMismatch(BoardError):
    """A partition of task_events does not hold what the archive file holds."""

    code = "archive_mismatch"


class PendingDeliveries(BoardError):
    """Deliveries of events that were to leave the log are still pending; ``pending``
    counts them by webhook id."""

    code = "deliveries_pending"

    def __init__(self, pending: dict[int, int]) -> None:
        self.pending = pending
        total = sum(pending.values())
        super().__init__(f"{total} deliver{'y' if total == 1 else 'ies'} still pending")


# Names given by the migrations to the constraints and the trigger's error.
APPEND_ONLY_CONSTRAINT = "task_events_append_only"
ARCHIVE_VERIFIED_CONSTRAINT = "task_events_archive_verified"


@contextmanager
def translated_database_errors() -> Iterator[None]:
    """Turn the database's named refusals into the board's exceptions."""
    try:
        yield
    except DataError as exc:
        diag = getattr(exc.__cause__, "diag", None)
        if getattr(diag, "constraint_name", None) == ARCHIVE_VERIFIED_CONSTRAINT:
            raise ArchiveMismatch(str(exc.__cause__).strip()) from exc
        # A value the column cannot hold: text longer than its limit, a number out of range.
        raise InvalidTask(str(exc.__cause__ or exc).strip()) from exc
    except (IntegrityError, InternalError) as exc:
        cause = exc.__cause__
        diag = getattr(cause, "diag", None)
        constraint = getattr(diag, "constraint_name", None) or ""
        if constraint == APPEND_ONLY_CONSTRAINT:
            raise EventLogIsAppendOnly(str(cause).strip()) from exc
        if constraint.startswith("tasks_"):
            raise InvalidTask(f"The task breaks the constraint {constraint}.") from exc
        raise
