"""The benchmark command runs a scenario end to end in its own scratch databases."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
from django.core.management import call_command

from taskboard.benchmark.harness import Figure, percentile
from tests.processes import databases_named_like

pytestmark = [pytest.mark.slow, pytest.mark.once]


def test_a_figure_passes_or_fails_its_target() -> None:
    assert Figure("ratio", 0.41, "x", ">= 0.4").passed is True
    assert Figure("p99", 120, "ms", "< 100").passed is False
    assert Figure("rate", 12).passed is None
    assert percentile([1, 2, 3, 4], 50) == 2.5


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
