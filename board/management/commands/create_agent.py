"""``manage.py create_agent NAME``: create (or reuse) an agent user and print its API token.

Tokens are stored hashed, so an existing agent's token cannot be shown again: run for an
agent that exists, the command issues a new token, and the old one stops working.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser

from access import tokens


class Command(BaseCommand):
    help = (
        "Create (or reuse) the user NAME and print a new API token as the last line "
        "(for an existing agent, this replaces its token)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="the agent's username")

    def handle(self, *args: Any, name: str, **options: Any) -> None:
        User = get_user_model()
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
