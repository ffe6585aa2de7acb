"""``taskboard soak`` runs its mixed load against a server it starts, prints the server's
memory, file descriptors and connections over time, and drops its scratch databases."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
from django.core.management import call_command

from tests.processes import databases_named_like

pytestmark = [pytest.mark.slow, pytest.mark.once]


@pytest.mark.django_db(transaction=True)
def test_a_short_soak_with_an_abusive_agent_prints_the_servers_resources_and_no_server_error(
    tmp_path: Path,
) -> None:
    prefix = f"soak_test_{os.getpid()}"
    output = tmp_path / "results.json"
    stdout = io.StringIO()

    call_command(
        "soak",
        "--seconds",
        "4",
        "--interval",
        "1",
        "--agents",
        "2",
        "--streams",
        "3",
        "--output",
        str(output),
        "--prefix",
        prefix,
        stdout=stdout,
    )

    text = stdout.getvalue()
    assert text.count(" req/s | RSS ") >= 4, text
    for figure in ("server RSS", "open file descriptors", "database connections"):
        assert figure in text
    data = json.loads(output.read_text())
    assert data["server_errors"] == {}
    assert data["actions"]["create"] > 0 and data["actions"]["complete"] > 0
    assert data["actions"]["stream"] > 0 and data["actions"]["read"] > 0
    # The abusive agent ran beside them: a 900 kB task flooded with heartbeats, comments,
    # queues; the largest server process's memory is reported with the sum.
    assert data["abuse"] is True
    for abuse in ("huge task", "heartbeat", "comment", "queue"):
        assert data["actions"][f"abuse: {abuse}"] > 0, data["actions"]
    assert "largest process RSS" in text
    assert all(sample["largest_rss_mb"] > 0 for sample in data["samples"])
    assert all(sample["rss_mb"] > 0 and sample["fds"] > 0 for sample in data["samples"])
    # The server processes' sockets are counted: the load's connections add to the idle
    # server's (counting ``serve`` alone, which only listens, it stayed flat).
    assert max(sample["fds"] for sample in data["samples"]) > data["samples"][0]["fds"]
    assert max(sample["connections"] for sample in data["samples"]) >= 1
    assert databases_named_like(prefix) == []
