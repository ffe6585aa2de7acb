"""GET /healthz: does the database answer, and in time?

The check runs on a thread of its own, on a connection of its own made the way requests
make theirs (Django's engine: through PgBouncer where ``DATABASE_URL`` goes through it),
closed after ``SELECT 1``; the request waits for it at most
``TASKBOARD_HEALTH_TIMEOUT`` seconds. A database that hangs (its server stopped, a network
that drops packets) answers nothing and refuses nothing, and nothing else bounds a query on
a connection that is open: before, the check waited on the request thread's kept
connection for as long as the database hung, and a load balancer's probe timed out where
it should have read 503.

Requests that come while a check is under way wait for its answer instead of starting
their own, for as long as it is younger than the timeout. A check that has hung longer is
left to itself (a daemon thread, which does not hold up the process's exit) and the next
request starts another, so that the first probe after the database is back answers 200;
at most ``MAX_HUNG_CHECKS`` hang at once, beyond which a request answers 503 at once.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from django.db import DatabaseError, connections
from django.http import HttpRequest, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.csrf import csrf_exempt

from board import conf
from board.http.errors import error_response

logger = logging.getLogger(__name__)

MAX_HUNG_CHECKS = 4


@dataclass
class Check:
    started: float = field(default_factory=time.monotonic)
    answer: Future[None] = field(default_factory=Future)

    def run(self) -> None:
        """Connect, ``SELECT 1``, and close (on this check's thread: its own connection)."""
        try:
            with connections["default"].cursor() as cursor:
                cursor.execute("SELECT 1")
                cursor.fetchone()
        except BaseException as exc:
            self.answer.set_exception(exc)
        else:
            self.answer.set_result(None)
        finally:
            connections.close_all()


_lock = threading.Lock()
_checks: list[Check] = []  # under way, oldest first


def current_check(timeout: float) -> Check | None:
    """The check under way that is younger than ``timeout``, or a new one; None when
    ``MAX_HUNG_CHECKS`` older ones still hang."""
    with _lock:
        _checks[:] = [check for check in _checks if not check.answer.done()]
        now = time.monotonic()
        if _checks and now - _checks[-1].started < timeout:
            return _checks[-1]
        if len(_checks) >= MAX_HUNG_CHECKS:
            return None
        check = Check()
        _checks.append(check)
    threading.Thread(target=check.run, name="healthz", daemon=True).start()
    return check


@csrf_exempt  # nothing to protect; any other method gets the JSON 405 below, not CSRF's page
@never_cache
def healthz(request: HttpRequest) -> JsonResponse:
    """Return 200 ``{"status": "ok"}`` when the database answers in time, else 503."""
    if request.method not in ("GET", "HEAD"):  # HEAD: the probe of many load balancers
        detail = f'Method "{request.method}" not allowed.'
        refused = error_response(405, "method_not_allowed", detail)
        refused["Allow"] = "GET, HEAD"
        return refused
    timeout = conf.health_timeout()
    check = current_check(timeout)
    try:
        if check is None:
            raise TimeoutError
        check.answer.result(timeout=max(0.0, check.started + timeout - time.monotonic()))
    except TimeoutError:
        logger.warning("health check: the database did not answer within %s s", timeout)
    except DatabaseError as exc:
        logger.warning("health check: database unavailable: %s", exc)
    else:
        return JsonResponse({"status": "ok"})
    return JsonResponse({"status": "unavailable"}, status=503)
