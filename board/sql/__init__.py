"""Named SQL statements, kept together in ``.sql`` files next to this module.

A file holds blocks that start with ``-- name: <name>`` followed by comment lines that
describe the statement; :data:`QUERIES` maps each name to its SQL, loaded once at import.
"""

from __future__ import annotations

import re
from pathlib import Path

_NAME = re.compile(r"^-- name: (?P<name>\w+)\s*$", re.MULTILINE)
_COMMENT = re.compile(r"^\s*--")


def load(path: Path) -> dict[str, str]:
    """Return the named statements of one ``.sql`` file."""
    text = path.read_text()
    matches = list(_NAME.finditer(text))
    queries: dict[str, str] = {}
    for match, following in zip(matches, [*matches[1:], None], strict=True):
        end = following.start() if following else len(text)
        # Comment lines document the statement for readers; they are not sent to the server
        # (psycopg would read a percent sign in them as a placeholder).
        lines = [line for line in text[match.end() : end].splitlines() if not _COMMENT.match(line)]
        queries[match["name"]] = "\n".join(lines).strip().rstrip(";")
    return queries


QUERIES: dict[str, str] = {}
for _file in sorted(Path(__file__).parent.glob("*.sql")):
    QUERIES.update(load(_file))
