"""Threads and memory of 1,000 open streams: Django's ASGI handler against ``serve``.

What the stream would cost as an async view under Django's ASGI handler (decision 0006).
This starts, on the database at DATABASE_URL (migrated), two servers one after the other
and opens 1,000 SSE streams to each with the benchmark's helper
(benchmarks.clients):

- Django's handler (``get_asgi_application()`` under uvicorn, the project's settings and
  middleware, Django's psycopg pool of at most 4 connections, ``CONN_MAX_AGE`` 0) serving
  the smallest async view that streams: a ``StreamingHttpResponse`` of an async generator
  that sends the preamble and then a keep-alive every 15 s. It authenticates no one and
  follows no event, so it is a lower bound of what the real stream would cost there. It
  gives back, first thing, the pooled connection that the middleware took on the
  request's thread (the failed-authentication throttle reads the client's address):
  without that, each open stream keeps one, and the fifth stream waits for the pool and
  gets 503 after its 30 s timeout.
- ``taskboard serve --workers 1`` (the stream as it is: board.live.stream).

For each it prints the server process's threads and RSS before and with the streams open.

    DATABASE_URL=postgresql://... python benchmarks/measurements/stream_threads.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import Helper  # noqa: E402

STREAMS = 1000

VIEW = """
import asyncio
from asgiref.sync import sync_to_async
from django.db import connections
from django.http import StreamingHttpResponse
from django.urls import include, path

async def events():
    yield b"retry: 1000\\n\\n: connected\\n\\n"
    while True:
        await asyncio.sleep(15)
        yield b": keep-alive\\n\\n"

async def stream(request):
    await sync_to_async(connections.close_all)()  # the middleware's pooled connection
    return StreamingHttpResponse(events(), content_type="text/event-stream")

urlpatterns = [path("api/v1/stream/", stream), path("", include("taskboard.urls"))]
"""
SETTINGS = """
from taskboard.settings import *  # noqa: F403
ROOT_URLCONF = "stream_view"
DATABASES["default"]["CONN_MAX_AGE"] = 0  # noqa: F405
POOL = {"min_size": 1, "max_size": 4}
DATABASES["default"].setdefault("OPTIONS", {})["pool"] = POOL  # noqa: F405
"""
RUN_DJANGO = """
import django, uvicorn
django.setup()
from django.core.asgi import get_asgi_application
uvicorn.run(get_asgi_application(), port=int(PORT), log_level="warning", lifespan="off")
"""


def status(pid: int) -> tuple[int, int]:
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return int(fields["Threads"]), int(fields["VmRSS"].split()[0]) // 1024


def measure(name: str, command: list[str], env: dict[str, str], port: int, token: str) -> None:
    server = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        time.sleep(6)
        pid = server.pid
        # serve runs its one process as the command itself (no supervisor with --workers 1).
        before = status(pid)
        helper = Helper(
            "sse", "--url", f"http://127.0.0.1:{port}", "--token", token, "--count", str(STREAMS)
        )
        try:
            ready = helper.read(180)["ready"]
            time.sleep(3)
            after = status(pid)
        finally:
            helper.close()
        print(
            f"{name}: {ready} streams; threads {before[0]} -> {after[0]}, "
            f"RSS {before[1]} -> {after[1]} MB (+{after[1] - before[1]} MB)"
        )
    finally:
        server.terminate()
        server.wait(10)


def main() -> None:
    env = {**os.environ, "TASKBOARD_ACCESS_LOG": "false"}
    made = subprocess.run(
        [sys.executable, "manage.py", "create_agent", f"threads-{os.getpid()}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    token = made.stdout.strip().splitlines()[-1]
    with tempfile.TemporaryDirectory() as scratch:
        Path(scratch, "stream_view.py").write_text(VIEW)
        Path(scratch, "stream_settings.py").write_text(SETTINGS)
        django_env = {
            **env,
            "PYTHONPATH": f"{scratch}:{ROOT}",
            "DJANGO_SETTINGS_MODULE": "stream_settings",
        }
        code = RUN_DJANGO.replace("int(PORT)", "8431")
        measure(
            "Django's ASGI handler, an async view",
            [sys.executable, "-c", textwrap.dedent(code)],
            django_env,
            8431,
            token,
        )
    serve = [
        sys.executable,
        "-m",
        "taskboard.commands",
        "serve",
        "--workers",
        "1",
        "--port",
        "8432",
        "--no-migrate",
    ]
    measure(
        "taskboard serve (board.live.stream)", serve, {**env, "PYTHONPATH": str(ROOT)}, 8432, token
    )


if __name__ == "__main__":
    main()
