"""MkDocs hooks: put the committed OpenAPI document into the site, for the HTTP API page,
and the table of every setting into the settings page.

The document is ``board/api/openapi.yaml`` (``tests/test_schema.py`` fails when the served
one differs from it), so the reference renders exactly what the server answers, and no copy
is kept under ``docs/``. The settings' table is what ``taskboard configuration`` prints,
made from their declarations in ``board/conf.py``, so that it cannot differ from them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mkdocs.structure.files import Files

ROOT = Path(__file__).resolve().parents[2]
OPENAPI = ROOT / "board" / "api" / "openapi.yaml"
# Where the settings page takes the table.
SETTINGS_TABLE = "<!-- the settings' table: board.conf.markdown_table() -->"


def on_files(files: Files, config: Any) -> Files:
    # Imported here: tests/test_conf.py reads this module where MkDocs is not installed.
    from mkdocs.structure.files import File

    files.append(File.generated(config, "reference/openapi.yaml", abs_src_path=str(OPENAPI)))
    return files


def with_settings_table(markdown: str) -> str:
    """Return ``markdown`` with the settings' table where it has its marker."""
    if SETTINGS_TABLE not in markdown:
        return markdown
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from board import conf

    return markdown.replace(SETTINGS_TABLE, conf.markdown_table())


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    return with_settings_table(markdown)
