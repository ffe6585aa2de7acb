"""schemathesis hooks for tests/test_fuzz.py (loaded through tests/schemathesis.toml).

They bound the run, never what is checked:
- a claim that may wait waits at most ``MAX_WAIT`` seconds (the schema allows 60), so the
  run takes minutes, not hours, while a claim still waits for real;
- the response time of a claim that waits is the one failure let through: waiting is what
  it was asked to do;
- an ``assignee`` (of a create or an ask) names a user who exists, the fuzzer's own, and
  the refusal of one that names nobody is let through: the schema cannot say which names
  exist, and the contract refuses such a name with 400 (tests/test_api_questions.py
  checks that refusal).
"""

from __future__ import annotations

from typing import Any

import schemathesis
from schemathesis.core.failures import ResponseTimeExceeded

MAX_WAIT = 1.0
CLAIM_PATH = "/api/v1/tasks/claim/"
ASSIGNING_PATHS = {"/api/v1/tasks/", "/api/v1/tasks/{id}/ask/"}
FUZZER = "fuzzer"  # tests/test_fuzz.py's user


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
    if (
        operation is not None
        and operation.path in ASSIGNING_PATHS
        and isinstance(body, dict)
        and isinstance(body.get("assignee"), str)
    ):
        return {**body, "assignee": FUZZER}
    return body


@schemathesis.hook
def filter_failure(context: Any, failure: Any, case: Any, response: Any) -> bool:
    """Keep every failure but the response time of a claim that waits, and the refusal of
    an assignee that names nobody."""
    if (
        isinstance(failure, ResponseTimeExceeded)
        and case.operation.path == CLAIM_PATH
        and _wait(case.body) is not None
    ):
        return False
    return not (
        case.operation.path in ASSIGNING_PATHS
        and response is not None
        and response.status_code == 400
        and b"No user is named" in (response.content or b"")
        and b'"fields":{"assignee":' in (response.content or b"")
    )
