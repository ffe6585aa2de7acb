"""The README's promise, end to end: ``taskboard serve`` on a fresh data directory boots an
embedded PostgreSQL, prints the first-run secrets once, and serves the API with them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.processes import ROOT, free_port, stop, wait_until_healthy

pytestmark = pytest.mark.slow


def start_server(data_dir: Path, port: int) -> subprocess.Popen[str]:
    env = {**os.environ, "TASKBOARD_DATA_DIR": str(data_dir)}
    env.pop("DATABASE_URL", None)
    return subprocess.Popen(
        [sys.executable, "manage.py", "serve", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "data"


def test_a_first_run_prints_the_secrets_once_and_serves_an_agent(data_dir: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(data_dir, port)
    try:
        wait_until_healthy(url, server)
    finally:
        first_output = stop(server)

    assert "Board       http://127.0.0.1:" in first_output
    assert "/api/v1/docs/" in first_output
    password = re.search(r"admin\s+password (\S+)", first_output)
    token = re.search(r"demo-agent\s+token\s+(\S+)", first_output)
    assert password and token, first_output

    server = start_server(data_dir, port)
    try:
        wait_until_healthy(url, server)
        headers = {"Authorization": f"Bearer {token[1]}"}
        created = httpx.post(f"{url}/api/v1/tasks/", json={"title": "hello"}, headers=headers)
        assert created.status_code == 201, created.text
        claimed = httpx.post(f"{url}/api/v1/tasks/claim/", json={}, headers=headers).json()
        assert [task["id"] for task in claimed["tasks"]] == [created.json()["id"]]
        assert claimed["tasks"][0]["leased_by"] == "demo-agent"
        login = httpx.get(f"{url}/admin/login/")
        assert login.status_code == 200
    finally:
        second_output = stop(server)

    assert "password" not in second_output, "the secrets are printed on the first run only"
