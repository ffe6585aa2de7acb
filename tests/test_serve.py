"""The README's promise, end to end: ``taskboard serve`` on a fresh data directory boots an
embedded PostgreSQL, prints the first-run secrets once, and serves the API with them."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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


def wait_until_healthy(url: str, server: subprocess.Popen[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(
                f"the server exited: {server.stdout.read() if server.stdout else ''}"
            )
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not become healthy in time")


def stop(server: subprocess.Popen[str]) -> str:
    server.terminate()
    try:
        output, _ = server.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        output, _ = server.communicate()
    return output


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
