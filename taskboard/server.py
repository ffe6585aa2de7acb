"""How ``taskboard serve`` runs uvicorn, so that every server process stops cleanly.

On SIGTERM or SIGINT uvicorn shuts down gracefully: it stops accepting connections, waits
up to ``timeout_graceful_shutdown`` for the responses in progress, runs the application's
lifespan shutdown, and finally raises the signal again with the handler that was in place
before it started. Two parts of that do not suit this application:

- An event stream never ends by itself, and a waiting claim only when its wait is up:
  uvicorn would wait out the whole graceful period for them, then cancel them (logging a
  traceback each). So the application ends them as soon as the signal arrives
  (:func:`on_exit_signal`, used by taskboard.asgi); browsers and agents reconnect.
- The handler in place before uvicorn, for SIGTERM, is the default one: it ends the
  process on the spot, without running the ``atexit`` functions. The embedded PostgreSQL
  package releases a process's hold on the server in one, and stops the server after the
  last process (taskboard.embedded). :class:`Config` installs a SIGTERM handler that
  exits normally instead, with status 0, in every server process.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import gc
import json
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn
import uvicorn.protocols.http.httptools_impl
from django.core.exceptions import ImproperlyConfigured
from uvicorn.config import STARTUP_FAILURE
from uvicorn.supervisors import Multiprocess

from board import conf

EXIT_SIGNALS = (signal.SIGINT, signal.SIGTERM)


# Behind Pushpin (GRIP_URL set), every response closes its connection. Pushpin's requests
# to the board are made by zurl with libcurl, which sends a request again, on a new
# connection, when a connection it reused ends before any of the answer arrived: what a
# server process killed mid-request looks like, though PostgreSQL may already have carried
# the request out (or will, when a lock it waits for is released). Another process then
# carries it out a second time: two tasks from one create, a complete answered 409
# lease_lost after it succeeded. libcurl resends only a request made on a reused
# connection (it cannot tell a request the server never read from one it did): with no
# connection kept for a next request, a process's death reaches the client as Pushpin's
# 502, and the client decides (an Idempotency-Key makes a create safe to send again).
# The cost is a loopback connect per request: with 8 clients, 324-332 requests a second
# against 366-367 with connections kept, about 10% fewer (two processes on two shared
# cores, GET tasks/?limit=1; docs/decisions/0001-pushpin-connection-close.md).
BEHIND_PUSHPIN_HEADERS = [("connection", "close")]


class HttpToolsProtocol(uvicorn.protocols.http.httptools_impl.HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol (httptools, as uvicorn picks by default), with two
    changes uvicorn has no setting for:

    - Its answer to a request it cannot parse (a control character in a header, say) is
      the API's JSON error, as every other error body is, rather than uvicorn's plain text.
    - A connection must send a request's complete headers within ``header_timeout``
      seconds (:class:`Config`), counted from when it opens, and for a later request on
      the same connection from that request's first byte (the gap before it is
      uvicorn's ``timeout_keep_alive``); past it the connection is closed. uvicorn
      bounds only the idle time between requests, so a connection that never sent
      anything, or sent a header line now and then, was held open for good, each one a
      socket and a parser. Once the headers are in, nothing here limits the request:
      its body has its own deadline (board.http.middleware), and a response may last as long
      as it likes (a stream).
    """

    def __init__(self, config: uvicorn.Config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.header_timeout = float(getattr(config, "header_timeout", DEFAULT_HEADER_TIMEOUT))
        self.header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_header_deadline()  # a later request: the connection's own is spent

    def on_headers_complete(self) -> None:
        self._disarm_header_deadline()
        super().on_headers_complete()

    def _arm_header_deadline(self) -> None:
        if self.header_deadline is None:
            self.header_deadline = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _disarm_header_deadline(self) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
            self.header_deadline = None

    def _headers_too_slow(self) -> None:
        self.header_deadline = None
        if self.transport.is_closing():
            return
        # A 408 only where a request was begun and no response is being written: a
        # connection that sent nothing gets no unasked-for answer (some clients take one
        # for the answer to their next request), and a response in progress is not
        # interleaved with another.
        begun = self.headers is not None and (self.cycle is None or self.cycle.response_complete)
        if begun:
            body = json.dumps(
                {
                    "error": "request_timeout",
                    "detail": f"The request's headers did not arrive within "
                    f"{self.header_timeout:g} seconds.",
                }
            ).encode()
            self.transport.write(_plain_response(self, 408, "Request Timeout", body))
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        body = json.dumps({"error": "invalid", "detail": msg}).encode()
        self.transport.write(_plain_response(self, 400, "Bad Request", body))
        self.transport.close()


def _plain_response(protocol: HttpToolsProtocol, status: int, reason: str, body: bytes) -> bytes:
    """Return a whole response with a JSON ``body`` that closes the connection, written
    by the protocol itself (no application is involved)."""
    head = [f"HTTP/1.1 {status} {reason}\r\n".encode()]
    for name, value in protocol.server_state.default_headers:
        if name.lower() != b"connection":  # closed below in any case
            head += [name, b": ", value, b"\r\n"]
    head += [
        b"content-type: application/json\r\n",
        b"content-length: " + str(len(body)).encode() + b"\r\n",
        b"connection: close\r\n\r\n",
    ]
    return b"".join([*head, body])


DEFAULT_HEADER_TIMEOUT = 10.0


class Config(uvicorn.Config):
    """uvicorn's configuration, plus the preparation of each server process, and
    ``header_timeout`` (:class:`HttpToolsProtocol`)."""

    def __init__(
        self, *args: Any, header_timeout: float = DEFAULT_HEADER_TIMEOUT, **kwargs: Any
    ) -> None:
        self.header_timeout = header_timeout
        super().__init__(*args, **kwargs)

    def configure_logging(self) -> None:
        # uvicorn calls this first in every process that serves, before it takes over the
        # signals: in this process (Config.__init__) and in each worker process that
        # ``--workers`` spawns (uvicorn._subprocess.subprocess_started), which is handed
        # this Config. It is the one hook that runs in each of them at that point.
        super().configure_logging()
        global _serving
        _serving = True
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _exit_normally)
            _stop_with_the_supervisor()


def _stop_with_the_supervisor() -> None:
    """In a worker process of ``--workers``, ask the kernel for SIGTERM when the supervisor
    dies (Linux's PR_SET_PDEATHSIG): a supervisor killed with SIGKILL left its workers
    serving on the port (the next ``serve`` could not bind it) and holding the embedded
    database. They now stop as on SIGTERM, cleanly."""
    parent = multiprocessing.parent_process()
    if parent is None or not sys.platform.startswith("linux"):
        return  # the only server process, or no prctl
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        return
    if os.getppid() != parent.pid:  # it died before the request: no signal will come
        os.kill(os.getpid(), signal.SIGTERM)


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class Supervisor(Multiprocess):
    """uvicorn's supervisor of ``--workers`` processes, which lets go of the listening
    socket the moment SIGTERM or SIGINT arrives.

    uvicorn's notices a signal at its next poll (every 0.5 s), then stops the workers and
    waits for them, holding its copy of the socket all along: the kernel kept queueing new
    connections on it after every worker had stopped accepting, and reset them when the
    supervisor exited, each after hanging for up to half a second or the workers' graceful
    shutdown. Closed at once here, the socket goes with the last worker's copy, and later
    connections are refused straight away (a client or balancer then tries elsewhere).
    """

    def __init__(self, config: uvicorn.Config, sockets: list[socket.socket]) -> None:
        super().__init__(config, sockets)
        self._closing = False
        for sig in EXIT_SIGNALS:
            signal.signal(sig, self._exit_signal)

    def _exit_signal(self, signum: int, frame: FrameType | None) -> None:
        self._closing = True
        for sock in self.sockets:
            sock.close()
        self.signal_queue.append(signum)  # logged and acted on by uvicorn's loop, as before

    # The signal may land while the loop starts a worker (one that exited, or asked for by
    # SIGHUP or SIGTTIN): with the socket closed, none is started; a start under way fails
    # on the closed socket, which is what stopping wants.
    def keep_subprocess_alive(self) -> None:
        self._close_workers_ends()
        self._unless_closing(super().keep_subprocess_alive)

    def _close_workers_ends(self) -> None:
        """Close this process's copy of each started worker's end of its health-check pipe
        (the worker has its own from its start): a worker that dies while a check waits
        for its answer then ends the wait at once (end of file), where uvicorn, which keeps
        both ends, waited out the whole TASKBOARD_WORKER_TIMEOUT before replacing it."""
        for process in self.processes:
            if process.process.pid is not None and not process.child_conn.closed:
                process.child_conn.close()

    def handle_hup(self) -> None:
        self._unless_closing(super().handle_hup)

    def handle_ttin(self) -> None:
        self._unless_closing(super().handle_ttin)

    def _unless_closing(self, step: Callable[[], None]) -> None:
        if self._closing:
            return
        try:
            step()
        except (ValueError, OSError):
            if not self._closing:
                raise


def _exit_normally(signum: int, frame: FrameType | None) -> None:
    sys.exit(0)


_serving = False  # this process serves through Config (set in each server process)


def tune_garbage_collector() -> None:
    """Call once the server process has loaded everything (the lifespan's startup).

    What is loaded by then (Django, the apps, the URL conf: most of the process's objects)
    lives as long as the process: frozen, the garbage collector's full collections skip
    it. And a larger first generation: with a thousand open streams, each collection
    promoted every stream's in-flight waiter, which set off a full collection every second
    or two. In the fan-out benchmark's server processes each full collection paused every
    stream for 140 to 360 ms; with both changes none ran during the scenario, and its p99
    fell from 340 to 91 ms.

    Only in processes that ``serve`` runs: a server started inside another program (the
    tests' in-process servers) leaves that program's collector alone.
    """
    if not _serving:
        return
    gc.collect()  # what is garbage now is not frozen with the rest
    gc.freeze()
    gc.set_threshold(20_000, 20, 10)


class PortTaken(Exception):
    """The address to serve on cannot be bound; the message names it and says why."""


def bind(host: str, port: int) -> socket.socket:
    """Return a socket bound to ``host``:``port`` (not listening yet), for :func:`run`;
    raise PortTaken, naming the port, when it cannot be bound.

    ``serve`` binds before it says where it serves: bound by uvicorn later, a busy port
    failed after the banner had announced the board there. Until the server listens on
    it, connections are refused, as they were before it was bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family=family, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    # As uvicorn's own bind: a port left in TIME_WAIT by a previous run is usable at once.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if exc.errno == errno.EADDRINUSE:
            why = (
                f"port {port} is taken (something listens on {where}): stop it, or serve "
                "on another port (--port)"
            )
        else:
            why = f"cannot listen on {where}: {exc.strerror or exc}"
        raise PortTaken(why) from None
    sock.set_inheritable(True)  # the worker processes of --workers serve on it
    return sock


def run(config: Config, sock: socket.socket | None = None) -> None:
    """Serve ``config`` as ``uvicorn.run`` does, in one process or with workers, on
    ``sock`` (from :func:`bind`) when given.

    (``uvicorn.run`` takes keyword arguments and makes its own Config; this takes ours.)
    """
    server = uvicorn.Server(config)
    metrics_dir: str | None = None
    sockets_dir: str | None = None
    try:
        if config.workers > 1:
            # The processes learn where each listens for the /mcp/ requests of its sessions
            # that reach another (board.mcp.forwarding): a directory of mode 0700, so that
            # only this user reaches the sockets.
            # A socket's path may be 107 bytes at most: under a long TMPDIR, use /tmp.
            short = len(tempfile.gettempdir()) <= 60
            sockets_dir = tempfile.mkdtemp(prefix="taskboard-serve-", dir=None if short else "/tmp")
            os.environ["TASKBOARD_SERVE_SOCKETS"] = sockets_dir
            metrics_dir = _share_metrics()
            Supervisor(config, sockets=[sock or config.bind_socket()]).run()
        else:
            server.run(sockets=None if sock is None else [sock])
    except KeyboardInterrupt:
        pass
    finally:
        if config.uds and os.path.exists(config.uds):
            os.remove(config.uds)
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)
        if sockets_dir is not None:
            shutil.rmtree(sockets_dir, ignore_errors=True)
    if config.workers == 1 and not server.started:
        sys.exit(STARTUP_FAILURE)


def _share_metrics() -> str | None:
    """Let the worker processes add up what they measure for ``/metrics``; return the
    directory to remove when they have stopped (None: the operator's own).

    A scrape reaches one worker of N, and the claim latency histogram lives in the process
    that made each claim. prometheus_client's multiprocess mode, turned on by
    ``PROMETHEUS_MULTIPROC_DIR`` in the workers' environment (they are started after this,
    and read it when they first import the library), keeps each process's values in a file
    there, and a scrape of any worker sums them all (board.ops.metrics). A fresh directory per
    ``serve``, so that no count of an earlier run is added in; the operator's own directory
    is emptied of an earlier run's files (prometheus_client sums every file there).
    """
    if own := conf.prometheus_multiproc_dir():
        if not os.path.isdir(own):
            raise ImproperlyConfigured(f"PROMETHEUS_MULTIPROC_DIR is not a directory: {own}")
        for stale in Path(own).glob("*.db"):
            stale.unlink(missing_ok=True)
        return None
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory = tempfile.mkdtemp(
        prefix="taskboard-metrics-"
    )
    return directory


def on_exit_signal(callback: Callable[[], None]) -> None:
    """Call ``callback`` in the running event loop as soon as SIGINT or SIGTERM arrives,
    before uvicorn's graceful shutdown waits for open responses.

    Call it from the server's event loop once uvicorn has taken over the signals (the
    lifespan startup): the handlers it finds are uvicorn's, and are still called. A server
    that runs outside the main thread (tests/live.py) takes no signals: nothing to do.
    uvicorn puts back its own predecessors when it finishes, which drops these.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    loop = asyncio.get_running_loop()
    for sig in EXIT_SIGNALS:
        previous = signal.getsignal(sig)

        def handler(signum: int, frame: FrameType | None, previous: object = previous) -> None:
            loop.call_soon_threadsafe(callback)
            if callable(previous):
                previous(signum, frame)

        signal.signal(sig, handler)
