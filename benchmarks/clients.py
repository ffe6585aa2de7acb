"""Load generators that run in their own process (``python -m benchmarks.clients``),
so that their CPU is neither the server's nor the benchmark's. They never import Django.

``sse``: hold N event streams open; ``wait``: keep N claims waiting with ``wait``. Each
prints ``{"ready": N}`` once everything is open, records (task id, arrival time) for every
event or claimed task it receives, and when sent ``{"commits": {task id: commit time}}``
on stdin answers the commit-to-arrival latencies (before that, ``{"arrived": true}`` is
answered with how many have arrived so far). Raw asyncio sockets on uvloop keep the
client's own cost per event small.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import re
import sys
import time
from typing import Any
from urllib.parse import urlsplit

TASK_ID = re.compile(rb'"task_id":(\d+)')


class SSEProtocol(asyncio.Protocol):
    def __init__(self, request: bytes, connected: asyncio.Future[None]) -> None:
        self.request = request
        self.connected = connected
        self.buffer = b""
        self.arrivals: list[tuple[int, float]] = []

    def connection_made(self, transport: Any) -> None:
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        now = time.time()
        self.buffer += data
        end = self.buffer.rfind(b"\n\n")
        if end < 0:
            return
        complete, self.buffer = self.buffer[: end + 2], self.buffer[end + 2 :]
        if not self.connected.done():
            if b": connected" in complete:
                self.connected.set_result(None)
            elif not complete.startswith(b"HTTP/1.1 200"):
                self.connected.set_exception(RuntimeError(complete[:200].decode("latin-1")))
        self.arrivals.extend((int(match), now) for match in TASK_ID.findall(complete))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.connected.done():
            received = self.buffer[:300].decode("latin-1")  # an answer that was no stream
            error = RuntimeError(f"stream closed: {exc}; received {received!r}")
            self.connected.set_exception(error)


class WaitProtocol(asyncio.Protocol):
    """One keep-alive connection that always has a waiting claim in flight."""

    def __init__(self, request: bytes, sent: asyncio.Future[None]) -> None:
        self.request = request
        self.sent = sent
        self.buffer = b""
        self.transport: Any = None
        self.arrivals: list[tuple[int, float]] = []
        self.responses = 0

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        transport.write(self.request)
        if not self.sent.done():
            self.sent.set_result(None)

    def data_received(self, data: bytes) -> None:
        now = time.time()
        self.buffer += data
        while True:
            head_end = self.buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buffer[:head_end].decode("latin-1").lower()
            length = int(re.search(r"content-length:\s*(\d+)", head)[1])  # type: ignore[index]
            if len(self.buffer) < head_end + 4 + length:
                return
            body = self.buffer[head_end + 4 : head_end + 4 + length]
            self.buffer = self.buffer[head_end + 4 + length :]
            self.responses += 1
            with contextlib.suppress(ValueError, KeyError, TypeError):
                for task in json.loads(body)["tasks"]:
                    self.arrivals.append((int(task["id"]), now))
            self.transport.write(self.request)  # wait again


def _request(url: str, method: str, path: str, token: str, body: bytes = b"") -> bytes:
    host = urlsplit(url).netloc
    lines = [
        f"{method} {path} HTTP/1.1",
        f"Host: {host}",
        f"Authorization: Bearer {token}",
    ]
    if method == "GET":
        lines.append("Accept: text/event-stream")
    else:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


# A connection that fails to open is opened again, at most this many times. A browser's
# EventSource reconnects too; what failed is reported (``{"ready": N, "reopened": [...]}``),
# and a connection that fails every time still fails the helper.
REOPEN = 2


async def _open_all(
    count: int, url: str, factory: Any, parallel: int = 50
) -> tuple[list[Any], list[str]]:
    """Open ``count`` connections; return their protocols and why any had to be reopened."""
    loop = asyncio.get_running_loop()
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    semaphore = asyncio.Semaphore(parallel)
    protocols: list[Any] = []
    reopened: list[str] = []

    async def open_one() -> None:
        async with semaphore:
            for attempt in range(REOPEN + 1):
                ready: asyncio.Future[None] = loop.create_future()
                transport, protocol = await loop.create_connection(
                    functools.partial(factory, ready), host, port
                )
                try:
                    await asyncio.wait_for(ready, 120)
                except (RuntimeError, TimeoutError) as exc:
                    transport.close()
                    if attempt == REOPEN:
                        raise
                    reopened.append(f"{time.strftime('%H:%M:%S')} {exc or 'timed out'}"[:400])
                else:
                    protocols.append(protocol)
                    return

    await asyncio.gather(*(open_one() for _ in range(count)))
    return protocols, reopened


def _say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


async def _latencies(protocols: list[Any]) -> None:
    loop = asyncio.get_running_loop()
    while True:
        message = json.loads(await loop.run_in_executor(None, sys.stdin.readline))
        if "commits" in message:
            break
        # {"arrived": true}: how many events (or claimed tasks) have arrived so far.
        _say({"arrived": sum(len(protocol.arrivals) for protocol in protocols)})
    commits = {int(key): value for key, value in message["commits"].items()}
    latencies = []
    unmatched = 0
    for protocol in protocols:
        for task_id, arrived in protocol.arrivals:
            committed = commits.get(task_id)
            if committed is None:
                unmatched += 1
            else:
                latencies.append((arrived - committed) * 1000)
    latencies.sort()

    def pick(q: float) -> float:
        return (
            latencies[min(len(latencies) - 1, int(len(latencies) * q / 100))] if latencies else -1
        )

    _say(
        {
            "count": len(latencies),
            "unmatched": unmatched,
            "p50": pick(50),
            "p90": pick(90),
            "p99": pick(99),
            "max": latencies[-1] if latencies else -1,
            "responses": sum(getattr(p, "responses", 0) for p in protocols),
            "histogram": [pick(q) for q in range(0, 101, 2)],
            # Every latency, to a tenth of a millisecond ({tenths: count}): what the
            # latencies of several helpers are put together from.
            "buckets": _buckets(latencies),
        }
    )


def _buckets(latencies: list[float]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for latency in latencies:
        tenths = int(latency * 10)
        counts[tenths] = counts.get(tenths, 0) + 1
    return counts


async def sse(url: str, token: str, count: int) -> None:
    request = _request(url, "GET", "/api/v1/stream/", token)
    protocols, reopened = await _open_all(count, url, lambda ready: SSEProtocol(request, ready))
    _say({"ready": len(protocols), "reopened": reopened})
    await _latencies(protocols)


async def wait(url: str, token: str, count: int, seconds: int) -> None:
    body = json.dumps({"wait": seconds, "lease_seconds": 600}).encode()
    request = _request(url, "POST", "/api/v1/tasks/claim/", token, body)
    protocols, reopened = await _open_all(count, url, lambda sent: WaitProtocol(request, sent))
    _say({"ready": len(protocols), "reopened": reopened})
    await _latencies(protocols)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=["sse", "wait"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--wait", type=int, default=60)
    args = parser.parse_args()
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    if args.kind == "sse":
        asyncio.run(sse(args.url, args.token, args.count))
    else:
        asyncio.run(wait(args.url, args.token, args.count, args.wait))


if __name__ == "__main__":
    main()
