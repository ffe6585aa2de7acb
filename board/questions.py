"""What an agent may ask a person, and what counts as an answer.

A question has ``options`` (the answer must be one of them), or an ``answer_schema`` (a
JSON Schema the answer must validate against), or neither (the answer is free text). The
schema is checked when it is asked, so that a question nobody could answer is refused
then, not when a person tries. Validation is the ``jsonschema`` library's, against the
draft the schema names (``$schema``), 2020-12 when it names none.

Who may answer: the question's assignee, the task's assignee, or a user with the
``board.answer_task`` permission (superusers have every permission).
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
from django.contrib.auth.base_user import AbstractBaseUser
from django.contrib.auth.models import AnonymousUser
from jsonschema.exceptions import SchemaError

from board.exceptions import InvalidAnswer

MAX_QUESTION = 10_000
MAX_OPTIONS = 10
MAX_OPTION = 200
MAX_SCHEMA_BYTES = 64 * 1024
MAX_ANSWER_TEXT = 10_000
ANSWER_PERMISSION = "board.answer_task"


def schema_problem(schema: Any) -> str | None:
    """Why ``schema`` is not a JSON Schema an answer can be checked against, or None."""
    if not isinstance(schema, dict):
        return "must be a JSON Schema object."
    if len(json.dumps(schema, separators=(",", ":")).encode()) > MAX_SCHEMA_BYTES:
        return f"must be at most {MAX_SCHEMA_BYTES // 1024} KiB of JSON."
    try:
        validator = jsonschema.validators.validator_for(
            schema, default=jsonschema.Draft202012Validator
        )
        validator.check_schema(schema)
    except SchemaError as error:
        return f"is not a valid JSON Schema: {error.message}"
    return None


def check_answer(question: dict[str, Any], answer: Any) -> None:
    """Raise InvalidAnswer unless ``answer`` answers ``question`` (a task's open question)."""
    options = question.get("options")
    schema = question.get("answer_schema")
    if options:
        if answer not in options:
            raise InvalidAnswer("must be one of the options: " + ", ".join(map(repr, options)))
        return
    if schema is not None:
        validator_class = jsonschema.validators.validator_for(
            schema, default=jsonschema.Draft202012Validator
        )
        validator = validator_class(schema, format_checker=validator_class.FORMAT_CHECKER)
        error = jsonschema.exceptions.best_match(validator.iter_errors(answer))
        if error is not None:
            where = "/".join(str(part) for part in error.absolute_path)
            raise InvalidAnswer(
                f"does not match the answer schema{' at ' + where if where else ''}: "
                f"{error.message}"
            )
        return
    if not isinstance(answer, str) or not answer.strip():
        raise InvalidAnswer("must be a non-empty string.")
    if len(answer) > MAX_ANSWER_TEXT:
        raise InvalidAnswer(f"must be at most {MAX_ANSWER_TEXT} characters.")


def may_answer(
    user: AbstractBaseUser | AnonymousUser, question: dict[str, Any] | None, assignee: str | None
) -> bool:
    """Whether ``user`` may answer a task's question (``assignee``: the task's)."""
    if not user.is_authenticated:
        return False
    name = user.get_username()
    if name in {assignee, (question or {}).get("assignee")} - {None}:
        return True
    has_perm = getattr(user, "has_perm", None)
    return bool(has_perm and has_perm(ANSWER_PERMISSION))
