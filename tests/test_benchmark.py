"""The benchmark command runs a scenario end to end in its own scratch databases."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command

from benchmarks import blocked, fanout_pushpin, queues
from benchmarks.harness import (
    STATUS_COUNTS,
    Database,
    Figure,
    Progress,
    Server,
    ServerParams,
    count_label,
    count_mismatches,
    percentile,
)
from tests.processes import databases_named_like

pytestmark = [pytest.mark.slow, pytest.mark.once]

PREFIX = f"bench_test_{os.getpid()}"


def run_quick(only: str, tmp_path: Path) -> tuple[dict[str, Any], str]:
    """Run ``taskboard benchmark --quick --only <only>`` in scratch databases named
    PREFIX_*; return its JSON figures and what it printed."""
    output = tmp_path / "results.json"
    stdout = io.StringIO()
    call_command(
        "benchmark",
        "--quick",
        "--only",
        only,
        "--output",
        str(output),
        "--prefix",
        PREFIX,
        stdout=stdout,
    )
    return json.loads(output.read_text()), stdout.getvalue()


def test_a_figure_passes_or_fails_its_target() -> None:
    assert Figure("ratio", 0.41, "x", ">= 0.4").passed is True
    assert Figure("p99", 120, "ms", "< 100").passed is False
    assert Figure("rate", 12).passed is None
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert [count_label(n) for n in (950, 1_500, 100_000, 1_000_000)] == [
        "950",
        "1,500",
        "100k",
        "1M",
    ]


@pytest.mark.django_db(transaction=True)
def test_the_quick_api_scenario_reports_its_figures_and_drops_its_databases(
    tmp_path: Path,
) -> None:
    data, stdout = run_quick("api", tmp_path)
    (scenario,) = data["scenarios"]
    assert scenario["error"] == ""
    figures = {figure["name"]: figure for figure in scenario["figures"]}
    assert figures["API claim+complete cycles/s"]["value"] > 0
    assert figures["API / raw SQL"]["passed"] in {True, False}
    assert "API / raw SQL" in stdout
    assert databases_named_like(PREFIX) == []


def test_queue_counts_that_differ_from_a_scan_are_reported() -> None:
    counted = {
        "default": dict.fromkeys(STATUS_COUNTS, 0) | {"pending": 2, "blocked": 3},
        "email": dict.fromkeys(STATUS_COUNTS, 0) | {"done": 1},
    }
    agreeing = [
        {"name": "default", "counts": counted["default"]},
        {"name": "email", "counts": counted["email"]},
        {"name": "idle", "counts": dict.fromkeys(STATUS_COUNTS, 0)},
    ]
    assert count_mismatches(counted, agreeing) == []

    blocked_as_pending = {**counted["default"], "pending": 5, "blocked": 0}
    listed = [{"name": "default", "counts": blocked_as_pending}]
    assert count_mismatches(counted, listed) == [
        f"default: listed {blocked_as_pending}, COUNT(*) {counted['default']}",
        f"email: listed {dict.fromkeys(STATUS_COUNTS, 0)}, COUNT(*) {counted['email']}",
    ]


@pytest.mark.django_db(transaction=True)
def test_the_blocked_and_queues_scenarios_run_in_a_tiny_configuration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        blocked, "QUICK", blocked.Sizes(blockers=4, blocked=50, rounds=2, claims=5, warm=1)
    )
    monkeypatch.setattr(queues, "QUICK", queues.Sizes(finished=300, requests=10, warm=2))
    data, stdout = run_quick("blocked,queues", tmp_path)
    scenarios = {scenario["name"]: scenario for scenario in data["scenarios"]}
    assert [scenario["error"] for scenario in scenarios.values()] == ["", ""]
    figures = {
        (name, figure["name"]): figure
        for name, scenario in scenarios.items()
        for figure in scenario["figures"]
    }
    for name, figure in [
        ("blocked", "claim p50, none blocked"),
        ("blocked", "claim p99, 50 blocked"),
        ("blocked", "claim naming its queue p99, 50 blocked"),
        ("queues", "GET queues/ p50, 10 finished"),
        ("queues", "GET queues/ p99, 300 finished"),
    ]:
        assert figures[name, figure]["value"] > 0
    assert figures["blocked", "claim p99 ratio (blocked / none)"]["passed"] in {True, False}
    assert figures["queues", "GET queues/ p50 ratio (large / small)"]["passed"] in {True, False}
    # No claim handed out a blocked task, and the counters agree with the tasks.
    assert figures["blocked", "blocked tasks still blocked / loaded"]["value"] == 1.0
    for scenario in scenarios.values():
        assert "GET queues/ counts equal a COUNT(*) of tasks in both databases" in scenario["notes"]
    assert "GET queues/ p99 ratio (large / small)" in stdout
    assert databases_named_like(PREFIX) == []


def test_the_latencies_of_several_helpers_are_put_together() -> None:
    # Two helpers: 1.0 to 1.9 ms (ten latencies) and 10.0 ms (ten), in 0.1 ms buckets.
    first = {"buckets": {str(10 + i): 1 for i in range(10)}, "unmatched": 0, "max": 1.9}
    second = {"buckets": {"100": 10}, "unmatched": 2, "max": 10.0}

    combined = fanout_pushpin.combine([first, second])

    assert combined["count"] == 20
    assert combined["unmatched"] == 2
    assert combined["p50"] == 10.05  # rank 10 of 20: the second helper's first
    assert combined["histogram"][0] == 1.05
    assert combined["max"] == 10.0


@pytest.mark.skipif(shutil.which("pushpin") is None, reason="pushpin is not installed")
@pytest.mark.django_db(transaction=True)
def test_the_pushpin_fanout_scenario_runs_in_a_tiny_configuration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 400 streams at 50 events/s: 20,000 deliveries a second, 60,000 in all. Pushpin's
    # handler sent at most 2,500 a second with message_rate=2500 and dropped what passed
    # message_hwm=25000: half the events never arrived (deploy/pushpin/pushpin.conf).
    monkeypatch.setattr(fanout_pushpin, "QUICK", fanout_pushpin.Sizes(streams=400, seconds=3))
    data, _ = run_quick("fanout_pushpin", tmp_path)
    (scenario,) = data["scenarios"]
    assert scenario["error"] == ""
    figures = {figure["name"]: figure for figure in scenario["figures"]}
    assert figures["commit-to-delivery p99"]["value"] > 0
    assert figures["events delivered / expected"]["value"] == 1.0
    # Counted per server process (two of them), each holding at least its relay's.
    per_process = figures["server database connections per process (max)"]["value"]
    every = figures["server database connections, 2 processes (max)"]["value"]
    assert 1 <= per_process <= every
    assert figures["server memory per process (max RSS)"]["value"] > 0
    assert databases_named_like(PREFIX) == []


@pytest.mark.django_db(transaction=True)
def test_the_pushpin_fanout_scenario_is_skipped_with_a_note_without_pushpin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no pushpin on it
    data, stdout = run_quick("fanout_pushpin", tmp_path)
    (scenario,) = data["scenarios"]
    assert scenario["error"] == ""
    assert scenario["figures"] == []
    assert scenario["notes"] == [
        "skipped: pushpin is not installed (Debian: apt-get install pushpin)"
    ]
    assert "skipped: pushpin is not installed" in stdout
    assert databases_named_like(PREFIX) == []


def test_a_server_that_fails_to_start_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # serve --pushpin exits at once without pushpin; no database is reached before that.
    monkeypatch.setenv("PATH", str(tmp_path))
    nowhere = ServerParams(host="127.0.0.1", port=9, user="nobody")
    database = Database("nowhere", nowhere, scratch=None)  # type: ignore[arg-type]
    server = Server(database, tmp_path / "server.log", Progress(enabled=False), pushpin=True)

    with pytest.raises(RuntimeError, match="the server exited"):
        server.start(timeout=60)

    assert server.data_dir is not None
    assert not server.data_dir.exists()
    assert "pushpin is not installed" in (tmp_path / "server.log").read_text()


def test_a_stream_that_fails_to_open_is_opened_again_and_reported() -> None:
    # A stand-in server: the first connection is closed before any answer (as Pushpin
    # once closed one of 400 streams it was opening in CI), the others get a stream.
    import socket
    import threading

    from benchmarks.harness import Helper

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    accepted: list[socket.socket] = []

    def serve() -> None:
        for number in range(4):
            connection, _ = listener.accept()
            connection.recv(65536)
            if number == 0:
                connection.close()
                continue
            connection.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n: connected\n\n"
            )
            accepted.append(connection)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    helper = Helper("sse", "--url", f"http://127.0.0.1:{port}", "--token", "t", "--count", "3")
    try:
        ready = helper.read(30)
    finally:
        helper.close()
        listener.close()
        for connection in accepted:
            connection.close()
    assert ready["ready"] == 3
    (reason,) = ready["reopened"]
    assert "stream closed" in reason
