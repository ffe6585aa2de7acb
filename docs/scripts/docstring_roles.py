"""A griffe extension: the reStructuredText in docstrings, as Markdown.

The project's docstrings name other objects with Sphinx roles (``:meth:`lease```) and open
literal blocks with a line ``::``, which Markdown would show as they are written. Each role
becomes a cross-reference that mkdocstrings resolves, to the member of the same class,
module or ``~dotted.path`` that it names, or plain code when it names nothing documented;
a ``::`` line is dropped (the indented block after it is a Markdown code block already).
No griffe extension on PyPI does this (griffe-sphinx reads attribute comments, not roles).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:meth|class|func|attr|data|exc|mod|obj):`~?([\w.]+)`")
LITERAL_BLOCK = re.compile(r"^[ \t]*::[ \t]*$", re.MULTILINE)


class SphinxRoles(griffe.Extension):
    # Once the whole package is loaded: a role may name an object defined further down.
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        _rewrite(pkg)


def _rewrite(obj: griffe.Object) -> None:
    if obj.docstring is not None:
        text = ROLE.sub(lambda m: _link(obj, m[1]), obj.docstring.value)
        obj.docstring.value = LITERAL_BLOCK.sub("", text)
    for member in obj.members.values():
        if not member.is_alias and isinstance(member, griffe.Object):
            _rewrite(member)


def _link(obj: griffe.Object, name: str) -> str:
    """Return a Markdown cross-reference to ``name`` as seen from ``obj``'s scope."""
    label = name.rsplit(".", 1)[-1]
    scope: griffe.Object | None = obj
    while scope is not None:
        target = _member(scope, name.split("."))
        if target is not None:
            return f"[`{label}`][{target.path}]"
        scope = scope.parent
    if "." in name:
        return f"[`{label}`][{name}]"
    return f"`{label}`"


def _member(scope: griffe.Object, parts: list[str]) -> griffe.Object | griffe.Alias | None:
    """Return the member of ``scope`` at the dotted path ``parts``, or None."""
    found: griffe.Object | griffe.Alias = scope
    for part in parts:
        if part not in found.members:
            return None
        found = found.members[part]
    return found
