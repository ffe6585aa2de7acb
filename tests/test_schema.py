"""The served OpenAPI document is the committed one: the contract cannot drift silently."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from django.test import Client

COMMITTED = Path(__file__).resolve().parent.parent / "board" / "api" / "openapi.yaml"
REGENERATE = (
    "python manage.py spectacular --api-version v1 --validate --fail-on-warn "
    "--file board/api/openapi.yaml"
)


@pytest.mark.django_db
def test_the_served_schema_is_the_committed_schema() -> None:
    response = Client().get("/api/v1/schema/")

    assert response.status_code == 200
    served = yaml.safe_load(response.content)
    committed = yaml.safe_load(COMMITTED.read_text())
    assert served == committed, (
        f"The API's schema differs from {COMMITTED.name}. If the change is intended, "
        f"regenerate it with: {REGENERATE}"
    )


@pytest.mark.django_db
def test_the_schema_and_the_docs_need_no_login() -> None:
    client = Client()

    assert client.get("/api/v1/schema/?format=json").status_code == 200
    docs = client.get("/api/v1/docs/")
    assert docs.status_code == 200
    assert b"swagger-ui" in docs.content


def test_the_committed_schema_covers_every_contract_endpoint() -> None:
    paths = yaml.safe_load(COMMITTED.read_text())["paths"]
    expected = {
        ("/api/v1/tasks/", "post"),
        ("/api/v1/tasks/", "get"),
        ("/api/v1/tasks/{id}/", "get"),
        ("/api/v1/tasks/claim/", "post"),
        *(
            (f"/api/v1/tasks/{{id}}/{verb}/", "post")
            for verb in [
                "heartbeat",
                "complete",
                "fail",
                "release",
                "escalate",
                "requeue",
                "resolve",
                "cancel",
            ]
        ),
        ("/api/v1/tasks/{id}/events/", "get"),
        ("/api/v1/events/", "get"),
    }
    present = {(path, method) for path, item in paths.items() for method in item}
    assert expected <= present, f"missing from the schema: {sorted(expected - present)}"
