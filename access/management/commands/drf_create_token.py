"""``manage.py drf_create_token USER [-r]``: give a user (a human, say) an API token.

It replaces DRF's command of the same name, with the same output, for tokens stored hashed
(access.tokens). The one difference: a token that exists cannot be shown again, so for a
user that has one the command refuses unless ``-r`` asks to replace it.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser

from access import tokens
from access.models import ApiToken


class Command(BaseCommand):
    help = "Create an API token for a given user and print it (once)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username", type=str)
        parser.add_argument(
            "-r",
            "--reset",
            action="store_true",
            dest="reset_token",
            default=False,
            help="Replace the user's token with a new one",
        )

    def handle(self, *args: Any, username: str, reset_token: bool, **options: Any) -> None:
        User = get_user_model()
        try:
            user = User._default_manager.get_by_natural_key(username)
        except User.DoesNotExist:
            raise CommandError(f"Cannot create the Token: user {username} does not exist") from None
        if not reset_token and ApiToken.objects.filter(user=user).exists():
            raise CommandError(
                f"User {username} already has a token. Tokens are stored hashed and cannot "
                "be shown again: run with -r to replace it with a new one."
            )
        token = tokens.issue(user)
        self.stdout.write(f"Generated token {token.key} for user {username}")
