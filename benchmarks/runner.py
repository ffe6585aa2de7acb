"""Run the scenarios, print the table, write the JSON (and the charts)."""

from __future__ import annotations

import datetime
import importlib
import json
import logging
import os
import platform
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    Database,
    Progress,
    ScenarioResult,
    Scratch,
    Server,
    ServerParams,
    format_value,
)

# In running order: the cheap ones first.
SCENARIOS = [
    "api",
    "peer",
    "history",
    "blocked",
    "queues",
    "fanout",
    "fanout_pushpin",
    "waiting",
    "churn",
]


@dataclass
class Context:
    quick: bool
    scratch: Scratch
    progress: Progress
    output_dir: Path
    notes: list[str] = field(default_factory=list)

    def pick(self, quick: Any, full: Any) -> Any:
        return quick if self.quick else full

    def database(self, scenario: str) -> Any:
        return self.scratch.database(scenario)

    def use(self, database: Database) -> None:
        """Point Django's default connection at ``database``, one of several held open."""
        self.scratch.use(database.name)

    def server(self, database: Database, **options: Any) -> Server:
        """The server under test on ``database``: ``serve``'s defaults, unless ``options``
        (Server's ``workers``, ``pushpin``) say otherwise."""
        return Server(database, self.output_dir / "server.log", self.progress, **options)


def machine() -> dict[str, Any]:
    import psutil

    return {
        "cpus": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def run(
    *,
    quick: bool,
    only: list[str] | None,
    server: ServerParams,
    application_database: str | None,
    output: Path,
    plot: bool,
    keep: bool,
    in_place: bool = False,
    prefix: str = "taskboard_bench",
    stdout: Any = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Run the chosen scenarios in scratch databases and report; return the results."""
    stdout = stdout or sys.stdout
    # One line per request from the load generators would cost more than the requests.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    progress = progress or Progress()
    names = only or SCENARIOS
    unknown = [name for name in names if name not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}; choose from {SCENARIOS}")
    output.parent.mkdir(parents=True, exist_ok=True)
    scratch = Scratch(server, prefix, progress, keep, in_place=in_place)
    context = Context(quick, scratch, progress, output.parent)
    version = scratch.server_version()
    progress(
        f"{'quick' if quick else 'full'} run of {', '.join(names)} on PostgreSQL {version} "
        f"({server.host}{':' + str(server.port) if server.port else ''})"
    )
    results: list[ScenarioResult] = []
    started = time.monotonic()
    try:
        scratch.prepare_template(application_database)
        for name in names:
            module = importlib.import_module(f"benchmarks.{name}")
            result = ScenarioResult(name, module.TITLE)
            progress.scenario = name
            began = time.monotonic()
            try:
                module.run(context, result)
            except Exception as exc:
                result.error = f"{type(exc).__name__}: {exc}"
                progress(f"FAILED: {result.error}")
                traceback.print_exc(file=sys.stderr)
            result.seconds = time.monotonic() - began
            progress(f"done in {result.seconds:.0f} s")
            progress.scenario = ""
            results.append(result)
    finally:
        scratch.restore()
    data = {
        "quick": quick,
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "seconds": round(time.monotonic() - started, 1),
        "postgresql": version,
        "machine": machine(),
        "scenarios": [result.to_json() for result in results],
    }
    output.write_text(json.dumps(data, indent=2) + "\n")
    stdout.write(table(data))
    stdout.write(f"\nFigures written to {output}\n")
    if plot:
        from benchmarks import plot as plotting

        for path in plotting.plot(data, output.parent):
            stdout.write(f"Chart written to {path}\n")
    return data


def table(data: dict[str, Any]) -> str:
    """Return the results as a plain-text table, a figure a line, targets beside them."""
    m = data["machine"]
    lines = [
        "",
        f"taskboard benchmark ({'quick' if data['quick'] else 'full'} run, {data['seconds']:.0f} s)"
        f" on {m['cpus']} CPUs, {m['memory_gb']} GB, PostgreSQL {data['postgresql']}",
        "",
        f"{'figure':<54} {'value':>14}  {'target':<12} result",
        "-" * 90,
    ]
    for scenario in data["scenarios"]:
        lines.append(scenario["title"])
        if scenario["error"]:
            lines.append(f"  ERROR {scenario['error']}")
        for figure in scenario["figures"]:
            value = format_value(figure["value"], figure["unit"])
            target = ""
            if figure["target"]:
                op, _, bound = figure["target"].partition(" ")
                target = f"{op} {format_value(float(bound), figure['unit'])}"
            verdict = {True: "PASS", False: "FAIL", None: ""}[figure["passed"]]
            lines.append(f"  {figure['name']:<52} {value:>14}  {target:<12} {verdict}".rstrip())
        for note in scenario["notes"]:
            lines.append(f"  - {note}")
        lines.append("")
    verdicts = [
        f["passed"] for s in data["scenarios"] for f in s["figures"] if f["passed"] is not None
    ]
    errors = sum(1 for s in data["scenarios"] if s["error"])
    lines.append(
        f"{verdicts.count(True)} targets passed, {verdicts.count(False)} failed"
        + (f", {errors} scenario(s) did not finish" if errors else "")
    )
    return "\n".join(lines) + "\n"
