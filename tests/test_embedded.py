"""The embedded PostgreSQL: started on demand, one server per data directory, shared by
every process that uses it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.processes import ServeProcess

pytestmark = [pytest.mark.slow, pytest.mark.once]

ROOT = Path(__file__).resolve().parent.parent

HOLD_A_HANDLE = textwrap.dedent(
    """
    import sys
    from taskboard import embedded
    server = embedded.server(sys.argv[1])
    print(server.get_pid(), flush=True)
    sys.stdin.readline()  # hold the handle until told to go
    """
)


def postmasters_for(data_dir: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(attrs=["name", "cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if proc.info["name"] == "postgres" and str(data_dir) in " ".join(cmdline):
            found.append(proc)
    return found


@pytest.fixture
def short_tmp_path() -> Iterator[Path]:
    """A temporary directory with a short path. The embedded server puts its unix socket
    (whose path the kernel caps at 107 bytes) in its data directory when the path fits, and
    otherwise in the runtime directory, whose parents it then opens to everyone (0755):
    that would make platformdirs refuse the runtime directory and fall back to a shared
    one. pytest's tmp_path is longer under xdist (popen-gwN)."""
    path = Path(tempfile.mkdtemp(prefix="tb-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_concurrent_processes_share_one_server_which_stops_after_the_last(
    short_tmp_path: Path,
) -> None:
    data_dir = (short_tmp_path / "pgdata").resolve()
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", HOLD_A_HANDLE, str(data_dir)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    try:
        pids = {int(proc.stdout.readline()) for proc in processes}  # type: ignore[union-attr]
        assert len(pids) == 1, "every process must reuse the one server"
        assert len(postmasters_for(data_dir)) == 1
    finally:
        for proc in processes:
            proc.communicate("\n", timeout=60)

    assert postmasters_for(data_dir) == [], "the last process to leave stops the server"


def test_a_server_command_run_elsewhere_uses_the_database_serve_runs_on(
    short_tmp_path: Path,
) -> None:
    # `cd elsewhere && taskboard create_agent my-agent` made an empty database there and
    # died on it with a traceback.
    tmp_path = short_tmp_path
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    (tmp_path / "checkout").mkdir()
    data_dir = (tmp_path / "checkout" / ".taskboard").resolve()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    environment = {
        key: value
        for key, value in os.environ.items()
        if key not in {"DJANGO_SETTINGS_MODULE", "DATABASE_URL", "TASKBOARD_DATA_DIR"}
    }
    environment["XDG_RUNTIME_DIR"] = str(runtime)

    def create_agent() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "taskboard_agent.cli", "create_agent", "my-agent"],
            cwd=elsewhere,
            env=environment,
            capture_output=True,
            text=True,
            timeout=120,
        )

    server = ServeProcess.on_data_dir(
        data_dir, "--workers", "1", env={"XDG_RUNTIME_DIR": str(runtime)}
    )
    try:
        done = create_agent()
        assert done.returncode == 0, done.stderr
        assert done.stderr.strip().splitlines() == [
            "taskboard create_agent: no database here; using the one `taskboard serve` runs "
            f"on, in {data_dir}"
        ]
        token = done.stdout.strip().splitlines()[-1]
        answer = httpx.get(
            f"{server.url}/api/v1/tasks/", headers={"Authorization": f"Bearer {token}"}
        )
        assert answer.status_code == 200, answer.text
    finally:
        server.stop()
    assert f"Database    embedded PostgreSQL in {data_dir / 'pgdata'}" in server.output
    assert list(elsewhere.iterdir()) == []

    # Once serve has stopped, there is no database to find: refused in one line.
    done = create_agent()
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"no database in {elsewhere / '.taskboard'}" in done.stderr
    assert list(elsewhere.iterdir()) == []
