"""MkDocs hooks: put the committed OpenAPI document into the site, for the HTTP API page.

The document is ``board/api/openapi.yaml`` (``tests/test_schema.py`` fails when the served
one differs from it), so the reference renders exactly what the server answers, and no copy
is kept under ``docs/``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

OPENAPI = Path(__file__).resolve().parents[2] / "board" / "api" / "openapi.yaml"


def on_files(files: Files, config: Any) -> Files:
    files.append(File.generated(config, "reference/openapi.yaml", abs_src_path=str(OPENAPI)))
    return files
