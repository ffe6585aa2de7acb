"""DRF's JSON parser, with the errors it lets through turned into 400s, and a body parsed
in front of Django (a waiting claim's, board.live.waiting) taken as it was parsed."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from rest_framework import parsers
from rest_framework.exceptions import ParseError

from board.http.asgi_tools import json_body


class JSONParser(parsers.JSONParser):
    def parse(self, stream: Any, media_type: Any = None, parser_context: Any = None) -> Any:
        context = parser_context or {}
        request = context.get("request")
        if request is not None and self.strict:
            encoding = context.get("encoding", settings.DEFAULT_CHARSET)
            if (parsed := json_body(request.META, encoding)) is not None:
                return parsed.data
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            # json.loads gives up past ~1000 levels of nesting with RecursionError, which
            # DRF (catching ValueError) would let become a 500.
            raise ParseError("JSON parse error - nested too deeply.") from None
