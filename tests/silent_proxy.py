"""A TCP proxy in front of the test database whose connections can be made to go silent.

``silence()`` stops forwarding on every connection open at that moment while keeping both
of its sockets open: to the client the database stops answering, and to the database
the client is still there, idle, as when a NAT, a firewall or a TCP proxy in between
drops a connection without a word. Connections made afterwards are forwarded normally.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any

import psycopg


class SilentProxy:
    def __init__(self, conninfo: str) -> None:
        params = psycopg.conninfo.conninfo_to_dict(conninfo)
        host = str(params.get("host") or "/tmp")
        port = int(params.get("port") or 5432)
        if host.startswith("/"):
            self._upstream: tuple[int, Any] = (socket.AF_UNIX, f"{host}/.s.PGSQL.{port}")
        else:
            self._upstream = (socket.AF_INET, (host, port))
        self._params = params
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: list[tuple[socket.socket, socket.socket, threading.Event]] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def conninfo(self) -> str:
        """The conninfo given, through this proxy."""
        return psycopg.conninfo.make_conninfo(
            "", **{**self._params, "host": "127.0.0.1", "port": self.port}
        )

    def silence(self) -> None:
        with self._lock:
            for _, _, silent in self._open:
                silent.set()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            for client, upstream, _ in self._open:
                for sock in (client, upstream):
                    with contextlib.suppress(OSError):
                        sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            family, address = self._upstream
            upstream = socket.socket(family, socket.SOCK_STREAM)
            upstream.connect(address)
            silent = threading.Event()
            with self._lock:
                self._open.append((client, upstream, silent))
            for source, target in ((client, upstream), (upstream, client)):
                threading.Thread(
                    target=self._pump, args=(source, target, silent), daemon=True
                ).start()

    @staticmethod
    def _pump(source: socket.socket, target: socket.socket, silent: threading.Event) -> None:
        source.settimeout(0.1)
        while not silent.is_set():
            try:
                data = source.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data or silent.is_set():
                if not data:
                    with contextlib.suppress(OSError):
                        target.shutdown(socket.SHUT_WR)
                return
            try:
                target.sendall(data)
            except OSError:
                return
