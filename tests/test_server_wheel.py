"""The server's wheel: its packages, and neither the benchmark (a tool of the repository,
benchmarks/, run from a checkout) nor the agent's package (its own distribution, agent/,
which the server depends on). From that wheel, ``taskboard benchmark`` says in one line to
run it from a checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests import processes
from tests.processes import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.once]

# What the server's build reads, and benchmarks/ and agent/ beside it, as in a checkout.
SOURCE = ("pyproject.toml", "README.md", "taskboard", "board", "access", "escalations")
BESIDE = ("benchmarks", "agent")
BUILT = ("__pycache__", "*.egg-info", "build", "dist", ".pytest_cache")


@pytest.fixture(scope="module")
def server_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the server's wheel from a copy of the checkout (the build writes into its
    source directory: not into the developer's own checkout) and return it."""
    checkout = tmp_path_factory.mktemp("checkout")
    for part in (*SOURCE, *BESIDE):
        if (ROOT / part).is_dir():
            shutil.copytree(ROOT / part, checkout / part, ignore=shutil.ignore_patterns(*BUILT))
        else:
            shutil.copy(ROOT / part, checkout / part)
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(checkout)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = out.glob("taskboard-*.whl")
    return wheel


def test_the_server_wheel_holds_no_benchmark_and_nothing_of_the_agent(server_wheel: Path) -> None:
    names = zipfile.ZipFile(server_wheel).namelist()
    packages = {name.split("/")[0] for name in names if "/" in name}

    assert {"taskboard", "board", "access", "escalations"} <= packages
    assert "taskboard/commands.py" in names and "board/models.py" in names
    # The commands that find benchmarks/ in a checkout (taskboard.repository), and no more.
    assert [name for name in names if "benchmark" in name or "soak" in name] == [
        "taskboard/management/commands/benchmark.py",
        "taskboard/management/commands/soak.py",
    ]
    assert not [name for name in names if name.startswith("taskboard_agent/")]
    for module in ("client", "worker", "console", "mcp_server", "cli"):
        assert f"taskboard/{module}.py" not in names
    metadata = next(name for name in names if name.endswith(".dist-info/METADATA"))
    requires = [
        line
        for line in zipfile.ZipFile(server_wheel).read(metadata).decode().splitlines()
        if line.startswith("Requires-Dist:")
    ]
    assert "Requires-Dist: taskboard-agent==0.1.0" in requires
    entry_points = next(name for name in names if name.endswith(".dist-info/entry_points.txt"))
    registered = zipfile.ZipFile(server_wheel).read(entry_points).decode()
    assert "[taskboard.commands]" in registered and "console_scripts" not in registered


def test_taskboard_benchmark_from_the_wheel_says_to_run_it_from_a_checkout(
    server_wheel: Path, tmp_path: Path
) -> None:
    installed = tmp_path / "site"
    install = ["install", "-q", "--no-deps", "--target", str(installed), str(server_wheel)]
    done = subprocess.run(
        [sys.executable, "-m", "pip", *install],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # The wheel's taskboard first on the path, before this venv's editable one; the rest
    # (Django, the agent's package) from this venv. Run outside the checkout.
    env = {key: value for key, value in os.environ.items() if key != "DJANGO_SETTINGS_MODULE"}
    env |= {"PYTHONPATH": str(installed), "DATABASE_URL": processes.tests_database_url()}
    for command, runs in (("benchmark", "python -m benchmarks"), ("soak", "benchmarks soak")):
        refused = subprocess.run(
            [sys.executable, "-m", "taskboard.commands", command, "--quick"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert refused.stdout == ""
        assert len(refused.stderr.splitlines()) == 1, refused.stderr
        assert refused.stderr.startswith(f"taskboard {command}: the benchmark is a tool of")
        assert "from a checkout" in refused.stderr and runs in refused.stderr
