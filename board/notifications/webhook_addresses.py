"""Where webhooks may be sent: public addresses only, unless
TASKBOARD_WEBHOOK_ALLOW_PRIVATE.

A webhook is staff's way to make the server send requests, and its outcome (status code,
error) is shown back to them: to a loopback, private or link-local address, it would probe
the server's own network (which ports are open, a cloud's metadata service). So a URL is
refused when it is added (the API's serializer) if its host spells, or resolves to, an
address that is not public; and every connection a delivery makes resolves the name itself,
checks every address it resolves to, and connects only to addresses it checked
(:class:`PublicOnlyTransport`): a name that resolves to a public address when it is added
and to a private one later (DNS rebinding) is refused then, with no second lookup between
the check and the connect. TLS is still verified for the URL's host name, which is also
the one sent in the SNI and the ``Host`` header. Through a proxy that the environment
names, the host is checked the same way before the proxy is asked
(:class:`CheckedProxyTransport`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

import httpcore
import httpx

from board import conf

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

# IPv6 ranges that carry an IPv4 address in their last 32 bits, which is what they reach.
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
# "IPv4-compatible" addresses (deprecated): refused, whatever the IPv4 address in them.
_IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")


class AddressRefused(Exception):
    """A webhook's host is, or resolves to, an address that is not public.

    Its text names the address and nothing learnt from connecting to it (there was no
    connection): it is what the delivery records, the same whether a port is open or not.
    """

    def __init__(self, address: Address | str) -> None:
        self.address = str(address)
        super().__init__(f"refused: address {self.address} is not public")


def allow_private() -> bool:
    return bool(conf.webhook_allow_private())


def is_public(address: Address) -> bool:
    """Return whether ``address`` is a public unicast address of the Internet.

    ``is_global`` leaves out loopback, private, link-local, unspecified, shared (CGNAT),
    documentation and reserved ranges; multicast is refused too. An IPv6 address that
    carries an IPv4 one (mapped ``::ffff:a.b.c.d``, 6to4, NAT64) is judged by that one.
    """
    if isinstance(address, ipaddress.IPv6Address):
        if address.scope_id:
            return False  # a zone (fe80::1%eth0) is a link's
        carried = address.ipv4_mapped or address.sixtofour
        if carried is None and address in _NAT64:
            carried = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if carried is not None:
            return is_public(carried)
        if address in _IPV4_COMPATIBLE or address.teredo is not None:
            return False
    return bool(
        address.is_global
        and not address.is_multicast
        and not address.is_reserved
        and not address.is_unspecified
        and not address.is_loopback
        and not address.is_link_local
        and not address.is_private
    )


def is_local_name(host: str) -> bool:
    """Return whether ``host`` is ``localhost`` or a name under it (RFC 6761: loopback,
    whatever a resolver answers)."""
    name = host.rstrip(".").lower()
    return name == "localhost" or name.endswith(".localhost")


def check(host: str, addresses: Iterable[Address]) -> list[Address]:
    """Return ``addresses`` (what ``host`` resolved to) if every one of them is public;
    raise AddressRefused naming the first that is not."""
    vetted = list(addresses)
    if is_local_name(host):
        raise AddressRefused(vetted[0] if vetted else host)
    for address in vetted:
        if not is_public(address):
            raise AddressRefused(address)
    return vetted


def _addresses(infos: Iterable[tuple[Any, ...]]) -> list[Address]:
    found: list[Address] = []
    for info in infos:
        address = ipaddress.ip_address(str(info[4][0]))
        if address not in found:
            found.append(address)
    return found


async def resolve(host: str, port: int) -> list[Address]:
    """Return the addresses ``host`` resolves to, as a connection would: the system's
    resolver, which also reads ``127.1``, ``2130706433`` and ``0`` as the IPv4 addresses
    they spell."""
    loop = asyncio.get_running_loop()
    return _addresses(await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM))


def refusal(url: str) -> str | None:
    """Return why webhook ``url`` is refused, or None: the sentence for ``400 invalid``.

    The host is resolved now; a name that does not resolve is let through (it may later),
    since every delivery checks again where it connects.
    """
    if allow_private():
        return None
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        infos = []
        if not is_local_name(host):
            return None
    try:
        check(host, _addresses(infos))
    except AddressRefused as refused:
        where = host if refused.address == host else f"{refused.address} ({host})"
        return (
            f"{where} is not a public address: webhooks may not reach loopback, private, "
            "link-local or other non-public addresses."
        )
    return None


class PublicOnlyBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend, that connects to a host only at an address it checked.

    It resolves the host once per connection (``resolver``), checks every address it
    resolves to (unless TASKBOARD_WEBHOOK_ALLOW_PRIVATE), and connects to them, by
    address, in turn until one answers: the backend below it looks nothing up again.
    httpcore then starts TLS with the URL's host name, for the SNI and the certificate's
    check.
    """

    def __init__(
        self,
        inner: httpcore.AsyncNetworkBackend | None = None,
        resolver: Callable[[str, int], Awaitable[list[Address]]] | None = None,
    ) -> None:
        self._inner = inner or httpcore.AnyIOBackend()
        self._resolver = resolver or resolve

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            found = await asyncio.wait_for(self._resolver(host, port), timeout)
        except TimeoutError as exc:
            raise httpcore.ConnectTimeout(f"could not resolve {host} in time") from exc
        except OSError as exc:  # socket.gaierror: no such name, or no resolver
            raise httpcore.ConnectError(f"could not resolve {host}: {exc}") from exc
        if not found:
            raise httpcore.ConnectError(f"{host} resolves to no address")
        vetted = found if allow_private() else check(host, found)
        # Each address in turn, as a resolver's answer is meant (an IPv6 one first, say,
        # on a host without an IPv6 route).
        for address in vetted[:-1]:
            try:
                return await self._connect(address, port, timeout, local_address, socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout):
                continue
        return await self._connect(vetted[-1], port, timeout, local_address, socket_options)

    async def _connect(
        self,
        address: Address,
        port: int,
        timeout: float | None,
        local_address: str | None,
        socket_options: Iterable[Any] | None,
    ) -> httpcore.AsyncNetworkStream:
        return await self._inner.connect_tcp(
            str(address),
            port,
            timeout=timeout,
            local_address=local_address,
            socket_options=socket_options,
        )

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("webhooks are not sent to a Unix socket")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


# httpx's own defaults.
_LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20)


class PublicOnlyTransport(httpx.AsyncHTTPTransport):
    """httpx's transport, connecting through :class:`PublicOnlyBackend`."""

    def __init__(
        self,
        *,
        verify: Any = True,
        backend: PublicOnlyBackend | None = None,
    ) -> None:
        limits = _LIMITS
        super().__init__(verify=verify, limits=limits, trust_env=False)
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=httpx.create_ssl_context(verify=verify, trust_env=False),
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=backend or PublicOnlyBackend(),
        )


class CheckedProxyTransport(httpx.AsyncHTTPTransport):
    """httpx's transport through a proxy, that checks the request's host first.

    The proxy makes the connection, and looks the name up again: there, the proxy (the
    operator's own gate to the outside) is what keeps requests off the inside. A name this
    host cannot resolve is left to the proxy, which may know it.
    """

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if not allow_private():
            host = request.url.host
            port = request.url.port or (443 if request.url.scheme == "https" else 80)
            try:
                found = await resolve(host, port)
            except OSError:  # socket.gaierror
                found = []
            if found or is_local_name(host):
                check(host, found)
        return await super().handle_async_request(request)


def client() -> httpx.AsyncClient:
    """Return the HTTP client deliveries are sent with: to public addresses only (unless
    TASKBOARD_WEBHOOK_ALLOW_PRIVATE), directly or through the proxies the environment
    names (``HTTPS_PROXY``, ``NO_PROXY``, ...), read as httpx reads them."""
    from httpx._utils import get_environment_proxies

    mounts: dict[str, httpx.AsyncBaseTransport | None] = {
        pattern: None if url is None else CheckedProxyTransport(proxy=url, trust_env=False)
        for pattern, url in get_environment_proxies().items()
    }
    return httpx.AsyncClient(follow_redirects=False, transport=PublicOnlyTransport(), mounts=mounts)
