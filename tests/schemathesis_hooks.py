"""schemathesis hooks for tests/test_fuzz.py (loaded through tests/schemathesis.toml).

They bound the run, never what is checked:
- a claim that may wait waits at most ``MAX_WAIT`` seconds (the schema allows 60), so the
  run takes minutes, not hours, while a claim still waits for real;
- the response time of a claim that waits is the one failure let through: waiting is what
  it was asked to do.
"""

from __future__ import annotations

from typing import Any

import schemathesis
from schemathesis.core.failures import ResponseTimeExceeded

MAX_WAIT = 1.0
CLAIM_PATH = "/api/v1/tasks/claim/"


def _wait(body: Any) -> float | None:
    """The ``wait`` of a claim body when it is a valid, positive number of seconds."""
    if not isinstance(body, dict):
        return None
    wait = body.get("wait")
    if isinstance(wait, bool) or not isinstance(wait, int | float):
        return None
    return float(wait) if 0 < wait <= 60 else None


@schemathesis.hook
def map_body(context: Any, body: Any) -> Any:
    operation = context.operation
    if operation is not None and operation.path == CLAIM_PATH:
        wait = _wait(body)
        if wait is not None and wait > MAX_WAIT:
            return {**body, "wait": MAX_WAIT}
    return body


@schemathesis.hook
def filter_failure(context: Any, failure: Any, case: Any, response: Any) -> bool:
    """Keep every failure but the response time of a claim that waits."""
    return not (
        isinstance(failure, ResponseTimeExceeded)
        and case.operation.path == CLAIM_PATH
        and _wait(case.body) is not None
    )
