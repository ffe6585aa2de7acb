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
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except DatabaseError as exc:
        logger.warning("health check: database unavailable: %s", exc)
        # Drop the broken connection now, so the next request connects afresh.
        connection.close_if_unusable_or_obsolete()
        return JsonResponse({"status": "unavailable"}, status=503)
    return JsonResponse({"status": "ok"})
