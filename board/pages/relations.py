"""A task's place in the work graph, as the pages show it: its parent, its children with
their progress, what it depends on and what depends on it.

The board's task page (board.pages.views) and the escalated task's admin page
(escalations.admin) both show it. Each related task is a short summary, never its data;
one of a queue the user may not see (board.access) is shown by id only, or left out.
"""

from __future__ import annotations

from typing import Any, TypedDict

from board.access import QueueAccess
from board.models import Task

# What a summary reads, so a list of related tasks never loads their payloads.
SUMMARY_FIELDS = ("id", "title", "queue", "status", "open_dependencies")
# A page lists up to this many children and dependents (a note counts the rest).
LIST_LIMIT = 200


class Summary(TypedDict, total=False):
    id: int
    title: str
    queue: str
    status: str
    blocked: bool
    progress: Any
    hidden: bool  # of a queue the user may not see: nothing but the id


class Relations(TypedDict):
    parent: Summary | None
    children: list[Summary]
    more_children: int
    dependencies: list[Summary]
    dependents: list[Summary]
    more_dependents: int


def summary(task: Task) -> Summary:
    """Return what a page lists of a related task."""
    return {
        "id": task.pk,
        "title": task.title,
        "queue": task.queue,
        "status": task.status,
        "blocked": task.blocked,
    }


def hidden(task_id: int) -> Summary:
    return {"id": task_id, "hidden": True}


def relations_of(task: Task, access: QueueAccess) -> Relations:
    """Return ``task``'s parent, children, dependencies and dependents, oldest first
    (dependencies in the order they were given), as ``access`` lets its user see them."""
    visible = access.visible(Task.objects.only(*SUMMARY_FIELDS)).order_by("id")
    parent = visible.filter(pk=task.parent_id).first() if task.parent_id else None
    children_of = visible.filter(parent_id=task.pk)
    children = list(children_of.only(*SUMMARY_FIELDS, "progress")[:LIST_LIMIT])
    dependents_of = visible.filter(dependencies__depends_on_id=task.pk)
    dependents = list(dependents_of[:LIST_LIMIT])
    dependencies = {
        dep.pk: dep
        for dep in Task.objects.filter(dependents__task_id=task.pk).only(*SUMMARY_FIELDS)
    }
    return {
        "parent": summary(parent) if parent else None,
        "children": [{**summary(child), "progress": child.progress} for child in children],
        "more_children": _more(children_of, children),
        "dependencies": [
            summary(dependencies[pk])
            if pk in dependencies and access.allows(dependencies[pk].queue)
            else hidden(pk)
            for pk in task.depends_on
        ],
        "dependents": [summary(dependent) for dependent in dependents],
        "more_dependents": _more(dependents_of, dependents),
    }


def _more(queryset: Any, shown: list[Task]) -> int:
    """Return how many of ``queryset`` a list of ``shown`` (cut at LIST_LIMIT) leaves out."""
    return queryset.count() - len(shown) if len(shown) == LIST_LIMIT else 0
