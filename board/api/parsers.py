"""DRF's JSON parser, with the errors it lets through turned into 400s."""

from __future__ import annotations

from typing import Any

from rest_framework import parsers
from rest_framework.exceptions import ParseError


class JSONParser(parsers.JSONParser):
    def parse(self, stream: Any, media_type: Any = None, parser_context: Any = None) -> Any:
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            # json.loads gives up past ~1000 levels of nesting with RecursionError, which
            # DRF (catching ValueError) would let become a 500.
            raise ParseError("JSON parse error - nested too deeply.") from None
