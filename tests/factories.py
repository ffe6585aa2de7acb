"""factory-boy factories. Tasks are made through board.transitions, as the app makes them,
so every task a test sees has its "created" event."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import Permission, User
from factory.base import Factory
from factory.declarations import LazyFunction, Sequence, SubFactory
from factory.django import DjangoModelFactory, Password

from access import tokens
from access.models import ApiToken
from board import transitions
from board.models import Task


class UserFactory(DjangoModelFactory[User]):
    class Meta:
        model = User
        django_get_or_create = ("username",)

    username = Sequence(lambda n: f"agent-{n}")
    password = Password("secret-password")


class StaffFactory(UserFactory):
    username = Sequence(lambda n: f"human-{n}")
    is_staff = True


def grant(user: User, *permissions: str) -> User:
    """Give ``user`` each of ``permissions`` ("app_label.codename"); return the user."""
    for name in permissions:
        app_label, codename = name.split(".")
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label=app_label, codename=codename)
        )
    # Django caches a user's permissions on the object: drop that so the grant shows.
    for cache in ("_perm_cache", "_user_perm_cache"):
        user.__dict__.pop(cache, None)
    return user


# digest -> plain token, of the tokens TokenFactory issued (the database keeps digests only).
_issued: dict[str, str] = {}


class TokenFactory(DjangoModelFactory[ApiToken]):
    """Return the user's API token, issuing one if it has none, with its plain ``.key``.

    One token per user, as before tokens were hashed: a second call for the same user
    returns the token the first one issued, so that two clients of one user both work.
    """

    class Meta:
        model = ApiToken

    user = SubFactory(UserFactory)

    @classmethod
    def _create(
        cls, model_class: type[ApiToken], *args: Any, user: User, **kwargs: Any
    ) -> ApiToken:
        existing = ApiToken.objects.filter(user=user).first()
        if existing is not None and existing.digest in _issued:
            existing.key = _issued[existing.digest]
            return existing
        token = tokens.issue(user)
        _issued[token.digest] = str(token.key)
        return token


class TaskFactory(Factory[Task]):
    """Build a pending task via transitions.create (pass created_by=<user> to choose)."""

    class Meta:
        model = Task

    title = Sequence(lambda n: f"task {n}")
    description = ""
    payload = LazyFunction(dict)
    queue = "default"
    priority = 0
    created_by = SubFactory(UserFactory)

    @classmethod
    def _create(cls, model_class: type[Task], *args: Any, created_by: User, **kwargs: Any) -> Task:
        return transitions.create(actor=created_by, **kwargs)
