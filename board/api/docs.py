"""The views of the OpenAPI document (``schema/``) and of its interactive page (``docs/``):
drf-spectacular's, whose refusals are the API's JSON errors. The document itself is made
in board.api.schema (which drf-spectacular's settings import, so that the views, which
import the settings, cannot live there)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response


class JSONRefusals:
    """Render a refusal (and the answer to OPTIONS) as JSON, as every other endpoint of the
    API does, in a drf-spectacular view.

    Its views render whatever they answer with their own renderers: a POST, an unknown
    ``?format=`` or an ``Accept`` they cannot serve got the error in YAML from the schema,
    and OPTIONS (no template for DRF's metadata) a 500 from the docs.
    """

    def finalize_response(self, request: Request, response: Any, *args: Any, **kwargs: Any) -> Any:
        response = super().finalize_response(request, response, *args, **kwargs)  # type: ignore[misc]
        if isinstance(response, Response) and (
            response.status_code >= 400 or request.method == "OPTIONS"
        ):
            response.accepted_renderer = JSONRenderer()
            response.accepted_media_type = JSONRenderer.media_type
        return response


class SchemaView(JSONRefusals, SpectacularAPIView):
    """GET schema/: this document, in YAML (``?format=json``: JSON)."""


class DocsView(JSONRefusals, SpectacularSwaggerSplitView):
    """GET docs/: Swagger UI on the document (its start-up script served as a file, not
    inline, so that the Content-Security-Policy of TASKBOARD_HTTPS needs no
    'unsafe-inline' for scripts)."""
