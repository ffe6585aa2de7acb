"""CPU time per request of what runs in front of Django: the Host check and the body limit.

Calls, in process and without a network, ``board.http.middleware.check_host`` and
``RequestBodyLimit`` around an application that answers at once, N times each with a
1 KiB JSON body, and prints the CPU time (``time.process_time``) per request of each,
and of the bare application for comparison. Compare the figures of one run with each
other; the machine's other work moves them all alike.

    DATABASE_URL=postgresql://... python benchmarks/measurements/front_cpu.py [N]
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "taskboard.settings")

import django  # noqa: E402

django.setup()

from board.http.middleware import RequestBodyLimit, check_host  # noqa: E402

BODY = b'{"title": "' + b"x" * 1000 + b'"}'
SCOPE = {
    "type": "http",
    "method": "POST",
    "path": "/api/v1/tasks/",
    "raw_path": b"/api/v1/tasks/",
    "query_string": b"",
    "root_path": "",
    "scheme": "http",
    "server": ("127.0.0.1", 8000),
    "client": ("127.0.0.1", 50000),
    "headers": [
        (b"host", b"localhost:8000"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(BODY)).encode()),
        (b"authorization", b"Bearer x"),
    ],
}


async def receive() -> dict[str, Any]:
    return {"type": "http.request", "body": BODY, "more_body": False}


async def send(message: dict[str, Any]) -> None:
    pass


async def answer(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


async def checked(scope: dict[str, Any], receive: Any, send: Any) -> None:
    assert check_host(scope) is None
    await answer(scope, receive, send)


async def cpu_per_request(app: Any, n: int) -> float:
    started = time.process_time()
    for _ in range(n):
        await app(dict(SCOPE), receive, send)
    return (time.process_time() - started) / n


async def main(n: int) -> None:
    for name, app in (
        ("bare application", answer),
        ("Host check", checked),
        ("RequestBodyLimit", RequestBodyLimit(answer)),
    ):
        await cpu_per_request(app, n // 10)  # warm up
        print(f"{name}: {await cpu_per_request(app, n) * 1e6:.1f} µs CPU per request")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 20_000))
