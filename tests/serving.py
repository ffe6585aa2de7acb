"""``taskboard serve`` as a real process, for tests that signal, kill or configure it."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.processes import ROOT, free_port


class Serve:
    """A ``taskboard serve`` process, its output kept in files."""

    def __init__(self, data_dir: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.out = data_dir.parent / f"serve-{self.port}.out"
        self.err = data_dir.parent / f"serve-{self.port}.err"
        env = {**os.environ, **(env or {}), "TASKBOARD_DATA_DIR": str(data_dir)}
        env.pop("DATABASE_URL", None)
        with self.out.open("w") as out, self.err.open("w") as err:
            self.process = subprocess.Popen(
                [sys.executable, "manage.py", "serve", "--port", str(self.port), *args],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=err,
            )
        self.wait_until_healthy()

    def wait_until_healthy(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"serve exited: {self.stderr()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise AssertionError("serve did not become healthy in time")

    def signal(self, sig: int) -> None:
        self.process.send_signal(sig)

    def wait(self, timeout: float = 60) -> int:
        return self.process.wait(timeout)

    def stdout(self) -> str:
        return self.out.read_text()

    def stderr(self) -> str:
        return self.err.read_text()

    def stop(self) -> int:
        """SIGTERM, as a process manager stops it; return the exit status."""
        if self.process.poll() is None:
            self.process.terminate()
        return self.wait()
