"""The embedded PostgreSQL: started on demand, one server per data directory, shared by
every process that uses it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

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


def test_concurrent_processes_share_one_server_which_stops_after_the_last(tmp_path: Path) -> None:
    data_dir = (tmp_path / "pgdata").resolve()
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
