"""``manage.py create_agent NAME [--queues q1,q2 | --all-queues] [--capabilities a,b]``:
create (or reuse) an agent user, set the queues it is limited to (board.access) and the
capabilities it offers (the labels a task's ``requires`` must be among), and print its API
token.

Tokens are stored hashed, so an existing agent's token cannot be shown again: run for an
agent that exists, the command issues a new token, and the old one stops working.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser

from access import tokens
from board.access import limit_queues, queue_access
from board.models import Capabilities, label_validator, queue_validator


def queue_list(value: str) -> list[str]:
    """Parse ``--queues``: comma-separated queue names, at least one."""
    names = sorted({name.strip() for name in value.split(",") if name.strip()})
    if not names:
        raise CommandError("--queues needs at least one queue name.")
    for name in names:
        try:
            queue_validator(name)
        except ValidationError as exc:
            raise CommandError(
                f"--queues: {name!r} is not a queue name: {exc.messages[0]}"
            ) from None
    return names


def label_list(value: str) -> list[str]:
    """Parse ``--capabilities``: comma-separated labels (none: an empty value)."""
    labels = sorted({label.strip() for label in value.split(",") if label.strip()})
    for label in labels:
        try:
            label_validator(label)
        except ValidationError as exc:
            raise CommandError(
                f"--capabilities: {label!r} is not a label: {exc.messages[0]}"
            ) from None
    return labels


class Command(BaseCommand):
    help = (
        "Create (or reuse) the user NAME and print a new API token as the last line "
        "(for an existing agent, this replaces its token)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="the agent's username")
        scope = parser.add_mutually_exclusive_group()
        scope.add_argument(
            "--queues",
            help=(
                "comma-separated queues the agent is limited to: it sees, claims from and "
                "acts on only these (default for a new agent: every queue; an existing "
                "agent keeps its limit)"
            ),
        )
        scope.add_argument(
            "--all-queues",
            action="store_true",
            help="lift the agent's queue limit: it may use every queue again",
        )
        parser.add_argument(
            "--capabilities",
            help=(
                "comma-separated labels the agent offers: it claims a task only when the "
                "task's requires are among them (an empty value clears them; default: "
                "an existing agent keeps its own)"
            ),
        )

    def handle(
        self,
        *args: Any,
        name: str,
        queues: str | None = None,
        all_queues: bool = False,
        capabilities: str | None = None,
        **options: Any,
    ) -> None:
        User = get_user_model()
        limit = queue_list(queues) if queues is not None else None
        labels = label_list(capabilities) if capabilities is not None else None
        if not name.strip():
            raise CommandError("The agent's name must not be empty.")
        try:
            User._meta.get_field(User.USERNAME_FIELD).clean(name, None)  # type: ignore[union-attr]
        except ValidationError as exc:
            raise CommandError(f"{name!r} is not a valid username: {exc}") from exc
        user, created = User.objects.get_or_create(defaults=None, **{User.USERNAME_FIELD: name})
        if created:
            user.set_unusable_password()
            user.save(update_fields=["password"])
        # The names were checked above, before anything was written.
        access = limit_queues(user, limit) if limit or all_queues else queue_access(user)
        if access.queues is None:
            self.stdout.write(f"Agent {name!r} may use every queue.")
        else:
            self.stdout.write(f"Agent {name!r} is limited to: {', '.join(sorted(access.queues))}.")
        if labels is not None:
            Capabilities.objects.update_or_create(user=user, defaults={"labels": labels})
            self.stdout.write(f"Agent {name!r} offers: {', '.join(labels) or 'no capabilities'}.")

        token = tokens.issue(user)
        if created:
            self.stdout.write(
                f"Created agent {name!r}. Its token (shown once), "
                "for 'Authorization: Bearer <token>':"
            )
        else:
            self.stdout.write(
                f"Reusing agent {name!r} with a new token (the old one no longer works), "
                "shown once, for 'Authorization: Bearer <token>':"
            )
        self.stdout.write(str(token.key))
