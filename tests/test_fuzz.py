"""Hold the server to its OpenAPI document with schemathesis, as an outsider would run it:
every check (``--checks all``: server errors, status codes, headers and bodies as
documented, schema-invalid data refused and schema-valid data accepted, credentials never
ignored, resources available once created) in every phase, the stateful one included,
which follows the document's links from a created or claimed task to its actions with a
live lease.

The fuzzer is the ``st`` command, run as another process against a server in a third
one (``uvicorn``, on the test database), both configured in tests/schemathesis.toml and
tests/schemathesis_hooks.py. Any finding fails the test and is printed; the one exception
is the response time of a claim that waits. Generation is deterministic: a run repeats.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from io import StringIO
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import connection

from board import transitions
from board.models import TaskEvent
from tests.live import free_port

pytestmark = [pytest.mark.slow, pytest.mark.once, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "tests" / "schemathesis.toml"
ST = Path(sys.executable).with_name("st")
PHASES = "examples,coverage,fuzzing,stateful"

# The server's environment, beyond its database: settings that would otherwise stop the
# fuzzer go here (the fuzzer fails authentication on purpose, hundreds of times a minute).
SERVER_ENVIRONMENT: dict[str, str] = {
    # Its 429 is stated in the document and tested in tests/test_tokens.py.
    "TASKBOARD_AUTH_FAILURE_LIMIT": "0",
    # Nor are its creates and comments refused for their rate (tests/test_rates.py): the
    # fuzzer makes them as fast as the server answers.
    "TASKBOARD_CREATE_RATE": "0",
    "TASKBOARD_COMMENT_RATE": "0",
    # The fuzzer adds webhooks to any URL the schema admits (http://16777217 is a public
    # address): their deliveries go to a proxy that refuses them, never out of the machine.
    **dict.fromkeys(("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"), "http://127.0.0.1:9"),
    "NO_PROXY": "",
    # The schema's URL pattern admits hosts such as 0 and 127.1, which the server refuses
    # (400) unless private addresses are allowed: tested in tests/test_webhooks.py.
    "TASKBOARD_WEBHOOK_ALLOW_PRIVATE": "true",
}

HOLDER_EVENTS = {"heartbeat", "completed", "failed", "released", "escalated"}


def database_url() -> str:
    """A DATABASE_URL naming the test database, also on the embedded server's socket."""
    params = connection.get_connection_params()
    user = quote(str(params.get("user") or ""), safe="")
    password = quote(str(params.get("password") or ""), safe="")
    credentials = f"{user}:{password}@" if password else f"{user}@"
    host = quote(str(params.get("host") or "localhost"), safe="")
    port = f":{params['port']}" if params.get("port") else ""
    return f"postgresql://{credentials}{host}{port}/{params['dbname']}"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[str]:
    """uvicorn serving the ASGI application on the test database, in a process of its own."""
    port = free_port()
    env = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "SECRET_KEY": "fuzz-test-secret-key",
        "DEBUG": "false",
        "LOG_LEVEL": "WARNING",
        **SERVER_ENVIRONMENT,
    }
    log = (tmp_path / "server.log").open("w")
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "uvicorn", "taskboard.asgi:application"),
            *("--port", str(port), "--no-access-log"),
        ],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start:\n" + server_log(tmp_path))
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def server_log(tmp_path: Path) -> str:
    return (tmp_path / "server.log").read_text()[-20_000:]


@pytest.fixture
def fuzzer_token(db: None) -> str:
    """The token of a superuser (every action is open to it), and a few tasks to aim at."""
    out = StringIO()
    call_command("create_agent", "fuzzer", stdout=out)
    token = out.getvalue().strip().splitlines()[-1]
    user = get_user_model().objects.get(username="fuzzer")
    user.is_staff = user.is_superuser = True
    user.save()
    for n in range(3):
        transitions.create(actor=user, title=f"fuzz {n}", queue="fuzz")
    [held] = transitions.claim(actor=user, queues=["fuzz"], lease_seconds=600)
    transitions.escalate(task_id=held.task.id, actor=user, lease_token=held.lease_token, reason="x")
    return token


def test_schemathesis_with_every_check_finds_nothing(
    server: str, fuzzer_token: str, tmp_path: Path
) -> None:
    report_path = tmp_path / "report.json"
    command = [
        str(ST),
        "--config-file",
        str(CONFIG),
        "run",
        f"{server}/api/v1/schema/",
        "--checks",
        "all",
        "--phases",
        PHASES,
        "--no-color",
        "--report",
        "json",
        "--report-json-path",
        str(report_path),
    ]
    env = {**os.environ, "TASKBOARD_FUZZ_TOKEN": fuzzer_token, "PYTHONPATH": str(ROOT)}
    last_event = TaskEvent.objects.order_by("-id").values_list("id", flat=True).first()

    started = time.monotonic()
    run = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    elapsed = time.monotonic() - started

    output = run.stdout + run.stderr
    findings = f"{output}\n--- server log ---\n{server_log(tmp_path)}"
    assert report_path.exists(), findings
    report: dict[str, Any] = json.loads(report_path.read_text())
    print(
        f"schemathesis: {report['operations']['tested']} operations, "
        f"{report['test_cases']['generated']} test cases in {elapsed:.0f} s"
    )
    assert report["failures"] == [], findings
    assert report["errors"] == [], findings
    assert run.returncode == 0, findings
    assert report["operations"]["tested"] == report["operations"]["total"], findings
    for phase in PHASES.split(","):
        assert report["phases"][phase]["status"] == "success", (phase, findings)
    # The links led the stateful phase to the holder actions, with a live lease: most of
    # them in any run (which ones varies with the server's answers, which feed generation).
    reached = set(
        TaskEvent.objects.filter(
            id__gt=last_event, actor="fuzzer", type__in=HOLDER_EVENTS
        ).values_list("type", flat=True)
    )
    print(f"holder actions reached with a live lease: {sorted(reached)}")
    assert len(reached) >= 3, (sorted(reached), findings)
