"""GET /healthz: does the database answer?"""

from __future__ import annotations

import logging

from django.db import DatabaseError, connection
from django.http import HttpRequest, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

logger = logging.getLogger(__name__)


@never_cache
@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    """Return 200 ``{"status": "ok"}`` when the database answers, else 503."""
    # A connection kept from before a database restart fails once: then try a new one,
    # so the first check after the database returns already answers 200.
    for attempt in range(2):
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1")
                cursor.fetchone()
            return JsonResponse({"status": "ok"})
        except DatabaseError as exc:
            connection.close()
            if attempt:
                logger.warning("health check: database unavailable: %s", exc)
    return JsonResponse({"status": "unavailable"}, status=503)
