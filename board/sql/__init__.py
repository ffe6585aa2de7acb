"""Named SQL statements, kept together in ``.sql`` files, and the one way they are run.

A file holds blocks that start with ``-- name: <name>`` followed by comment lines that
describe the statement; :data:`QUERIES` maps each name of this folder's files to its SQL,
loaded once at import. Another package keeps its own file next to its module and loads it
with :func:`load`.

A statement that PostgreSQL must plan in several ways (one plan per prepared statement)
is written once, as a ``-- template: <name>`` block whose variable parts are slots spelled
``:slot``, and each way is a named block of its own that says how it fills them::

    -- name: claim_any_queue_one
    -- The usual claim: one task, from any queue.
    -- from: claim
    -- with :queues as true
    -- with :limit as 1

A variant must fill every slot of its template and nothing else, or loading fails.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, TypeVar

import psycopg
from django.db import connection
from django.db.models import Field, JSONField, Model

from board import conf
from board.exceptions import translated_database_errors

_BLOCK = re.compile(r"^-- (?P<kind>name|template): (?P<name>\w+)\s*$", re.MULTILINE)
_COMMENT = re.compile(r"^\s*--")
_FROM = re.compile(r"^-- from: (?P<template>\w+)\s*$")
_WITH = re.compile(r"^-- with :(?P<slot>\w+) as (?P<sql>.+?)\s*$")
_SLOT = re.compile(r"(?<![:\w]):(?P<slot>[a-z_]+)\b")


def load(path: Path) -> dict[str, str]:
    """Return the named statements of one ``.sql`` file (its templates filled in)."""
    text = path.read_text()
    matches = list(_BLOCK.finditer(text))
    queries: dict[str, str] = {}
    templates: dict[str, str] = {}
    variants: dict[str, tuple[str, dict[str, str]]] = {}
    for match, following in zip(matches, [*matches[1:], None], strict=True):
        end = following.start() if following else len(text)
        lines = text[match.end() : end].splitlines()
        # Comment lines document the statement for readers; they are not sent to the server
        # (psycopg would read a percent sign in them as a placeholder).
        sql = "\n".join(line for line in lines if not _COMMENT.match(line)).strip().rstrip(";")
        if match["kind"] == "template":
            templates[match["name"]] = sql
            continue
        of = [m["template"] for line in lines if (m := _FROM.match(line))]
        if of:
            slots = {w["slot"]: w["sql"] for line in lines if (w := _WITH.match(line))}
            variants[match["name"]] = (of[0], slots)
        else:
            queries[match["name"]] = sql
    for name, (template, slots) in variants.items():
        queries[name] = _filled(templates[template], slots, f"{path.name}: {name}")
    return queries


def _filled(template: str, slots: dict[str, str], where: str) -> str:
    """The template's text with each ``:slot`` replaced by its SQL."""
    wanted = {m["slot"] for m in _SLOT.finditer(template)}
    if wanted != set(slots):
        raise ValueError(f"{where} fills {sorted(slots)}; its template has {sorted(wanted)}")
    return _SLOT.sub(lambda m: slots[m["slot"]], template)


QUERIES: dict[str, str] = {}
for _file in sorted(Path(__file__).parent.glob("*.sql")):
    QUERIES.update(load(_file))


def run(sql: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    """Run one statement on Django's connection and return its rows as dicts, with the
    database's errors translated into the board's exceptions."""
    with translated_database_errors(), connection.cursor() as cursor:
        if conf.database_prepared_statements():
            # Prepared on the session (a server-binding cursor on Django's connection):
            # PostgreSQL then plans each statement once for the session instead of at
            # every call, where planning the claim took longer than running it.
            session = cursor.cursor.connection
            with connection.wrap_database_errors, psycopg.Cursor(session) as prepared:
                try:
                    prepared.execute(sql, params, prepare=True)
                except psycopg.errors.FeatureNotSupported as exc:
                    # "cached plan must not change result type": a migration changed a
                    # table under a statement this session prepared. Drop the session's
                    # statements (psycopg notices DEALLOCATE ALL and forgets its own) and
                    # try once more, preparing afresh; not within a transaction, which the
                    # error has already lost.
                    if "cached plan" not in str(exc) or connection.in_atomic_block:
                        raise
                    prepared.execute("DEALLOCATE ALL")
                    prepared.execute(sql, params, prepare=True)
                columns = _column_names(prepared)
                return [dict(zip(columns, row, strict=True)) for row in prepared.fetchall()]
        cursor.execute(sql, params)
        columns = _column_names(cursor.cursor)
        return [dict(zip(columns, row, strict=True)) for row in cursor.fetchall()]


def _column_names(cursor: psycopg.Cursor[Any]) -> list[str]:
    """The names of the result's columns, read from the result itself: psycopg's
    ``description`` builds a Column object for each (20 us for a task's row, against 1 us
    for the names), and a statement's caller needs only the names."""
    result = cursor.pgresult
    if result is None:
        return []
    return [(result.fname(i) or b"").decode() for i in range(result.nfields)]


M = TypeVar("M", bound=Model)
_FIELDS: dict[type[Model], dict[str, Field[Any, Any]]] = {}


def instance(model: type[M], row: dict[str, Any]) -> M:
    """Build an instance of ``model`` from a ``RETURNING *`` row of its table, ignoring any
    extra columns, as Django's own query would have (without a second query)."""
    fields = _FIELDS.get(model)
    if fields is None:
        fields = _FIELDS[model] = {str(f.column): f for f in model._meta.concrete_fields}
    names, values = [], []
    for column, field in fields.items():
        value = row[column]
        # Django leaves jsonb as text for the field to decode, as its query compiler would.
        if isinstance(field, JSONField):
            value = field.from_db_value(value, None, connection)  # type: ignore[arg-type]
        names.append(field.attname)
        values.append(value)
    return model.from_db(connection.alias, names, values)
