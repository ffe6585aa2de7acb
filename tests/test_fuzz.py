"""Fuzz the API against its own OpenAPI document with schemathesis: on every endpoint, with
an authenticated staff user, no input may cause a 5xx or a response that breaks the schema.

The document is the committed one (tests/test_schema.py checks it is the served one), the
server is the real ASGI application under uvicorn, on the test database.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi import checks as openapi_checks

from board import transitions
from tests.factories import StaffFactory, TokenFactory, grant
from tests.live import LiveServer, live_server

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

SCHEMA = Path(__file__).resolve().parent.parent / "board" / "api" / "openapi.yaml"
schema = schemathesis.openapi.from_path(SCHEMA).exclude(path="/api/v1/stream/")

CHECKS = [
    schemathesis.checks.not_a_server_error,
    openapi_checks.response_schema_conformance,
    openapi_checks.content_type_conformance,
]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server() as running:
        yield running


@pytest.fixture
def board(db: None) -> dict[str, Any]:
    """A staff user with a token, and tasks in every state for the fuzzer to aim at."""
    # With the triage permission, so that requeue, resolve and cancel get past the 403.
    staff = grant(StaffFactory(username="fuzzer"), "escalations.triage_task")
    token = TokenFactory(user=staff).key
    for n in range(4):
        transitions.create(actor=staff, title=f"fuzz {n}", queue="fuzz")
    [held] = transitions.claim(actor=staff, queues=["fuzz"], lease_seconds=600)
    [escalating] = transitions.claim(actor=staff, queues=["fuzz"], lease_seconds=600)
    transitions.escalate(
        task_id=escalating.task.id, actor=staff, lease_token=escalating.lease_token, reason="x"
    )
    [finishing] = transitions.claim(actor=staff, queues=["fuzz"], lease_seconds=600)
    transitions.complete(task_id=finishing.task.id, actor=staff, lease_token=finishing.lease_token)
    ids = [held.task.id, escalating.task.id, finishing.task.id, held.task.id + 1000]
    return {"headers": {"Authorization": f"Bearer {token}"}, "ids": ids, "token": held.lease_token}


@schema.parametrize()
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_no_input_breaks_the_api(case: Any, server: LiveServer, board: dict[str, Any]) -> None:
    chooser = random.Random(repr(case.path_parameters) + repr(case.body))
    # Aim a share of the cases at tasks that exist and at the live lease.
    if case.path_parameters and "id" in case.path_parameters and chooser.random() < 0.7:
        case.path_parameters = {**case.path_parameters, "id": chooser.choice(board["ids"])}
    if isinstance(case.body, dict):
        if "lease_token" in case.body and chooser.random() < 0.5:
            case.body = {**case.body, "lease_token": board["token"]}
        wait = case.body.get("wait")
        if isinstance(wait, int | float) and not isinstance(wait, bool) and 0 < wait <= 60:
            case.body = {**case.body, "wait": 0.05}  # keep waiting claims short
    case.call_and_validate(base_url=server.url, headers=board["headers"], checks=CHECKS)
