"""The benchmark command runs a scenario end to end in its own scratch databases."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
from django.core.management import call_command

from taskboard.benchmark import blocked, queues
from taskboard.benchmark.harness import (
    STATUS_COUNTS,
    Figure,
    count_label,
    count_mismatches,
    percentile,
)
from tests.processes import databases_named_like

pytestmark = [pytest.mark.slow, pytest.mark.once]


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
    prefix = f"bench_test_{os.getpid()}"
    output = tmp_path / "results.json"
    stdout = io.StringIO()

    call_command(
        "benchmark",
        "--quick",
        "--only",
        "api",
        "--output",
        str(output),
        "--prefix",
        prefix,
        stdout=stdout,
    )

    data = json.loads(output.read_text())
    (scenario,) = data["scenarios"]
    assert scenario["error"] == ""
    figures = {figure["name"]: figure for figure in scenario["figures"]}
    assert figures["API claim+complete cycles/s"]["value"] > 0
    assert figures["API / raw SQL"]["passed"] in {True, False}
    assert "API / raw SQL" in stdout.getvalue()
    assert databases_named_like(prefix) == []


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
    prefix = f"bench_test_{os.getpid()}"
    output = tmp_path / "results.json"
    stdout = io.StringIO()

    call_command(
        "benchmark",
        "--quick",
        "--only",
        "blocked,queues",
        "--output",
        str(output),
        "--prefix",
        prefix,
        stdout=stdout,
    )

    data = json.loads(output.read_text())
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
    assert "GET queues/ p99 ratio (large / small)" in stdout.getvalue()
    assert databases_named_like(prefix) == []
