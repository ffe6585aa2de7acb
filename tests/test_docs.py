"""The documentation cannot drift from what the board does.

Every ``sh`` block of the tutorials runs, as a reader would paste it, against a live
``taskboard serve`` that the first tutorial starts, and the command line reference is what
the commands' ``--help`` says.

The tutorials run in order, one bash script per page, in one scratch directory that stands
for the reader's checkout (its ``.venv`` is this environment), with no ``DATABASE_URL``:
the embedded PostgreSQL in ``.taskboard/`` there, as the pages say. Blocks with a
``title="NAME"`` are files the page asks the reader to save. An HTML comment just before a
block says how to run it otherwise:

- ``<!-- docs-test: skip (why) -->``: not run (an install from the network, say);
- ``<!-- docs-test: background -->``: started and left running, as in a second terminal;
  ``<!-- docs-test: background, wait for /healthz -->`` waits until the server answers;
- ``<!-- docs-test: fails with "TEXT" -->``: must fail, saying TEXT.

The server listens on a free port (``PORT``), and ``127.0.0.1:8000`` in a block is
rewritten to it. ``curl`` runs with ``--fail-with-body``, so that a call the board refuses
fails the page.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.processes import ROOT, eventually, free_port

# Nothing here depends on the PostgreSQL server's version; the tutorials' runs are slow.
pytestmark = [pytest.mark.once]

DOCS = ROOT / "docs"
TUTORIALS = [
    "run-the-board.md",
    "first-agent-curl.md",
    "python-client.md",
    "mcp-agent.md",
    "triage.md",
]
FENCE = re.compile(
    r"(?:^<!-- docs-test: (?P<directive>[^\n]*?) -->\n)?"
    r"^```(?P<lang>\w*)(?: title=\"(?P<title>[^\"]+)\")?\n(?P<code>.*?)^```$",
    re.MULTILINE | re.DOTALL,
)
DIRECTIVE = re.compile(
    r'skip \(.+\)|background(?:, wait for (?P<wait>/\S+))?|fails with "(?P<says>[^"]+)"'
)
PIDS = ".docs-test-pids"


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    title: str | None
    code: str
    directive: str | None

    @property
    def where(self) -> str:
        return f"docs/tutorials/{self.page}:{self.line}"


def blocks(page: str) -> list[Block]:
    """Return the fenced blocks of a tutorial, in order."""
    text = (DOCS / "tutorials" / page).read_text()
    return [
        Block(
            page=page,
            line=text.count("\n", 0, match.start("lang")) + 1,
            lang=match["lang"],
            title=match["title"],
            code=match["code"],
            directive=match["directive"],
        )
        for match in FENCE.finditer(text)
    ]


def script(page: str, port: int) -> str:
    """Return the bash script that runs a page's ``sh`` blocks as its directives say."""
    lines = [
        "set -euo pipefail",
        'curl() { command curl --fail-with-body "$@"; }',
    ]
    for block in blocks(page):
        if block.lang != "sh" or block.title:
            continue
        code = block.code.replace("127.0.0.1:8000", f"127.0.0.1:{port}").rstrip("\n")
        directive = DIRECTIVE.fullmatch(block.directive or "")
        lines.append(f"echo '--- {block.where}' >&2")
        if block.directive is None:
            lines.append(code)
        elif block.directive.startswith("skip"):
            continue
        elif block.directive.startswith("background"):
            assert "\n" not in code, f"{block.where}: a background block is one command"
            log = f".docs-test-{page}-{block.line}.log"
            lines += [f"{code} > {log} 2>&1 &", f"echo $! >> {PIDS}"]
            if directive and directive["wait"]:
                url = f"http://127.0.0.1:{port}{directive['wait']}"
                lines += [
                    "for _ in $(seq 1500); do",
                    f"    command curl -sf {url} > /dev/null && break || sleep 0.2",
                    "done",
                    f"command curl -sf {url} > /dev/null || {{ cat {log} >&2; exit 1; }}",
                ]
        else:
            assert directive and directive["says"], f"{block.where}: {block.directive}"
            lines += [
                f"if output=$({code} 2>&1); then",
                f"    echo '{block.where} succeeded, and the page says it fails' >&2; exit 1",
                "fi",
                'printf "%s\\n" "$output"',
                f'grep -qF -- {directive["says"]!r} <<< "$output"',
            ]
    return "\n".join(lines) + "\n"


@dataclass
class Reader:
    """The reader's checkout: where the tutorials run, and the board they started."""

    directory: Path
    port: int
    env: dict[str, str]
    first_run: str = ""  # what the first tutorial printed

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def run(self, page: str) -> str:
        """Save the page's files, run its ``sh`` blocks; return what they printed."""
        for block in blocks(page):
            if block.title:
                (self.directory / block.title).write_text(block.code)
        done = subprocess.run(
            ["bash", "-c", script(page, self.port)],
            cwd=self.directory,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, (
            f"docs/tutorials/{page} failed (the last '---' line names the block):\n"
            f"{done.stdout}\n{done.stderr}\n{self.logs()}"
        )
        return done.stdout

    def logs(self) -> str:
        return "\n".join(
            f"--- {log.name}\n{log.read_text(errors='replace')[-4000:]}"
            for log in sorted(self.directory.glob(".docs-test-*.log"))
        )

    def serve_output(self) -> str:
        """What the first tutorial's ``taskboard serve`` printed."""
        [log] = self.directory.glob(".docs-test-run-the-board.md-*.log")
        return log.read_text(errors="replace")

    def stop(self) -> None:
        """Stop what the pages left running, the newest first, with SIGTERM (a shell's
        background commands ignore Ctrl-C's SIGINT), as a process manager would."""
        pids = self.directory / PIDS
        if not pids.exists():
            return
        for pid in reversed([int(line) for line in pids.read_text().split()]):
            with contextlib.suppress(psutil.NoSuchProcess):
                process = psutil.Process(pid)
                process.terminate()
                try:
                    process.wait(30)
                except psutil.TimeoutExpired:
                    process.kill()


@pytest.fixture(scope="module")
def reader(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reader]:
    if subprocess.run(["sh", "-c", "command -v jq"], capture_output=True).returncode:
        pytest.skip("the tutorials use jq (Debian's jq package), which is not installed")
    directory = tmp_path_factory.mktemp("checkout")
    (directory / ".venv").symlink_to(sys.prefix)
    (directory / "home").mkdir()
    env = {
        key: value
        for key, value in os.environ.items()
        if key
        not in {
            "DATABASE_URL",
            "DJANGO_SETTINGS_MODULE",
            "TASKBOARD_DATA_DIR",
            "TASKBOARD_URL",
            "TASKBOARD_TOKEN",
        }
    }
    env.update(
        PORT=str(free_port()),
        HOME=str(directory / "home"),
        XDG_STATE_HOME=str(directory / "home" / ".local" / "state"),
        PYTHONUNBUFFERED="1",
    )
    board = Reader(directory, int(env["PORT"]), env)
    try:
        # The first tutorial starts the board that the others use, whichever of them runs
        # first (or alone, on a worker of its own).
        board.first_run = board.run("run-the-board.md")
        yield board
    finally:
        board.stop()


@pytest.fixture(scope="module")
def demo_agent(reader: Reader) -> httpx.Client:
    """The API as ``demo-agent``, whose token the first run printed (after the first page)."""
    token = re.search(r"demo-agent\s+token\s+(\S+)", reader.serve_output())
    assert token, reader.serve_output()
    return httpx.Client(
        base_url=f"{reader.url}/api/v1", headers={"Authorization": f"Bearer {token[1]}"}
    )


def tasks_titled(api: httpx.Client, title: str) -> list[dict[str, Any]]:
    tasks = api.get("/tasks/", params={"limit": 1000}).raise_for_status().json()["results"]
    return [task for task in tasks if task["title"] == title]


@pytest.mark.slow
def test_every_tutorial_is_run_and_every_directive_is_understood() -> None:
    pages = {path.name for path in (DOCS / "tutorials").glob("*.md")} - {"index.md"}
    assert set(TUTORIALS) == pages
    for page in TUTORIALS:
        runnable = [block for block in blocks(page) if block.lang == "sh"]
        assert any(block.directive is None for block in runnable), f"{page} runs nothing"
        for block in runnable:
            if block.directive is not None:
                assert DIRECTIVE.fullmatch(block.directive), f"{block.where}: {block.directive}"


@pytest.mark.slow
def test_run_the_board_serves_from_the_current_directory(reader: Reader) -> None:
    printed = reader.first_run

    assert (reader.directory / ".taskboard" / "pgdata").is_dir()
    served = reader.serve_output()
    assert re.search(r"admin\s+password \S+", served), served
    assert f"Board       {reader.url}/" in served
    assert '"status": "ok"' in printed


@pytest.mark.slow
def test_a_first_agent_with_curl(reader: Reader, demo_agent: httpx.Client) -> None:
    printed = reader.run("first-agent-curl.md")

    assert '"lease_token"' in printed and "lease_lost" in printed
    [task] = tasks_titled(demo_agent, "Resize images")
    assert (task["status"], task["result"]) == ("done", {"resized": 12})
    events = demo_agent.get(f"/tasks/{task['id']}/events/").json()["results"]
    assert [event["type"] for event in events] == ["created", "claimed", "heartbeat", "completed"]


@pytest.mark.slow
def test_the_python_client_and_taskboard_work(reader: Reader, demo_agent: httpx.Client) -> None:
    printed = reader.run("python-client.md")

    assert "completed task" in printed
    for title in ("Thumbnails of the album", "Thumbnail of the cover"):
        [task] = tasks_titled(demo_agent, title)
        assert task["status"] == "done" and task["progress"]["done"] == task["progress"]["of"]
    # The worker left running takes the task submitted after it started.
    eventually(
        lambda: tasks_titled(demo_agent, "Thumbnails of the second album")[0]["status"] == "done",
        timeout=30,
        what="the worker's task done",
    )
    [task] = tasks_titled(demo_agent, "Thumbnails of the second album")
    assert task["result"] == {"thumbnails": 2}


@pytest.mark.slow
def test_an_llm_agent_over_mcp(reader: Reader, demo_agent: httpx.Client) -> None:
    printed = reader.run("mcp-agent.md")

    assert "tools: create_task, claim_task" in printed
    [task] = tasks_titled(demo_agent, "Summarise the incident reports")
    assert (task["status"], task["result"]) == ("done", {"incidents": 11})


@pytest.mark.slow
def test_triage_escalations_as_a_person(reader: Reader, demo_agent: httpx.Client) -> None:
    printed = reader.run("triage.md")

    assert '{"status":"escalated","failure_count":3}' in printed
    assert "escalated  reports" in printed  # listed for people before it was resolved
    [task] = tasks_titled(demo_agent, "Monthly report")
    assert (task["status"], task["result"]) == ("done", {"pages": 12})
    events = demo_agent.get(f"/tasks/{task['id']}/events/").json()["results"]
    assert [event["type"] for event in events][-3:] == ["failed", "escalated", "resolved"]


@pytest.mark.slow
def test_the_command_line_reference_is_what_the_commands_say() -> None:
    path = DOCS / "scripts" / "cli_reference.py"
    spec = importlib.util.spec_from_file_location("cli_reference", path)
    assert spec and spec.loader
    cli_reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli_reference)

    assert cli_reference.PAGE.read_text() == cli_reference.page(), (
        "docs/reference/cli.md differs from the commands' --help: "
        "run .venv/bin/python docs/scripts/cli_reference.py"
    )


# The README is one screen's worth that leads into the site; history lives in the decisions
# and CHANGELOG.md, and dated figures in the benchmark runs (the performance page's one
# table of the latest figures names its runs by date, which the checks below allow).
README_LINES = 200
HISTORY = (DOCS / "decisions", DOCS / "benchmarks" / "runs")
ISSUE_NUMBER = re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE)
# "I" as a word followed by a lowercase word ("I built"), not "%I" in SQL or "I/O".
FIRST_PERSON = re.compile(r"(?<![\w%/.-])I\s+(?=[a-z])")
LINK = re.compile(r"\]\((?!https?://|#|mailto:)([^)#\s]+)(?:#[^)\s]*)?\)")


def read_pages() -> dict[str, str]:
    """Return README.md and every page of the site outside the history, by path."""
    pages = {"README.md": (ROOT / "README.md").read_text()}
    for path in sorted(DOCS.rglob("*.md")):
        if not any(path.is_relative_to(history) for history in HISTORY):
            pages[str(path.relative_to(ROOT))] = path.read_text()
    return pages


def test_the_readme_is_one_screen_s_worth_that_links_into_the_docs() -> None:
    readme = (ROOT / "README.md").read_text()

    assert len(readme.splitlines()) <= README_LINES, "README.md: move the detail into docs/"
    targets = LINK.findall(readme)
    assert "docs/images/board.png" in targets
    assert any(target.startswith("docs/tutorials/") for target in targets)
    missing = [target for target in targets if not (ROOT / target).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_the_readme_and_the_docs_say_why_not_when() -> None:
    found = [
        f"{path}:{text.count(chr(10), 0, match.start()) + 1}: {match.group(0)!r}"
        for path, text in read_pages().items()
        for pattern in (ISSUE_NUMBER, FIRST_PERSON)
        for match in pattern.finditer(text)
    ]
    assert not found, "history belongs in docs/decisions/ or CHANGELOG.md:\n" + "\n".join(found)


def test_the_checks_on_history_catch_it() -> None:
    assert ISSUE_NUMBER.search("Where issue 11 stands")
    assert ISSUE_NUMBER.search("see Issue #9")
    assert FIRST_PERSON.search("so I built that variant")
    assert not FIRST_PERSON.search("EXECUTE format('CREATE TABLE %I PARTITION OF')")
    assert not FIRST_PERSON.search("I/O bound") and not FIRST_PERSON.search("Part I")
