"""Real receivers for the board's deliveries: an HTTP server (stdlib, in a thread) that
answers as a test scripts it, and an SMTP server (aiosmtpd)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from email import message_from_bytes
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from aiosmtpd.controller import Controller

from tests.live import free_port

HOLD = "hold"  # keep the request open until release() (or 60 s)


@dataclass
class Received:
    headers: dict[str, str]
    body: bytes
    answer: int | str  # the status answered, or HOLD/"slow" when it answered late or not at all
    at: float

    @property
    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def event_id(self) -> int:
        return int(self.headers["Taskboard-Event-Id"])

    def signature_verifies(self, secret: str) -> bool:
        """Verify the signature as a receiver would, in a few lines."""
        fields = dict(part.split("=", 1) for part in self.headers["Taskboard-Signature"].split(","))
        signed = f"{fields['t']}.".encode() + self.body
        expected = hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()
        return hmac.compare_digest(expected, fields["v1"])


class _Server(ThreadingHTTPServer):
    # A listen backlog for every sender at once: the stdlib's default of 5 drops the
    # connections of a burst (40 deliveries from two servers), whose connects then time out
    # and count as failed attempts that the receiver never saw.
    request_queue_size = 128


class WebhookReceiver:
    """Answers each POST with the next item of ``script`` (a status, ``("slow", seconds)``
    to answer 200 only after that long, or HOLD), then ``then`` for every later one."""

    def __init__(self, *script: Any, then: int = 200) -> None:
        self.script = list(script)
        self.then = then
        self.received: list[Received] = []
        self.released = threading.Event()
        self.lock = threading.Lock()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/hook"
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with receiver.lock:
                    step = receiver.script.pop(0) if receiver.script else receiver.then
                    entry = Received(dict(self.headers), body, step, time.monotonic())
                    receiver.received.append(entry)
                if step == HOLD:
                    receiver.released.wait(60)
                    return  # the sender is gone or gave up: answer nothing
                if isinstance(step, tuple):
                    time.sleep(step[1])
                    entry.answer = "slow"
                    step = 200
                self.send_response(int(step))
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = _Server(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> WebhookReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()

    def accepted(self) -> list[Received]:
        """The requests answered 2xx in time."""
        with self.lock:
            return [r for r in self.received if isinstance(r.answer, int) and r.answer < 300]


class _Inbox:
    def __init__(self, delay: float = 0.0) -> None:
        self.messages: list[Message] = []
        self.delay = delay

    async def handle_MAIL(
        self, server: Any, session: Any, envelope: Any, address: str, options: Any
    ) -> str:
        await asyncio.sleep(self.delay)
        envelope.mail_from = address
        return "250 OK"

    async def handle_RCPT(
        self, server: Any, session: Any, envelope: Any, address: str, options: Any
    ) -> str:
        await asyncio.sleep(self.delay)
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        await asyncio.sleep(self.delay)
        message = message_from_bytes(envelope.content)
        message["X-Envelope-To"] = ", ".join(envelope.rcpt_tos)
        self.messages.append(message)
        return "250 Message accepted for delivery"


@contextmanager
def smtp_receiver(delay: float = 0.0) -> Iterator[tuple[int, list[Message]]]:
    """Run a real SMTP server on a free port; yield its port and the messages it accepts.
    It answers MAIL, RCPT and the end of DATA each ``delay`` seconds late."""
    inbox = _Inbox(delay)
    port = free_port()
    controller = Controller(inbox, hostname="127.0.0.1", port=port)
    controller.start()
    try:
        yield port, inbox.messages
    finally:
        controller.stop()
