"""Which queues a user may see and act on: the one place the queue limit is applied.

An agent made with ``create_agent NAME --queues a,b`` has a :class:`~board.models.QueueLimit`;
every other user may use every queue. A limited user

- claims only from its own queues (a claim that names none takes from all of them);
- is refused with :class:`~board.exceptions.ForbiddenQueue` (``403 forbidden_queue``) when
  it creates a task in, claims from or acts on a task of another queue;
- never sees another queue's tasks or events: lists leave them out, a read by id finds
  nothing (404), its stream skips them.

The API (``BoardViewSet`` in board.api.views), the stream (board.live.stream), waiting claims
(through the claim view) and the board pages (board.pages.views) all ask :func:`queue_access`
and apply the answer with the methods of :class:`QueueAccess`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from django.db import models

from board.exceptions import ForbiddenQueue
from board.models import QueueLimit, Task, queue_validator

M = TypeVar("M", bound=models.Model)

# Where queue_access() keeps its answer on the user object (see there).
_CACHE_ATTRIBUTE = "_board_queue_access"


@dataclass(frozen=True)
class QueueAccess:
    """The queues one user may use: ``queues``, or every queue when it is None."""

    queues: frozenset[str] | None = None

    @property
    def limited(self) -> bool:
        return self.queues is not None

    def allows(self, queue: str) -> bool:
        return self.queues is None or queue in self.queues

    def covers(self, other: QueueAccess) -> bool:
        """Whether every queue ``other`` allows is allowed here too."""
        return self.queues is None or (other.queues is not None and other.queues <= self.queues)

    def check(self, *queues: str) -> None:
        """Raise ForbiddenQueue unless every one of ``queues`` is allowed."""
        refused = [queue for queue in queues if not self.allows(queue)]
        if refused:
            raise ForbiddenQueue(refused, self.queues or ())

    def check_task(self, task_id: int) -> None:
        """Raise ForbiddenQueue if task ``task_id`` exists in a queue that is not allowed.

        A missing task passes: the transition that follows reports it (404). A task's queue
        never changes, so nothing can move it between this check and that transition.
        """
        if self.queues is None:
            return
        queue = Task.objects.filter(pk=task_id).values_list("queue", flat=True).first()
        if queue is not None and not self.allows(queue):
            raise ForbiddenQueue([queue], self.queues, named=False)

    def claim_queues(self, requested: Sequence[str]) -> list[str]:
        """Return the queues a claim takes from, for the ``queues`` it asked for.

        As asked, when every one is allowed; when it asked for none, every queue (an empty
        list, as board.transitions.claim takes it) or, for a limited user, all of its own.
        """
        if requested:
            self.check(*requested)
            return list(requested)
        if self.queues is None:
            return []
        if not self.queues:
            # Never an empty list here: to transitions.claim that would mean every queue.
            raise ForbiddenQueue(["(any)"], ())
        return sorted(self.queues)

    def visible(self, queryset: models.QuerySet[M], field: str = "queue") -> models.QuerySet[M]:
        """Return ``queryset`` without the rows of other queues (``field`` names the queue)."""
        if self.queues is None:
            return queryset
        return queryset.filter(**{f"{field}__in": sorted(self.queues)})

    def visible_webhooks(self, queryset: models.QuerySet[M]) -> models.QuerySet[M]:
        """Return the webhooks of ``queryset`` that send nothing but this user's queues'
        events (a webhook without queues sends every queue's)."""
        if self.queues is None:
            return queryset
        return queryset.filter(queues__len__gt=0, queues__contained_by=sorted(self.queues))


EVERY_QUEUE = QueueAccess()


def queue_access(user: Any) -> QueueAccess:
    """Return the queues ``user`` may use.

    The answer is kept on the user object. An API token's user object is itself kept for
    TASKBOARD_TOKEN_CACHE_SECONDS (board.api.authentication), so an agent's requests cost
    no query for this, and a changed limit applies at most that much later, as a deleted
    token does. A session loads its user, hence this, on every request.
    """
    access: QueueAccess | None = getattr(user, _CACHE_ATTRIBUTE, None)
    if access is None:
        if not user.is_authenticated:
            return QueueAccess(frozenset())
        queues = QueueLimit.objects.filter(user_id=user.pk).values_list("queues", flat=True)
        found = queues.first()
        access = EVERY_QUEUE if found is None else QueueAccess(frozenset(found))
        setattr(user, _CACHE_ATTRIBUTE, access)
    return access


def limit_queues(user: Any, queues: Iterable[str] | None) -> QueueAccess:
    """Limit ``user`` to ``queues``, or with None let it use every queue again.

    Raises django.core.exceptions.ValidationError for a name that is no queue name, and
    ValueError for an empty list (which would read as "every queue").
    """
    if queues is None:
        QueueLimit.objects.filter(user_id=user.pk).delete()
        access = EVERY_QUEUE
    else:
        names = sorted(set(queues))
        if not names:
            raise ValueError("A queue limit needs at least one queue.")
        for name in names:
            queue_validator(name)
        QueueLimit.objects.update_or_create(user_id=user.pk, defaults={"queues": names})
        access = QueueAccess(frozenset(names))
    setattr(user, _CACHE_ATTRIBUTE, access)
    return access
