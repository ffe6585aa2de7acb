"""The escalation queue's three ways out (requeue, resolve, cancel): which transition each
calls, the form that asks for its note (and result), and who may use them.

The admin's queue (escalations.admin) and an escalated task's page on the board
(board.pages.views) both offer them from these definitions, so they call the same transitions
with the same narrowing and ask the same people.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from django import forms

from board import transitions
from board.models import Task, TaskStatus
from escalations.models import TRIAGE_PERMISSION


class NoteForm(forms.Form):
    note = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 4, "cols": 60}),
        help_text="Recorded on the task's event.",
    )

    def clean_note(self) -> str | None:
        # An empty note is no note: the event then carries none.
        return self.cleaned_data["note"] or None


class ResolveForm(NoteForm):
    note = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 4, "cols": 60}),
        help_text="How it was settled; recorded on the task's event.",
    )
    result = forms.JSONField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 6, "cols": 60}),
        help_text="Optional JSON, stored as the task's result.",
    )

    def clean_result(self) -> Any:
        """Refuse what the API refuses and jsonb cannot store (a NUL in a string, say)."""
        from board.api.serializers import storable_json_error

        result = self.cleaned_data.get("result")
        if error := storable_json_error(result):
            raise forms.ValidationError(error)
        return result


@dataclass(frozen=True)
class Triage:
    """One way out of the queue: a transition, and how a page asks for and reports it."""

    name: str
    label: str
    done: str  # past tense, for the report
    transition: Callable[..., Task]  # called with task_id, actor and the form's fields
    allowed: Sequence[str]  # the statuses the transition applies to
    form_class: type[forms.Form] | None = None


# The queue's ways out apply to escalated tasks only, checked by the transition under the
# task's lock: two humans acting on one task at once, the second finds it gone from the
# queue (a requeue would otherwise undo a resolve or cancel made a moment before).
ESCALATED = (TaskStatus.ESCALATED,)
REQUEUE = Triage(
    "requeue",
    "Requeue",
    "Requeued",
    functools.partial(transitions.requeue, from_statuses=ESCALATED),
    ESCALATED,
)
RESOLVE = Triage("resolve", "Resolve", "Resolved", transitions.resolve, ESCALATED, ResolveForm)
CANCEL = Triage(
    "cancel",
    "Cancel",
    "Cancelled",
    functools.partial(transitions.cancel, from_statuses=ESCALATED),
    ESCALATED,
    NoteForm,
)
TRIAGES = {triage.name: triage for triage in (REQUEUE, RESOLVE, CANCEL)}


def may_triage(user: Any) -> bool:
    """Return whether ``user`` may requeue, resolve and cancel escalated tasks: staff with
    the triage permission (superusers have it), in the API, the admin and on the board."""
    return bool(user.is_authenticated and user.is_staff and user.has_perm(TRIAGE_PERMISSION))
