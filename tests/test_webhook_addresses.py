"""Webhooks reach public addresses only (board.notifications.webhook_addresses): each
connection resolves its host once, checks every address, and connects to the one it
checked, with TLS for the host's name."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpcore
import httpx
import pytest

from board.notifications.webhook_addresses import (
    Address,
    AddressRefused,
    PublicOnlyBackend,
    PublicOnlyTransport,
)
from tests.live import free_port

PUBLIC = ipaddress.ip_address("93.184.215.14")
LOOPBACK = ipaddress.ip_address("127.0.0.1")
HOST = "hooks.example.test"


class Resolver:
    """Answers each lookup with the next of ``answers``, as a rebinding DNS server would."""

    def __init__(self, *answers: list[Address]) -> None:
        self.answers = list(answers)
        self.lookups: list[str] = []

    async def __call__(self, host: str, port: int) -> list[Address]:
        self.lookups.append(host)
        return self.answers.pop(0)


class Recorder(httpcore.AsyncMockBackend):
    """A network that records where it was asked to connect and what was written, and
    answers every request 200."""

    ANSWER = [b"HTTP/1.1 200 OK\r\n", b"Content-Length: 0\r\n", b"\r\n"]

    def __init__(self) -> None:
        super().__init__(self.ANSWER)
        self.connects: list[tuple[str, int]] = []
        self.written = bytearray()

    async def connect_tcp(self, host: str, port: int, *args: Any, **kwargs: Any) -> Any:
        self.connects.append((host, port))
        recorder = self

        class Recording(httpcore.AsyncMockStream):
            async def write(self, buffer: bytes, timeout: float | None = None) -> None:
                recorder.written += buffer

        return Recording(list(self.ANSWER))


@pytest.fixture(autouse=True)
def private_addresses_refused(settings: Any) -> Any:
    settings.TASKBOARD_WEBHOOK_ALLOW_PRIVATE = False
    return settings


def test_each_connection_looks_up_its_host_once_and_connects_to_the_address_it_checked() -> None:
    """DNS rebinding: the name resolves to a public address, then to 127.0.0.1. The first
    connection goes to the public address it checked; the second is refused before any
    connection, with no lookup between the check and the connect."""
    resolver = Resolver([PUBLIC], [LOOPBACK])
    network = Recorder()
    backend = PublicOnlyBackend(inner=network, resolver=resolver)

    async def connect_twice() -> AddressRefused:
        await backend.connect_tcp(HOST, 443)
        with pytest.raises(AddressRefused) as refused:
            await backend.connect_tcp(HOST, 443)
        return refused.value

    refused = asyncio.run(connect_twice())

    assert resolver.lookups == [HOST, HOST]
    assert network.connects == [(str(PUBLIC), 443)]
    assert str(refused) == "refused: address 127.0.0.1 is not public"


@pytest.mark.parametrize(
    "answer",
    [
        [PUBLIC, ipaddress.ip_address("10.0.0.7")],
        [ipaddress.ip_address("::ffff:10.0.0.7"), PUBLIC],
        [ipaddress.ip_address("169.254.169.254")],
    ],
)
def test_a_host_is_refused_when_any_address_it_resolves_to_is_not_public(
    answer: list[Address],
) -> None:
    network = Recorder()
    backend = PublicOnlyBackend(inner=network, resolver=Resolver(answer))

    with pytest.raises(AddressRefused, match=r"^refused: address \S+ is not public$"):
        asyncio.run(backend.connect_tcp(HOST, 80))
    assert network.connects == []


def test_a_connection_tries_each_checked_address_in_turn() -> None:
    unroutable = ipaddress.ip_address("2606:4700:4700::1111")

    class Unroutable(Recorder):
        async def connect_tcp(self, host: str, port: int, *args: Any, **kwargs: Any) -> Any:
            if host == str(unroutable):
                self.connects.append((host, port))
                raise httpcore.ConnectError("Network is unreachable")
            return await super().connect_tcp(host, port, *args, **kwargs)

    network = Unroutable()
    backend = PublicOnlyBackend(inner=network, resolver=Resolver([unroutable, PUBLIC]))

    asyncio.run(backend.connect_tcp(HOST, 443))

    assert network.connects == [(str(unroutable), 443), (str(PUBLIC), 443)]


def test_a_request_goes_to_the_checked_address_with_the_hosts_name(settings: Any) -> None:
    network = Recorder()
    transport = PublicOnlyTransport(
        backend=PublicOnlyBackend(inner=network, resolver=Resolver([PUBLIC]))
    )

    async def post() -> httpx.Response:
        async with httpx.AsyncClient(transport=transport) as client:
            return await client.post(f"http://{HOST}:8080/hook", content=b"{}")

    assert asyncio.run(post()).status_code == 200
    assert network.connects == [(str(PUBLIC), 8080)]
    assert network.written.startswith(b"POST /hook HTTP/1.1\r\n")
    assert f"\r\nHost: {HOST}:8080\r\n".encode() in bytes(network.written)


def test_private_addresses_are_reached_when_allowed(settings: Any) -> None:
    settings.TASKBOARD_WEBHOOK_ALLOW_PRIVATE = True
    network = Recorder()
    backend = PublicOnlyBackend(inner=network, resolver=Resolver([LOOPBACK]))

    asyncio.run(backend.connect_tcp("localhost", 80))

    assert network.connects == [("127.0.0.1", 80)]


# -- TLS, for the name, at the address checked -----------------------------------------------


def certificate(directory: Path, name: str) -> tuple[Path, Path]:
    """Write a self-signed certificate for ``name`` and its key; return their paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@contextmanager
def tls_receiver(cert: Path, key: Path) -> Iterator[tuple[int, list[tuple[str | None, str]]]]:
    """An HTTPS server on 127.0.0.1; yield its port and, per request, (SNI, Host header)."""
    seen: list[tuple[str | None, str]] = []
    server_names: list[str | None] = []
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    context.sni_callback = lambda sock, name, ctx: server_names.append(name)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            seen.append((server_names[-1] if server_names else None, self.headers["Host"]))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    port = free_port()
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield port, seen
    finally:
        server.shutdown()
        server.server_close()


def test_tls_is_verified_for_the_hosts_name_at_the_address_checked(
    settings: Any, tmp_path: Path
) -> None:
    """The connection goes to the address resolved (127.0.0.1, allowed here), and TLS
    names the URL's host: in the SNI, and in the certificate's check, which refuses a
    certificate for another name."""
    settings.TASKBOARD_WEBHOOK_ALLOW_PRIVATE = True
    cert, key = certificate(tmp_path, HOST)
    other_cert, other_key = certificate(tmp_path, "other.example.test")

    async def post(port: int, trusted: Path) -> httpx.Response:
        context = ssl.create_default_context(cafile=str(trusted))
        backend = PublicOnlyBackend(resolver=Resolver([LOOPBACK]))
        transport = PublicOnlyTransport(verify=context, backend=backend)
        async with httpx.AsyncClient(transport=transport) as client:
            return await client.post(f"https://{HOST}:{port}/hook", content=b"{}")

    with tls_receiver(cert, key) as (port, seen):
        assert asyncio.run(post(port, cert)).status_code == 200
    assert seen == [(HOST, f"{HOST}:{port}")]

    refused = pytest.raises(httpx.ConnectError, match="certificate verify failed")
    with tls_receiver(other_cert, other_key) as (port, seen), refused:
        asyncio.run(post(port, other_cert))
    assert seen == []


def test_through_a_proxy_from_the_environment_the_host_is_checked_before_the_proxy_is_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The proxy (here on 127.0.0.1, the operator's own) makes the connection: a public
    host is sent to it, a private one is refused before."""
    from board.notifications import webhook_addresses
    from tests.receivers import WebhookReceiver

    with WebhookReceiver() as proxy:
        for name in ("HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "https_proxy", "all_proxy"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy.port}")
        monkeypatch.setenv("no_proxy", "")

        async def post(url: str) -> int | str:
            async with webhook_addresses.client() as client:
                try:
                    return (await client.post(url, content=b"{}")).status_code
                except AddressRefused as refused:
                    return str(refused)

        answers = [
            asyncio.run(post(url))
            for url in (f"http://{PUBLIC}/hook", "http://127.1:8000/", "http://[::1]/")
        ]

    assert answers == [
        200,
        "refused: address 127.0.0.1 is not public",
        "refused: address ::1 is not public",
    ]
    [request] = proxy.received
    assert request.headers["Host"] == str(PUBLIC)
