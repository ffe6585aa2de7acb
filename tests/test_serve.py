"""The README's promise, end to end: ``taskboard serve`` on a fresh data directory boots an
embedded PostgreSQL, prints the first-run secrets once, and serves the API with them."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from tests.processes import ServeProcess, free_port

pytestmark = pytest.mark.slow


def test_a_first_run_prints_the_secrets_once_and_serves_an_agent(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = ServeProcess(tmp_path / "first.log", data_dir=data_dir, migrate=True, port=port)
    try:
        server.wait_healthy()
    finally:
        server.stop()
    first_output = server.output

    assert "Board       http://127.0.0.1:" in first_output
    assert "/api/v1/docs/" in first_output
    password = re.search(r"admin\s+password (\S+)", first_output)
    token = re.search(r"demo-agent\s+token\s+(\S+)", first_output)
    assert password and token, first_output

    server = ServeProcess(tmp_path / "second.log", data_dir=data_dir, migrate=True, port=port)
    try:
        server.wait_healthy()
        headers = {"Authorization": f"Bearer {token[1]}"}
        created = httpx.post(f"{url}/api/v1/tasks/", json={"title": "hello"}, headers=headers)
        assert created.status_code == 201, created.text
        claimed = httpx.post(f"{url}/api/v1/tasks/claim/", json={}, headers=headers).json()
        assert [task["id"] for task in claimed["tasks"]] == [created.json()["id"]]
        assert claimed["tasks"][0]["leased_by"] == "demo-agent"
        login = httpx.get(f"{url}/admin/login/")
        assert login.status_code == 200
    finally:
        server.stop()
    second_output = server.output

    assert "password" not in second_output, "the secrets are printed on the first run only"
