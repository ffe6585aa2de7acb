"""GET /healthz: does the database answer, and in time?

The check runs on a thread of its own, on a connection of its own made the way requests
make theirs (Django's engine: through PgBouncer where ``DATABASE_URL`` goes through it),
closed after ``SELECT 1``; the request waits for it at most
``TASKBOARD_HEALTH_TIMEOUT`` seconds. A database that hangs (its server stopped, a network
that drops packets) answers nothing and refuses nothing, and nothing else bounds a query on
a connection that is open: before, the check waited on the request thread's kept
connection for as long as the database hung, and a load balancer's probe timed out where
it should have read 503.

One check runs at a time. Requests that come while it runs wait for its answer instead of
starting their own, so a database that hangs holds one thread here, not one per probe.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from django.conf import settings
from django.db import DatabaseError, connections
from django.http import HttpRequest, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

logger = logging.getLogger(__name__)

_checker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="healthz")
_lock = threading.Lock()
_running: Future[None] | None = None


def _select_one() -> None:
    """Connect, ``SELECT 1``, and close (on the checker's thread: its own connection)."""
    try:
        with connections["default"].cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    finally:
        connections.close_all()


def _check() -> Future[None]:
    """The check under way, or a new one when none is."""
    global _running
    with _lock:
        if _running is None or _running.done():
            _running = _checker.submit(_select_one)
        return _running


@never_cache
@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    """Return 200 ``{"status": "ok"}`` when the database answers in time, else 503."""
    timeout = settings.TASKBOARD_HEALTH_TIMEOUT
    try:
        _check().result(timeout=timeout)
    except TimeoutError:
        logger.warning("health check: the database did not answer within %s s", timeout)
    except DatabaseError as exc:
        logger.warning("health check: database unavailable: %s", exc)
    else:
        return JsonResponse({"status": "ok"})
    return JsonResponse({"status": "unavailable"}, status=503)
