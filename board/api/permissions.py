"""Who may call what, beyond "authenticated": the API's permission classes."""

from __future__ import annotations

from typing import Any

from rest_framework.permissions import BasePermission
from rest_framework.request import Request

from escalations.models import TRIAGE_PERMISSION
from escalations.triage import may_triage


class MayTriage(BasePermission):
    """Staff with the triage permission (superusers have it): the same test as the admin's
    escalation queue, so a human may requeue, resolve and cancel in both or in neither."""

    message = f"Only staff with the {TRIAGE_PERMISSION} permission may requeue, resolve or cancel."

    def has_permission(self, request: Request, view: Any) -> bool:
        return may_triage(request.user)


def may_pause_queues(user: Any) -> bool:
    """Return whether ``user`` may pause and resume queues: staff (the contract's rule), in
    the API, on the board and in the admin alike."""
    return bool(user.is_authenticated and user.is_staff)


class IsStaff(BasePermission):
    """Staff users: the humans who may pause and resume queues."""

    message = "Only staff may pause or resume a queue."

    def has_permission(self, request: Request, view: Any) -> bool:
        return may_pause_queues(request.user)
